// A small MQTT 5 client over the broker's websockets listener: what the page uses, nothing more (clean
// start, QoS 0 and 1, subscribe/unsubscribe, the PUBLISH properties of requests and replies, keepalive,
// reconnect). It replaces mqtt.js's browser bundle, whose Node shims (streams, Buffer, a process.nextTick
// made of setTimeout) cost the page a timer task, several stream callbacks and copies per message: at the
// hand's 100 Hz joints beside two e-pucks (~200 messages/s) that was most of the page's own JavaScript.
// Here a websocket frame is parsed in place: the payload handed on is a view into the frame, not a copy.

const utf8 = new TextDecoder();
const encoder = new TextEncoder();

const CONNECT = 1, CONNACK = 2, PUBLISH = 3, PUBACK = 4, SUBSCRIBE = 8, SUBACK = 9, UNSUBSCRIBE = 10,
      UNSUBACK = 11, PINGREQ = 12, PINGRESP = 13, DISCONNECT = 14;

// PUBLISH property ids (MQTT 5.0, 2.2.2.2) and how each is encoded
const PROPS = {
  0x01: "byte", 0x02: "u32", 0x03: "string", 0x08: "string", 0x09: "binary", 0x0b: "varint", 0x23: "u16",
  0x26: "pair", 0x11: "u32", 0x12: "string", 0x13: "u16", 0x15: "string", 0x16: "binary", 0x17: "byte",
  0x19: "byte", 0x1a: "string", 0x1c: "string", 0x1f: "string", 0x21: "u16", 0x22: "u16", 0x24: "byte",
  0x25: "byte", 0x27: "u32", 0x28: "byte", 0x29: "byte", 0x2a: "byte",
};
const NAMES = { 0x03: "contentType", 0x08: "responseTopic", 0x09: "correlationData", 0x1f: "reasonString" };

class MqttError extends Error {
  constructor(message, code) { super(message); this.code = code; }
}

// -- encoding -------------------------------------------------------------------------------------------
class Writer {
  constructor() { this.parts = []; this.n = 0; }
  bytes(b) { this.parts.push(b); this.n += b.length; return this; }
  byte(x) { return this.bytes(Uint8Array.of(x)); }
  u16(x) { return this.bytes(Uint8Array.of(x >> 8, x & 255)); }
  u32(x) { return this.bytes(Uint8Array.of(x >>> 24, (x >> 16) & 255, (x >> 8) & 255, x & 255)); }
  varint(x) {
    const out = [];
    do { let b = x % 128; x = Math.floor(x / 128); if (x > 0) b |= 128; out.push(b); } while (x > 0);
    return this.bytes(Uint8Array.from(out));
  }
  binary(b) { return this.u16(b.length).bytes(b); }
  string(s) { return this.binary(encoder.encode(s)); }
  concat() {
    const out = new Uint8Array(this.n);
    let o = 0;
    for (const p of this.parts) { out.set(p, o); o += p.length; }
    return out;
  }
}

function packet(type, flags, body) {
  const b = body ? body.concat() : new Uint8Array(0);
  return new Writer().byte((type << 4) | flags).varint(b.length).bytes(b).concat();
}

function publishProps(props = {}) {
  const w = new Writer();
  if (props.messageExpiryInterval !== undefined) w.byte(0x02).u32(props.messageExpiryInterval);
  if (props.contentType !== undefined) w.byte(0x03).string(props.contentType);
  if (props.responseTopic !== undefined) w.byte(0x08).string(props.responseTopic);
  if (props.correlationData !== undefined) {
    w.byte(0x09).binary(typeof props.correlationData === "string" ? encoder.encode(props.correlationData)
                                                                  : props.correlationData);
  }
  for (const [k, v] of Object.entries(props.userProperties || {})) w.byte(0x26).string(k).string(String(v));
  return w;
}

// -- decoding -------------------------------------------------------------------------------------------
// read a variable byte integer at o: [value, next offset], or null when the bytes are not all there
function varint(b, o, end) {
  let v = 0, mul = 1;
  for (let i = 0; i < 4; i++) {
    if (o >= end) return null;
    const x = b[o++];
    v += (x & 127) * mul;
    if (!(x & 128)) return [v, o];
    mul *= 128;
  }
  throw new MqttError("malformed variable byte integer", 0x81);
}

