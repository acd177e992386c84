// A Foxglove WebSocket client made of the protocol's own implementation (@foxglove/ws-protocol's FoxgloveClient,
// on the `ws` package), independent of the Foxglove SDK that `robobus foxglove` serves with. Driven by
// tests/foxglove over its standard input and output, one JSON object a line:
//   node client.js ws://127.0.0.1:PORT
//   out: {"event":"serverInfo",...} {"event":"advertise","topics":[...]} {"event":"unadvertise","topics":[...]}
//        {"event":"services","added":[...],"removed":[...]}
//   in:  {"op":"call","id":1,"service":"robobus/n/d/cmd/x","request":{...}}  -> {"event":"response","id":1,...}
//        {"op":"report","id":2}                                              -> {"event":"report","id":2,...}
// It subscribes to every channel as it is advertised, validates every message against the JSON Schema the
// channel advertised (Ajv, draft 2020-12) and every service response against the service's response schema;
// a foxglove.CompressedImage must also carry a JPEG (its base64 data decoded). The subprotocol is the SDK's,
// `foxglove.sdk.v1` (what the Foxglove app offers an SDK server; the SDK refuses the older name).
"use strict";
const { FoxgloveClient } = require("@foxglove/ws-protocol");
const WebSocket = require("ws");
const Ajv2020 = require("ajv/dist/2020").default;
const readline = require("readline");

const url = process.argv[2];
const ajv = new Ajv2020({ strict: false, allErrors: false, validateFormats: false });
const client = new FoxgloveClient({ ws: new WebSocket(url, ["foxglove.sdk.v1"]) });
const decoder = new TextDecoder();
const encoder = new TextEncoder();

const channels = new Map(); // channel id -> {topic, schemaName, validate}
const subscriptions = new Map(); // subscription id -> channel id
const stats = new Map(); // topic -> {schemaName, encoding, messages, invalid, errors[], last, lastTimestamp, logTimeOk}
const services = new Map(); // service id -> {name, validate, requestSchemaName, responseSchemaName}
const calls = new Map(); // call id -> request id
let nextCall = 1;
let serverInfo = null;

function out(obj) {
  process.stdout.write(JSON.stringify(obj, (_k, v) => (typeof v === "bigint" ? v.toString() : v)) + "\n");
}

function compile(schemaText, what) {
  try {
    return ajv.compile(JSON.parse(schemaText));
  } catch (err) {
    out({ event: "schemaError", what, error: String(err) });
    return null;
  }
}

client.on("serverInfo", (info) => {
  serverInfo = info;
  out({ event: "serverInfo", name: info.name, capabilities: info.capabilities, encodings: info.supportedEncodings });
});
client.on("error", (err) => out({ event: "error", error: String(err) }));
client.on("status", (st) => out({ event: "status", level: st.level, message: st.message, statusId: st.id }));
client.on("removeStatus", (st) => out({ event: "removeStatus", statusIds: st.statusIds }));
client.on("close", () => {
  out({ event: "closed" });
  process.exit(0);
});

client.on("advertise", (chs) => {
  for (const ch of chs) {
    const validate = ch.schemaEncoding === "jsonschema" && ch.schema ? compile(ch.schema, ch.topic) : null;
    channels.set(ch.id, { topic: ch.topic, schemaName: ch.schemaName, validate });
    const s = stats.get(ch.topic) || { messages: 0, invalid: 0, errors: [], advertised: 0 };
    Object.assign(s, { schemaName: ch.schemaName, encoding: ch.encoding, schemaEncoding: ch.schemaEncoding,
                       hasValidator: validate !== null, advertised: s.advertised + 1 });
    stats.set(ch.topic, s);
    subscriptions.set(client.subscribe(ch.id), ch.id);
  }
  out({ event: "advertise", topics: chs.map((c) => c.topic) });
});

client.on("unadvertise", (ids) => {
  const topics = ids.map((id) => (channels.get(id) || {}).topic);
  for (const id of ids) channels.delete(id);
  out({ event: "unadvertise", topics });
});

