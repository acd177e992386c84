// The page's MQTT 5 session over the broker's websockets listener (mqtt5.js, the page's own small client).
// Requests carry an MQTT 5 Response Topic and Correlation Data, as the kit's RpcClient does.
import * as mqtt from "./mqtt5.js";

const utf8 = new TextDecoder();
const encoder = new TextEncoder();

// MQTT 5 CONNACK reason codes a person can act on (the rest are shown by number).
const REFUSED = { 128: "unspecified error", 133: "client id not valid", 134: "bad user name or password",
                  135: "not authorized", 136: "server unavailable", 137: "server busy", 138: "banned" };
// MQTT 5 PUBACK reason codes (MQTT 5.0, 3.4.2.1): 0 and 16 accepted, the rest refused
export const PUBACK_REASONS = { 0: "success", 16: "no matching subscribers", 128: "unspecified error",
                                131: "implementation specific error", 135: "not authorized",
                                144: "topic name invalid", 145: "packet identifier in use",
                                151: "quota exceeded", 153: "payload format invalid" };

function randomId(n = 8) {
  const b = new Uint8Array(n);
  crypto.getRandomValues(b);
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

export function decodeText(bytes) { return utf8.decode(bytes); }

export class Bus {
  // onMessage(topic, payloadBytes, contentType, retained); onState(state, detail); onSession() on every CONNACK
  // (before the subscriptions: the retained messages that follow belong to the new session); onSynced() once
  // the retained messages of the session's subscriptions have all been delivered (a message the page sent to
  // itself after the SUBACK came back: the broker queues a subscription's retained messages while it handles
  // the SUBSCRIBE and delivers one connection's QoS 1 messages in order, as shared/stop.py's nodes rely on);
  // stopTopic: the bus stop's topic name under the root (the document's `stop` channel); fleetStopTopic: the fleet
  // centre's latch (`stopFleet`, read only: the site's bridge writes it), null when the document has none
  constructor({ onMessage, onState, onSession = () => {}, onSynced = () => {}, stopTopic = "_stop",
                fleetStopTopic = null }) {
    this.onMessage = onMessage;
    this.onState = onState;
    this.onSession = onSession;
    this.onSynced = onSynced;
    this.stopName = stopTopic;
    this.fleetStopName = fleetStopTopic;
    this.client = null;
    this.pending = new Map(); // correlation hex -> {resolve, timer}
    this.clientId = `robobus-dash-${randomId(4)}`;
    this.watched = new Set(); // state topic filters subscribed: the states on screen
    this.extra = {}; // filters of other roots, subscribed on every connect (the fleet view's)
  }

  // State topics (the hand's 100 Hz joints, 50 Hz sensors, the camera) are subscribed only while they are on
  // screen: a message nobody looks at still costs the browser its websocket frame, the IPC to the renderer
  // and a wake-up of the page. Liveness, health and events stay subscribed for every device.
  watch(filter, on) {
    if (on === this.watched.has(filter)) return;
    if (on) this.watched.add(filter); else this.watched.delete(filter);
    const c = this.client;
    if (!c || !c.connected) return; // subscribed on (re)connect
    if (on) c.subscribe(filter, { qos: 0 });
    else c.unsubscribe(filter);
  }

  connect({ url, username, password, root }) {
    this.close();
    this.watched.clear();
    this.root = root;
    this.stopTopic = `${root}/${this.stopName}`;
    this.fleetTopic = this.fleetStopName ? `${root}/${this.fleetStopName}` : "";
    // at a fleet's centre: fleet-watch's verdict on the site ("1"/"0", retained); never published at a site
    this.reachableTopic = `${root}/_bridge/reachable`;
    // a broker that binds client ids to users (deploy/mosquitto/robobus_auth.c) accepts <user>-... only
    if (username && !this.clientId.startsWith(`${username}-`)) this.clientId = `${username}-${this.clientId}`;
    this.replyTopic = `${root}/_client/${this.clientId}/reply`;
    const opts = { protocolVersion: 5, clientId: this.clientId, clean: true, reconnectPeriod: 1000,
                   connectTimeout: 5000, keepalive: 15, properties: { sessionExpiryInterval: 0 } };
    if (username) { opts.username = username; opts.password = password || ""; }
    this.onState("connecting", url);
    const client = mqtt.connect(url, opts);
    this.client = client;
    client.on("connect", () => {
      if (client !== this.client) return;
      this.onSession();
      // State at QoS 0: the newest value wins anyway, and a 100 Hz state at QoS 1 would cost a PUBACK per
      // message from the browser. Liveness, health, events and replies at QoS 1. Device states: only those
      // on screen (watch); the nodes' own counters (`_node/state/stats`) always.
      const subs = { [`${root}/+/status`]: { qos: 1 }, [`${root}/+/+/health`]: { qos: 1 },
                     [`${root}/+/_node/state/#`]: { qos: 0 }, [`${root}/+/+/event/#`]: { qos: 1 },
                     [this.replyTopic]: { qos: 1 }, [this.stopTopic]: { qos: 1 },
                     [this.reachableTopic]: { qos: 1 } };
      if (this.fleetTopic) subs[this.fleetTopic] = { qos: 1 };
      for (const filter of this.watched) subs[filter] = { qos: 0 };
      for (const [filter, o] of Object.entries(this.extra)) if (!(filter in subs)) subs[filter] = o;
      client.subscribe(subs, (err) => {
        if (err) { this.onState("error", `subscribe failed: ${err.message}`); return; }
        this.onState("connected", url);
        this._request(this.replyTopic, { ok: true, result: {} }, 10000).then((rep) => {
          if (client === this.client && rep.ok) this.onSynced();
        });
      });
    });
    client.on("message", (topic, payload, packet) => {
      if (client !== this.client) return;
      if (topic === this.replyTopic) { this._reply(payload, packet); return; }
      const ctype = packet.properties && packet.properties.contentType;
      this.onMessage(topic, payload, ctype, packet.retain);
    });
    client.on("error", (err) => {
      if (client !== this.client) return;
      const why = REFUSED[err.code] || err.message || String(err);
      this.onState("error", why);
      // A refused login does not get better by retrying every second: stop and let the person fix it.
      if (err.code === 134 || err.code === 135 || err.code === 138) client.end(true);
    });
    client.on("offline", () => { if (client === this.client) this.onState("disconnected", "broker unreachable"); });
    client.on("reconnect", () => { if (client === this.client) this.onState("connecting", url); });
  }

  close() {
    if (this.client) { this.client.end(true); this.client = null; }
    for (const [, p] of this.pending) { clearTimeout(p.timer); p.resolve({ ok: false, error: { code: "timeout", message: "disconnected" } }); }
    this.pending.clear();
  }

  // One request with MQTT 5 Response Topic + Correlation Data; resolves with the parsed reply.
  call(node, device, command, body, timeoutMs = 10000) {
    return this._request(`${this.root}/${node}/${device}/cmd/${command}`, body, timeoutMs);
  }

  // The bus stop (a StopState object), retained at QoS 1 on {root}/_stop. Resolves with the broker's answer:
  // {code, text} from its PUBACK (code >= 128: refused, e.g. 135 not authorized: only the operator role may
  // write the stop), or {code: null, text} when the page is not connected or the connection ended first.
  publishStop(state, timeoutMs = 10000) {
    return new Promise((resolve) => {
      const c = this.client;
      if (!c || !c.connected) { resolve({ code: null, text: "not connected to the broker" }); return; }
      const timer = setTimeout(() => resolve({ code: null, text: `no PUBACK from the broker within ${timeoutMs / 1000} s` }),
                               timeoutMs);
      c.publish(this.stopTopic, JSON.stringify(state), { qos: 1, retain: true,
                                                         properties: { contentType: "application/json" } },
        (code) => {
          clearTimeout(timer);
          if (code === null) resolve({ code, text: "the connection to the broker ended before it acknowledged" });
          else resolve({ code, text: PUBACK_REASONS[code] || `reason code ${code}` });
        });
    });
  }

  _request(topic, body, timeoutMs) {
    const corr = randomId(8);
    return new Promise((resolve) => {
      if (!this.client || !this.client.connected) {
        resolve({ ok: false, error: { code: "unavailable", message: "not connected to the broker" } });
        return;
      }
      const timer = setTimeout(() => {
        this.pending.delete(corr);
        resolve({ ok: false, error: { code: "timeout", message: `no reply within ${timeoutMs / 1000} s` } });
      }, timeoutMs);
      this.pending.set(corr, { resolve, timer });
      // the request's age is the time we wait for its reply: a node that reads it later never runs it
      // (the robobus-deadline user property, Unix ms; docs/kit.md "A command has an age")
      this.client.publish(topic, JSON.stringify(body), {
        qos: 1,
        properties: { responseTopic: this.replyTopic, correlationData: encoder.encode(corr),
                      contentType: "application/json", messageExpiryInterval: Math.ceil(timeoutMs / 1000),
                      userProperties: { "robobus-deadline": String(Date.now() + timeoutMs) } },
      });
    });
  }

  _reply(payload, packet) {
    const cd = packet.properties && packet.properties.correlationData;
    const key = cd ? utf8.decode(cd) : "";
    const p = this.pending.get(key);
    if (!p) return; // a late reply after its timeout
    this.pending.delete(key);
    clearTimeout(p.timer);
    try { p.resolve(JSON.parse(utf8.decode(payload))); }
    catch (e) { p.resolve({ ok: false, error: { code: "invalid_reply", message: `reply is not JSON: ${e.message}` } }); }
  }
}