// properties at o (their length first): [props object, offset after them]
function readProps(b, o) {
  const [len, start] = varint(b, o, b.length);
  const end = start + len;
  const props = {};
  let p = start;
  while (p < end) {
    const [id, q] = varint(b, p, end);
    p = q;
    const kind = PROPS[id];
    let v;
    if (kind === "byte") { v = b[p]; p += 1; }
    else if (kind === "u16") { v = (b[p] << 8) | b[p + 1]; p += 2; }
    else if (kind === "u32") { v = ((b[p] << 24) >>> 0) + (b[p + 1] << 16) + (b[p + 2] << 8) + b[p + 3]; p += 4; }
    else if (kind === "varint") { [v, p] = varint(b, p, end); }
    else if (kind === "string" || kind === "binary") {
      const n = (b[p] << 8) | b[p + 1];
      const raw = b.subarray(p + 2, p + 2 + n);
      v = kind === "string" ? utf8.decode(raw) : raw;
      p += 2 + n;
    } else if (kind === "pair") {
      const n1 = (b[p] << 8) | b[p + 1];
      const n2 = (b[p + 2 + n1] << 8) | b[p + 3 + n1];
      p += 4 + n1 + n2;
      continue; // user properties: the page has no use for them
    } else throw new MqttError(`unknown property 0x${id.toString(16)}`, 0x81);
    props[NAMES[id] || id] = v;
  }
  if (p !== end) throw new MqttError("malformed properties", 0x81);
  return [props, end];
}

// -- the client -----------------------------------------------------------------------------------------
// Events as mqtt.js names them: connect, message (topic, payload bytes, {retain, qos, properties}), error
// (err.code = the CONNACK or DISCONNECT reason code), offline, reconnect, close.
export class MqttClient {
  constructor(url, opts) {
    this.url = url;
    this.opts = opts;
    this.handlers = {};
    this.connected = false;
    this.ended = false;
    this.ws = null;
    this.nextId = 1;
    this.acks = new Map(); // packet id -> callback(reason codes) for SUBACK, UNSUBACK, PUBACK
    this.rest = null;      // an incomplete packet from the previous websocket frame
    this.frames = 0;       // websocket frames received (the benchmark counts them: each costs the browser)
    this.timers = [];
    this.open();
  }

  on(event, fn) { (this.handlers[event] ||= []).push(fn); return this; }
  emit(event, ...args) { for (const fn of this.handlers[event] || []) fn(...args); }

  open() {
    const ws = new WebSocket(this.url, "mqtt");
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    this.rest = null;
    this.heard = true;
    const connectTimer = setTimeout(() => { if (!this.connected && this.ws === ws) ws.close(); },
                                    this.opts.connectTimeout || 30000);
    ws.onopen = () => ws.send(this.connectPacket());
    ws.onmessage = (ev) => {
      if (this.ws !== ws) return;
      this.frames++;
      try { this.receive(new Uint8Array(ev.data)); }
      catch (e) { this.emit("error", e); this.send(packet(DISCONNECT, 0, new Writer().byte(e.code || 0x81))); ws.close(); }
    };
    ws.onclose = () => {
      clearTimeout(connectTimer);
      if (this.ws !== ws) return;
      this.dropSession();
      this.emit("close");
      if (this.ended) return;
      this.emit("offline");
      const t = setTimeout(() => {
        this.timers = this.timers.filter((x) => x !== t);
        if (this.ended) return;
        this.emit("reconnect");
        this.open();
      }, this.opts.reconnectPeriod || 1000);
      this.timers.push(t);
    };
  }

  dropSession() {
    this.connected = false;
    clearInterval(this.pinger);
    for (const cb of this.acks.values()) cb(null);
    this.acks.clear();
  }

  connectPacket() {
    const o = this.opts;
    const w = new Writer().string("MQTT").byte(5);
    let flags = 0x02; // clean start
    if (o.username !== undefined) flags |= 0x80;
    if (o.password !== undefined) flags |= 0x40;
    w.byte(flags).u16(o.keepalive || 0);
    const props = new Writer();
    const expiry = o.properties && o.properties.sessionExpiryInterval;
    if (expiry) props.byte(0x11).u32(expiry);
    w.varint(props.n).bytes(props.concat());
    w.string(o.clientId);
    if (o.username !== undefined) w.string(o.username);
    if (o.password !== undefined) w.string(o.password);
    return packet(CONNECT, 0, w);
  }