client.on("message", (m) => {
  const ch = channels.get(subscriptions.get(m.subscriptionId));
  if (!ch) return;
  const s = stats.get(ch.topic);
  s.messages += 1;
  const now = BigInt(Date.now()) * 1000000n;
  // the log time is the bridge's receive time: within a few seconds of now on one host
  const skew = now > m.timestamp ? now - m.timestamp : m.timestamp - now;
  s.maxSkewMs = Math.max(s.maxSkewMs || 0, Number(skew / 1000000n));
  let msg;
  try {
    msg = JSON.parse(decoder.decode(m.data));
  } catch (err) {
    s.invalid += 1;
    if (s.errors.length < 3) s.errors.push(`not JSON: ${err}`);
    return;
  }
  if (ch.validate && !ch.validate(msg)) {
    s.invalid += 1;
    if (s.errors.length < 3) s.errors.push(ajv.errorsText(ch.validate.errors));
  }
  if (ch.schemaName === "foxglove.CompressedImage") {
    const bytes = Buffer.from(msg.data || "", "base64");
    if (!(bytes.length > 2 && bytes[0] === 0xff && bytes[1] === 0xd8) || msg.format !== "jpeg") {
      s.invalid += 1;
      if (s.errors.length < 3) s.errors.push("not a JPEG image");
    } else {
      s.jpegs = (s.jpegs || 0) + 1;
    }
  }
  s.last = msg;
  s.lastLogTime = m.timestamp;
});

client.on("advertiseServices", (list) => {
  for (const sv of list) {
    services.set(sv.id, {
      name: sv.name, type: sv.type,
      requestSchemaName: sv.request && sv.request.schemaName,
      responseSchemaName: sv.response && sv.response.schemaName,
      validateRequest: sv.request ? compile(sv.request.schema, `${sv.name} request`) : null,
      validate: sv.response ? compile(sv.response.schema, `${sv.name} response`) : null,
    });
  }
  out({ event: "services", added: list.map((s) => s.name), removed: [] });
});

client.on("unadvertiseServices", (ids) => {
  const names = ids.map((id) => (services.get(id) || {}).name);
  for (const id of ids) services.delete(id);
  out({ event: "services", added: [], removed: names });
});

function finish(callId, fields) {
  const req = calls.get(callId);
  if (req === undefined) return;
  calls.delete(callId);
  out({ event: "response", id: req.id, ...fields });
}

client.on("serviceCallResponse", (r) => {
  const req = calls.get(r.callId);
  if (!req) return;
  let body = null;
  let valid = false;
  let errors = "";
  try {
    body = JSON.parse(decoder.decode(r.data));
    valid = req.validate ? req.validate(body) : true;
    if (!valid) errors = ajv.errorsText(req.validate.errors);
  } catch (err) {
    errors = `not JSON: ${err}`;
  }
  finish(r.callId, { ok: true, body, valid, errors, ms: Date.now() - req.sent });
});

client.on("serviceCallFailure", (f) => finish(f.callId, { ok: false, failure: f.message }));

function call(cmd) {
  const entry = [...services.entries()].find(([, s]) => s.name === cmd.service);
  if (!entry) {
    out({ event: "response", id: cmd.id, ok: false, failure: `no service ${cmd.service}` });
    return;
  }
  const [serviceId, sv] = entry;
  const requestValid = sv.validateRequest ? sv.validateRequest(cmd.request) : true;
  const callId = nextCall++;
  calls.set(callId, { id: cmd.id, validate: sv.validate, sent: Date.now() });
  client.sendServiceCallRequest({ serviceId, callId, encoding: "json",
                                  data: encoder.encode(JSON.stringify(cmd.request)) });
  if (!requestValid) out({ event: "note", id: cmd.id, requestValid });
}

function report(cmd) {
  const topics = {};
  for (const [topic, s] of stats) {
    topics[topic] = { schemaName: s.schemaName, encoding: s.encoding, schemaEncoding: s.schemaEncoding,
                      hasValidator: s.hasValidator, messages: s.messages, invalid: s.invalid, errors: s.errors,
                      jpegs: s.jpegs || 0, maxSkewMs: s.maxSkewMs || 0, lastLogTime: s.lastLogTime, advertised: s.advertised,
                      live: [...channels.values()].some((c) => c.topic === topic),
                      last: s.schemaName === "foxglove.CompressedImage" && s.last
                        ? { format: s.last.format, frame_id: s.last.frame_id, timestamp: s.last.timestamp } : s.last };
  }
  const svcs = [...services.values()].map((s) => ({ name: s.name, type: s.type, request: s.requestSchemaName,
                                                     response: s.responseSchemaName,
                                                     validators: Boolean(s.validate && s.validateRequest) }));
  out({ event: "report", id: cmd.id, serverInfo, topics, services: svcs });
}

readline.createInterface({ input: process.stdin }).on("line", (line) => {
  if (!line.trim()) return;
  const cmd = JSON.parse(line);
  if (cmd.op === "call") call(cmd);
  else if (cmd.op === "report") report(cmd);
  else if (cmd.op === "close") client.close();
});
