// What the AsyncAPI document says about each service: its states, events and commands, with schemas.
// Nothing here names a service: a new service shows up in the dashboard by being in the document.
//
// The document's channels are `<root>/{node}/{device}/<kind>/<name>` with ids `<service>_<kind>_<name>`
// (shared/tools/asyncapi.py); the service is the id with `_<kind>_<name>` cut off. <root> is the `{root}`
// parameter, or the root itself in the document the server makes for its root (`site1/robobus/{node}/...`).

import { stopTopics } from "./stop.js";

const DEVICE_ADDRESS = /^(?:\{root\}|[^{}]+)\/\{node\}\/\{device\}\/(state|event|cmd|stream)\/([^/]+)$/;
// The bus stop (shared/stop.py): the `stop` channel `<root>/_stop` and the fleet centre's latch, the `stopFleet`
// channel `<root>/_stop/fleet` (both x-robobus kind "stop": stop.js's stopTopics), and each node's answer, the
// `stopAnswer` channel `<root>/{node}/_node/state/stop`.
const ANSWER_ADDRESS = /^(?:\{root\}|[^{}]+)\/\{node\}\/_node\/state\/([^/]+)$/;
const DOC_ID = "robobus:asyncapi";

export class Contract {
  constructor(doc) {
    this.doc = doc;
    this.schemas = doc.components.schemas;
    this.services = new Map();
    const messages = doc.components.messages;
    // {topic, fleetTopic: names under the root, schema (StopState), answer: the state name, answerSchema}
    this.stop = null;
    const topics = stopTopics(doc);
    const stopCh = topics && Object.values(doc.channels).find((ch) => ch["x-robobus"] && ch["x-robobus"].kind === "stop" &&
      ch.address.endsWith(`/${topics.topic}`));
    if (stopCh) {
      const payload = (ch) => messages[Object.values(ch.messages)[0].$ref.split("/").pop()].payload;
      const answerCh = Object.values(doc.channels).find((ch) => ch.address && ANSWER_ADDRESS.test(ch.address) &&
        Object.values(ch.messages).some((m) => m.$ref.endsWith("/StopAnswer")));
      this.stop = { topic: topics.topic, fleetTopic: topics.fleetTopic, schema: payload(stopCh),
                    answer: answerCh ? ANSWER_ADDRESS.exec(answerCh.address)[1] : "stop",
                    answerSchema: answerCh ? payload(answerCh) : null };
    }
    for (const [cid, ch] of Object.entries(doc.channels)) {
      const m = ch.address && DEVICE_ADDRESS.exec(ch.address);
      if (!m) continue;
      const [, kind, name] = m;
      const suffix = `_${kind}_${name}`;
      if (!cid.endsWith(suffix)) continue;
      const service = cid.slice(0, -suffix.length);
      const ref = Object.values(ch.messages)[0].$ref.split("/").pop();
      const msg = messages[ref];
      const svc = this.service(service);
      const entry = { name, schema: msg.payload, contentType: msg.contentType || "application/json",
                      doc: msg.summary || name, description: ch.description || "" };
      if (kind === "state") svc.states.set(name, entry);
      else if (kind === "event") svc.events.set(name, entry);
      else if (kind === "cmd") {
        const reply = messages[`${cid}_reply`];
        const result = reply && reply.payload.oneOf && reply.payload.oneOf[0].properties.result;
        entry.job = !!(result && result.$ref && result.$ref.endsWith("/JobAccepted"));
        // a motion command: the bus stop refuses it (its operation lists the code `stopped`)
        const op = doc.operations && doc.operations[cid];
        entry.motion = !!(op && op["x-robobus"] && (op["x-robobus"].errors || []).includes("stopped"));
        if (entry.motion) svc.motion = true;
        svc.commands.set(name, entry);
      }
    }
    const Ajv = window.ajv2020 && (window.ajv2020.default || window.ajv2020);
    // allErrors: every wrong field at once; formats are documentation here (e.g. "binary"), not checks.
    this.ajv = new Ajv({ allErrors: true, strict: false, validateFormats: false });
    this.ajv.addSchema({ $id: DOC_ID, components: { schemas: this.schemas } });
    this.validators = new Map();
  }

  service(name) {
    let s = this.services.get(name);
    if (!s) { s = { states: new Map(), events: new Map(), commands: new Map(), motion: false }; this.services.set(name, s); }
    return s;
  }

  // "#/components/schemas/X" -> the schema object (one level; callers resolve nested refs as they walk).
  resolve(schema) {
    let s = schema;
    for (let i = 0; s && s.$ref && i < 16; i++) s = this.schemas[s.$ref.split("/").pop()];
    return s || {};
  }

  // validate(schema, value) -> [] or [{path, message}] with Ajv's messages (the schema's words).
  validate(schema, value) {
    const key = JSON.stringify(schema);
    let v = this.validators.get(key);
    if (!v) {
      v = this.ajv.compile({ $id: `${DOC_ID}/request/${this.validators.size}`, ...rebase(schema) });
      this.validators.set(key, v);
    }
    if (v(value)) return [];
    return v.errors.map((e) => {
      let path = e.instancePath.replace(/^\//, "").replaceAll("/", ".");
      let message = e.message;
      if (e.keyword === "required") { path = [path, e.params.missingProperty].filter(Boolean).join("."); message = "is required"; }
      if (e.keyword === "additionalProperties") { message = `unknown field ${e.params.additionalProperty}`; }
      return { path, message, keyword: e.keyword };
    });
  }
}

// The request schemas point into the document ("#/components/..."); compiled on their own they must
// point at the document by its id.
function rebase(node) {
  if (Array.isArray(node)) return node.map(rebase);
  if (node && typeof node === "object") {
    const out = {};
    for (const [k, v] of Object.entries(node)) {
      out[k] = k === "$ref" && typeof v === "string" && v.startsWith("#/") ? `${DOC_ID}${v}` : rebase(v);
    }
    return out;
  }
  return node;
}
