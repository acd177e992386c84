// A generic tool's reading of the document: which channel a published topic belongs to, and whether its
// payload is one of that channel's messages. Channels come from the official parser's model; an address
// parameter stands for one topic level (MQTT's `+`), as in AsyncAPI tools generally. Usage:
//   node match.mjs <asyncapi.yaml> <messages.json>
// messages.json: [{"topic": "...", "payload": "<text>"}, ...]. Prints one JSON line:
//   {"results": [{"topic", "channels": [ids], "valid": [channel/message ids the payload is valid for]}]}
// (the parser's diagnostics go to stderr; exit 1 when it does not accept the document).
import { readFileSync } from 'node:fs';
import { Parser, DiagnosticSeverity } from '@asyncapi/parser';
// Ajv is the parser's own JSON Schema validator (a dependency of it, pinned by package-lock.json)
import Ajv2020 from 'ajv/dist/2020.js';

const [docFile, messagesFile] = process.argv.slice(2);
const { document, diagnostics } = await new Parser().parse(readFileSync(docFile, 'utf8'));
const errors = diagnostics.filter((d) => d.severity === DiagnosticSeverity.Error);
if (!document || errors.length) {
  for (const d of errors) console.error(`${d.code}: ${d.message} at ${JSON.stringify(d.path)}`);
  process.exit(1);
}
const escape = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
const ajv = new Ajv2020({ strict: false, validateFormats: false });
const routes = [];
for (const channel of document.channels()) {
  const address = channel.address();
  if (!address) continue;  // a runtime address (a reply's Response Topic): nothing to match
  const pattern = address.split(/(\{[^}]+\})/).map((part) => (/^\{[^}]+\}$/.test(part) ? '[^/]+' : escape(part))).join('');
  const messages = channel.messages().all().map((m) => ({ id: m.id(), validate: ajv.compile(m.payload().json()),
    json: m.contentType() === undefined || m.contentType() === 'application/json' }));
  routes.push({ id: channel.id(), re: new RegExp(`^${pattern}$`), messages });
}
const results = [];
for (const { topic, payload } of JSON.parse(readFileSync(messagesFile, 'utf8'))) {
  const hits = routes.filter((r) => r.re.test(topic));
  const valid = [];
  for (const r of hits) {
    for (const m of r.messages) {
      let data;
      try { data = m.json ? JSON.parse(payload) : payload; } catch { continue; }
      if (!m.json || m.validate(data)) valid.push(`${r.id}/${m.id}`);
    }
  }
  results.push({ topic, channels: hits.map((r) => r.id), valid });
}
console.log(JSON.stringify({ results }));
