// Validate an AsyncAPI document with the official parser; print diagnostics, exit 1 on errors.
import { readFileSync } from 'node:fs';
import { Parser, DiagnosticSeverity } from '@asyncapi/parser';

const file = process.argv[2];
const parser = new Parser();
const { document, diagnostics } = await parser.parse(readFileSync(file, 'utf8'));
const errors = diagnostics.filter((d) => d.severity === DiagnosticSeverity.Error);
const warnings = diagnostics.filter((d) => d.severity === DiagnosticSeverity.Warning);
for (const d of diagnostics) {
  const sev = ['error', 'warning', 'info', 'hint'][d.severity];
  console.log(`${sev}: ${d.code}: ${d.message} at ${JSON.stringify(d.path)}`);
}
console.log(JSON.stringify({ valid: !!document && errors.length === 0, errors: errors.length,
  warnings: warnings.length, channels: document ? document.channels().length : 0,
  operations: document ? document.operations().length : 0 }));
process.exit(document && errors.length === 0 ? 0 : 1);