  send(bytes) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(bytes);
  }

  id() {
    const id = this.nextId;
    this.nextId = id === 65535 ? 1 : id + 1;
    return id;
  }

  // one websocket frame: any number of whole packets, the last one possibly continued in the next frame
  receive(frame) {
    let b = frame;
    if (this.rest) {
      b = new Uint8Array(this.rest.length + frame.length);
      b.set(this.rest);
      b.set(frame, this.rest.length);
      this.rest = null;
    }
    let o = 0;
    while (o < b.length) {
      const len = varint(b, o + 1, b.length);
      if (!len || len[1] + len[0] > b.length) { this.rest = b.slice(o); return; }
      const [n, start] = len;
      this.heard = true;
      this.handle(b[o] >> 4, b[o] & 15, b.subarray(start, start + n));
      o = start + n;
    }
  }

  handle(type, flags, p) {
    if (type === PUBLISH) {
      const qos = (flags >> 1) & 3;
      const tn = (p[0] << 8) | p[1];
      const topic = utf8.decode(p.subarray(2, 2 + tn));
      let o = 2 + tn, pid = 0;
      if (qos > 0) { pid = (p[o] << 8) | p[o + 1]; o += 2; }
      const [properties, start] = readProps(p, o);
      if (qos === 1) this.send(Uint8Array.of(PUBACK << 4, 2, pid >> 8, pid & 255));
      this.emit("message", topic, p.subarray(start), { topic, qos, retain: !!(flags & 1), properties });
    } else if (type === CONNACK) {
      const code = p[1];
      if (code >= 0x80) {
        const [props] = p.length > 2 ? readProps(p, 2) : [{}];
        this.emit("error", new MqttError(`Connection refused: ${props.reasonString || code}`, code));
        return; // the broker closes the connection
      }
      this.connected = true;
      const ka = this.opts.keepalive || 0;
      if (ka > 0) {
        // no answer for a whole keepalive period: the connection is dead, reconnect
        this.pinger = setInterval(() => {
          if (!this.heard) { this.ws.close(); return; }
          this.heard = false;
          this.send(Uint8Array.of(PINGREQ << 4, 0));
        }, ka * 1000);
      }
      this.emit("connect");
    } else if (type === SUBACK || type === UNSUBACK || type === PUBACK) {
      const pid = (p[0] << 8) | p[1];
      const cb = this.acks.get(pid);
      if (!cb) return;
      this.acks.delete(pid);
      if (type === PUBACK) { cb(p.length > 2 ? [p[2]] : [0]); return; }
      const [, start] = readProps(p, 2);
      cb(Array.from(p.subarray(start)));
    } else if (type === DISCONNECT) {
      const code = p.length ? p[0] : 0;
      const [props] = p.length > 1 ? readProps(p, 1) : [{}];
      this.emit("error", new MqttError(`disconnected by the broker: ${props.reasonString || `reason ${code}`}`, code));
    } else if (type !== PINGRESP) {
      throw new MqttError(`unexpected packet type ${type}`, 0x82);
    }
  }

  // subscribe({filter: {qos}, ...}, cb) or subscribe(filter, {qos}, cb); cb(err) on the SUBACK
  subscribe(filters, opts, cb) {
    if (typeof filters === "string") filters = { [filters]: opts || { qos: 0 } };
    else cb = opts;
    const pid = this.id();
    const w = new Writer().u16(pid).varint(0);
    for (const [f, o] of Object.entries(filters)) w.string(f).byte((o && o.qos) || 0);
    if (cb) {
      this.acks.set(pid, (codes) => {
        if (!codes) cb(new Error("connection lost"));
        else if (codes.some((c) => c >= 0x80)) cb(new Error(`subscription refused (reason ${codes.find((c) => c >= 0x80)})`));
        else cb(null);
      });
    }
    this.send(packet(SUBSCRIBE, 2, w));
  }

  unsubscribe(filter) {
    const w = new Writer().u16(this.id()).varint(0).string(filter);
    this.send(packet(UNSUBSCRIBE, 2, w));
  }

  // cb (QoS 1 only): cb(reasonCode) on the PUBACK (0 or 16 accepted, 128 and above refused: MQTT 5.0, 3.4.2.1),
  // cb(null) when the connection ends before it
  publish(topic, payload, { qos = 0, retain = false, properties } = {}, cb) {
    const w = new Writer().string(topic);
    if (qos > 0) {
      const pid = this.id();
      w.u16(pid);
      if (cb) this.acks.set(pid, (codes) => cb(codes ? codes[0] : null));
    }
    const props = publishProps(properties);
    w.varint(props.n).bytes(props.concat());
    w.bytes(typeof payload === "string" ? encoder.encode(payload) : payload);
    this.send(packet(PUBLISH, (qos << 1) | (retain ? 1 : 0), w));
  }

  end() {
    this.ended = true;
    for (const t of this.timers) clearTimeout(t);
    const ws = this.ws;
    if (this.connected) this.send(Uint8Array.of(DISCONNECT << 4, 0));
    this.dropSession();
    if (ws) ws.close();
  }
}

export function connect(url, opts) { return new MqttClient(url, opts); }
