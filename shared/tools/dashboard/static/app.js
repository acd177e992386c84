// robobus dashboard: every node and device on the bus, from the retained status and health topics, live
// state as charts and values, camera images, a form for every command, jobs and an event log.
// Messages only update the model; the DOM is drawn on animation frames at a few Hz per kind of content,
// so a 100 Hz state costs a JSON.parse and a few array writes, not a layout.
import { Bus, decodeText } from "./bus.js";
import { Fleet, parseSites } from "./fleet.js";
import { Contract } from "./contract.js";
import { buildCommandForm, splitDoc } from "./forms.js";
import { Series, drawSparkline, formatValue } from "./charts.js";
import { CHANNELS, FLEET, SITE, activeChannels, answerCurrent, banner, deviceHead, effective, newLatch,
         readStop } from "./stop.js";

// The page draws on a timer, not on every display frame: nothing on it needs more than the camera's 10 fps,
// and a chart moves one pixel per 0.47 s (60 s over its 128 px plot). Values and charts alternate between frames.
const TICK_MS = 100;         // camera frames, health and status changes
const TEXT_EVERY_MS = 500;   // values, captions
const CHART_EVERY_MS = 500;  // sparklines
const CHARTS_PER_STATE = 32;
const VALUES_PER_STATE = 40;
const LOG_LINES = 300;
const UNWATCH_AFTER_MS = 2000; // a state off screen this long is unsubscribed
// Not charted: timestamps (shown as clock times), ids and sequence numbers (plain values), raw words.
// Counters (integers that only ever go up: packets sent, instruction ids, step counters) are not charted
// either: an integer gets a chart once it has gone both up and down (a measurement such as a distance).
const NOT_CHARTED = /(^|\.)(ts|seq|session|cycle)$|(^|\.|_)(id|time|at)$|raw/i;
const TIME_FIELD = /(^|\.|_)(ts|time|at)$/;
// Unix seconds (2001..2096) in a time field, or with a fraction whatever its name, is a timestamp: shown as a
// clock time, never charted (a large integer such as a byte count stays a number)
const isTime = (path, v) => typeof v === "number" && v > 1e9 && v < 4e9 && (TIME_FIELD.test(path) || !Number.isInteger(v));

const $ = (sel, root = document) => root.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

// -- page-side counters (the benchmark reads window.__robobusPerf) ------------------------------------------
// frames: display frames counted by the fps probe (off unless asked: ?fps=1 or __robobusProbe(true));
// draws: the page's own drawing passes
const perf = { frames: 0, draws: 0, msgs: 0, msgMs: 0, renderMs: 0, bad: 0, since: performance.now() };
window.__robobusPerf = perf;
const shown = { frames: 0, msgs: 0, msgMs: 0, renderMs: 0, at: performance.now() };
let probing = false;
function probe() { perf.frames++; if (probing) requestAnimationFrame(probe); }
window.__robobusProbe = (on) => { const was = probing; probing = on; if (on && !was) requestAnimationFrame(probe); };

// -- the model ----------------------------------------------------------------------------------------------
let contract = null;
let bus = null;
// The page's own link to the broker: `gen` counts MQTT sessions (a status or health message is current only
// if it came in the present one), `lostAt` is when the last one ended (the "stale since" time), `down` whether
// that loss has been logged (once, and its end once).
const link = { connected: false, gen: 0, lostAt: 0, down: false, everConnected: false, lastError: "", username: "" };
let root = "robobus";
const nodes = new Map();
// The bus stop (shared/stop.py) as the page last read it: two latches, the site's {root}/_stop and the fleet
// centre's {root}/_stop/fleet (stop.js); each `state` a StopState (null: no stop message on the broker), `gen` the
// session it came in, `bad` why the message was unreadable (held as active, as every node holds it); `known` once
// the present session's retained messages are all in (Bus onSynced). `view()`: what the page shows (tests read it).
const stop = { latches: { [SITE]: newLatch(), [FLEET]: newLatch() }, known: false, changedAt: 0, dirty: true,
               view: () => stopView() };
// The site as the fleet's centre sees it (fleet-watch's {root}/_bridge/reachable): null where nobody says (a site's
// own broker), false while the centre cannot reach it: then what the page shows of the site is its last known,
// and every node and device is stale since `since` (when the page learnt it, or fleet-watch's retained verdict
// came: the page cannot know the cut's own time).
const site = { reachable: null, since: 0 };
let fleet = null; // the fleet view (fleet.js), at a centre whose server names the sites
window.__robobus = { nodes, link, stop, site, fleet: () => fleet, watched: () => (bus ? [...bus.watched] : []),
                     wsFrames: () => (bus && bus.client ? bus.client.frames : 0) };

// Text only written when it changed: writing the same string still replaces the text node, and the
// element's box is laid out and painted again.
function setText(e, text) {
  if (e.__text === text) return;
  e.__text = text;
  e.textContent = text;
}

function since(ms) {
  const s = Math.max(0, (Date.now() - ms) / 1000);
  if (s < 90) return `${s.toFixed(0)} s`;
  if (s < 5400) return `${(s / 60).toFixed(0)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function hms(ms) { return new Date(ms).toLocaleTimeString([], { hour12: false }); }

function clock(ms) {
  const d = new Date(ms);
  return `${d.toLocaleTimeString([], { hour12: false })}.${String(d.getMilliseconds()).padStart(3, "0")}`;
}

class NodeView {
  constructor(name) {
    this.name = name;
    this.status = null;
    this.statusAt = 0;
    this.statusGen = -1; // the MQTT session its status came in
    this.service = "";
    this.stats = null;
    this.devices = new Map();
    this.row = el("tr", { class: "node", "data-node": name, "data-status": "unknown" });
    this.stopAnswer = null; // its retained StopAnswer ({root}/{node}/_node/state/stop)
    this.cells = ["name", "service", "status", "devices", "stop", "counters"].map((k) => el("td", { class: k }));
    this.cells[0].textContent = name;
    this.row.append(...this.cells);
    insertSorted($("#nodes tbody"), this.row, name, "node");
    $("#no-nodes").hidden = true;
    this.dirty = true;
  }

  get online() { return this.status ? this.status.online : null; }

  // Since when what the page shows of this node is not known to be current: the page lost the broker (and has
  // not heard the node's status again since), else null.
  staleSince() {
    if (!this.status) return null;
    if (!link.connected || this.statusGen < link.gen) return link.lostAt || Date.now();
    if (site.reachable === false) return site.since;
    return null;
  }

  setStatus(st, retained) {
    const was = this.online;
    this.status = st;
    this.statusGen = link.gen;
    this.statusAt = retained && st.ts ? st.ts * 1000 : Date.now();
    if (st.service) this.setService(st.service);
    for (const d of st.devices || []) if (d !== "_node") this.device(d);
    if (was !== st.online) this.row.dataset.changedAt = String(Date.now()); // when the page learned it
    if (was !== null && was !== st.online) {
      logLine(this.name, "", st.online ? "online" : "offline", st.online ? "" : st.reason || "", !st.online);
    }
    this.dirty = true;
    for (const d of this.devices.values()) d.dirty = true;
  }

  setService(svc) {
    if (this.service === svc) return;
    this.service = svc;
    for (const d of this.devices.values()) d.attachService(svc);
    this.dirty = true;
  }

  device(name) {
    let d = this.devices.get(name);
    if (!d) {
      d = new DeviceView(this, name);
      this.devices.set(name, d);
      if (this.service) d.attachService(this.service);
      this.dirty = true;
    }
    return d;
  }

  render() {
    const st = this.status;
    const stale = this.staleSince();
    const state = !st ? "unknown" : stale ? "stale" : st.online ? "online" : "offline";
    this.row.dataset.status = state;
    setText(this.cells[1], this.service);
    // the once-a-second pass changes the "since" text only; badges and chips are rebuilt when they change
    const badgeKey = `${state} ${stale}`;
    if (this.badgeState !== badgeKey) {
      this.badgeState = badgeKey;
      const [cls, text] = { online: ["ok", "online"], offline: ["bad", "OFFLINE"], unknown: ["off", "?"],
                            stale: ["stale", `stale since ${hms(stale)}`] }[state];
      this.badge = el("span", { class: `badge ${cls}`, text });
      this.sinceSpan = el("span", { class: "since" });
      this.cells[2].replaceChildren(this.badge, this.sinceSpan);
    }
    const sinceText = !st ? "" : stale ? `last heard ${st.online ? "online" : "OFFLINE"}, ${staleWhy()}`
      : st.online ? `for ${since(this.statusAt)}` : `for ${since(this.statusAt)}${st.reason ? ` — ${st.reason}` : ""}`;
    setText(this.sinceSpan, sinceText);
    const chips = [...this.devices.values()].map((d) => [d.name, ...d.healthClass()]);
    const chipsKey = JSON.stringify(chips);
    if (this.chipsKey !== chipsKey) {
      this.chipsKey = chipsKey;
      this.cells[3].replaceChildren(...chips.map(([name, cls, text, color]) =>
        el("span", { class: "chip", "data-device": name, "data-health": cls },
           el("span", { class: `badge ${color}`, text }), ` ${name}`)));
    }
    const [answerKind, answerText] = this.stopText();
    this.cells[4].dataset.answer = answerKind;
    setText(this.cells[4], answerText);
    const s = this.stats;
    if (s) {
      const failed = Object.values(s.commands_failed || {}).reduce((a, b) => a + b, 0);
      setText(this.cells[5], `commands ok ${s.commands_ok}, failed ${failed} · decode errors ${s.decode_errors}` +
        ` · jobs ${s.jobs_running} · reconnects ${s.reconnects}`);
    }
    this.dirty = false;
  }

  // Its answer to the bus stop as the page last read it: does it answer the present stop (or release), and
  // what each of its motion devices did: [kind, text] (kind: current, pending, failed, missing, old, none).
  stopText() {
    const a = this.stopAnswer;
    if (!stopCurrent(a)) {
      if (activeChannels(stop.latches).length && this.online) return ["missing", "no answer to this stop yet"];
      return a ? ["old", `answered an earlier ${a.active ? "stop" : "release"}`] : ["none", ""];
    }
    const of = a.channel === FLEET ? "the fleet's " : "";
    if (!a.active && a.devices.some((d) => d.stopped)) {
      // a release of one latch while the other holds: the devices stay stopped (the answer's reason says by what)
      return ["current", `${of}release read at ${clock(a.received_ts * 1000)}; still stopped${a.reason ? `: ${a.reason.trim()}` : ""}`];
    }
    if (!a.active) return ["current", `released ${a.devices.length ? a.devices.map((d) => d.device).join(", ") : "(no motion device)"} at ${clock(a.received_ts * 1000)}`];
    if (!a.devices.length) return ["current", `answered at ${clock(a.received_ts * 1000)}: no motion device`];
    const failed = a.devices.some((d) => d.error), pending = a.devices.some((d) => d.pending);
    return [failed ? "failed" : pending ? "pending" : "current", `stopped by ${of || "the site's "}stop (read at ${clock(a.received_ts * 1000)}): ` +
      a.devices.map((d) => `${d.device} ${d.error ? `FAILED: ${d.error}` : d.pending ? "pending"
        : `at ${clock(d.written_ts * 1000)} (+${Math.max(0, Math.round((d.written_ts - a.stop_ts) * 1000))} ms)`}`).join(", ")];
  }
}

// An answer to the present state of the latch it names (the same ts, source and active), not to an earlier one
// (retained). An unreadable stop message is held as the kit holds it (shared/stop.py): active, source "unknown", ts 0.
function stopCurrent(a) { return answerCurrent(stop.latches, a); }

function insertSorted(parent, node, key, attr) {
  for (const c of parent.children) {
    if (c.dataset[attr] > key) { parent.insertBefore(node, c); return; }
  }
  parent.append(node);
}

class DeviceView {
  constructor(nodeView, name) {
    this.nodeView = nodeView;
    this.name = name;
    this.health = null;
    this.healthGen = -1; // the MQTT session its health came in
    this.states = new Map();
    this.jobs = new Map();
    this.service = "";
    this.dirty = true;
    const key = `${nodeView.name}/${name}`;
    this.badge = el("span", { class: "badge off", text: "?" });
    this.healthLine = el("p", { class: "health-line" });
    // the health's message, coloured as the badge is: red only beside a red badge
    this.errorLine = el("p", { class: "error-message", role: "alert", "data-level": "info" });
    // a motion device's bus stop: its node's answer for it (shown only on motion devices)
    this.stopLine = el("p", { class: "stop-line", "data-stop": "none", hidden: "" });
    this.detailsPre = el("pre", { class: "json" });
    this.statesBox = el("div", { class: "states" });
    this.jobsBox = el("div", { class: "jobs" });
    this.commandsBox = el("details", { class: "commands" }, el("summary", { text: "commands" }));
    this.card = el("article", { class: "device", "data-node": nodeView.name, "data-device": name, "data-key": key,
                                "data-health": "unknown" },
      el("header", {}, el("h3", { text: name }), el("span", { class: "where", text: nodeView.name }), this.badge),
      this.stopLine, this.healthLine, this.errorLine,
      el("details", { class: "health-details" }, el("summary", { text: "health details" }), this.detailsPre),
      this.statesBox, this.jobsBox, this.commandsBox);
    insertSorted($("#devices"), this.card, key, "key");
    this.key = key;
    this.visible = false; // until the observer says it is on screen
    this.unwatchTimers = new Map();
    this.perState = false; // true once the document's states have their sections
    cardViews.set(this.card, this);
    observer.observe(this.card);
  }

  // What the page receives of a device's states follows what is on screen. For a service in the document
  // every state has its section from the start, and each section subscribes its own topic while it is on
  // screen and open (StateView.show); a device of a service the document does not know subscribes
  // `state/#` while its card is on screen. Dropped a moment after leaving the view, so that scrolling past
  // does not churn subscriptions; retained values arrive at once when it comes back. Charts show the gap.
  setVisible(on) {
    this.visible = on;
    this.dirty = true;
    if (!this.perState) later(this, `${root}/${this.key}/state/#`, on);
  }

  // Since when this device's health is not known to be current: its node went offline (the health is the dead
  // process's last word), or the page lost the broker and has not heard the health again since; else null.
  staleSince() {
    const n = this.nodeView;
    if (n.online === false) return n.staleSince() || n.statusAt;
    if (!this.health) return n.staleSince();
    if (!link.connected || this.healthGen < link.gen) return link.lostAt || Date.now();
    return n.staleSince();
  }

  // [data-health, badge text, badge colour]: green only while the health is current, connected, operational
  // and without error
  healthClass() {
    const stale = this.staleSince();
    if (stale) return ["stale", `stale since ${hms(stale)}`, "stale"];
    const h = this.health;
    if (!h) return ["unknown", "NO HEALTH", "off"];
    // held by the bus stop (the kit's overlay: docs/kit.md "Stopping everything"); not an error of the device
    // its stop action failed: not known to be stopped (the stop line says why)
    if (h.state === "stopped" && h.details && h.details.stop) {
      return h.details.stop.error ? ["error", "STOP FAILED", "bad"] : ["stopped", "STOPPED", "stopped"];
    }
    if (h.error) return ["error", "ERROR", "bad"];
    if (!h.connection) return ["error", "NOT CONNECTED", "bad"];
    if (!h.operational) return ["warn", "NOT OPERATIONAL", "warn"];
    return ["ok", "OK", "ok"];
  }

  setHealth(h) {
    this.health = h;
    this.healthGen = link.gen;
    if (h.service) this.nodeView.setService(h.service);
    this.dirty = true;
    this.nodeView.dirty = true;
  }

  // A motion device: one its node's answer to the stop lists, or (before the node has answered any stop) one of a
  // service whose document has motion commands, or one whose health carries the stop.
  get motion() {
    const a = this.nodeView.stopAnswer;
    if (a) return a.devices.some((d) => d.device === this.name);
    if (this.health && this.health.details && this.health.details.stop) return true;
    const api = contract && contract.services.get(this.service || this.nodeView.service);
    return !!(api && api.motion);
  }

  // [data-stop, text] of the card's stop line: none, released, unknown, unanswered, pending, failed, stopped.
  stopText() {
    const [ch, l] = effective(stop.latches);
    const s = l && l.state;
    if (!stop.known && !s) return ["unknown", "bus stop: not read yet"];
    if (!s) return ["none", "bus stop: none"];
    if (!s.active) return ["released", `${ch === FLEET ? "fleet " : ""}bus stop released ${hms(s.ts * 1000)} by ${s.source}`];
    const head = deviceHead(stop.latches, { hms, since });
    const a = this.nodeView.stopAnswer;
    const d = stopCurrent(a) ? a.devices.find((x) => x.device === this.name && x.stopped) : null;
    if (!d) return ["unanswered", `${head} · no answer from ${this.nodeView.name} for this device yet`];
    if (d.error) return ["failed", `${head} · the stop action FAILED: ${d.error}`];
    if (d.pending) return ["pending", `${head} · held stopped; the service has not yet reported the stop written`];
    // (an answer to a release of the other latch keeps the holding stop's write: no delay from the release)
    return ["stopped", `${head} · stopped: the stop reached the device at ${clock(d.written_ts * 1000)}` +
      (a.active ? ` (+${Math.max(0, Math.round((d.written_ts - a.stop_ts) * 1000))} ms)` : "")];
  }

  attachService(svc) {
    if (this.service === svc || !contract) return;
    this.service = svc;
    const api = contract.services.get(svc);
    if (!api) { this.commandsBox.append(el("p", { class: "hint", text: `service ${svc} is not in this AsyncAPI document` })); return; }
    // every state of the document gets its section now, so that each one is observed and subscribed alone
    this.perState = true;
    later(this, `${root}/${this.key}/state/#`, false, 0);
    for (const name of [...api.states.keys()].sort()) this.state(name);
    $("summary", this.commandsBox).textContent = `commands (${api.commands.size})`;
    for (const [name, entry] of [...api.commands.entries()].sort()) {
      const cmd = el("details", { class: "command", "data-command": name },
        el("summary", {}, el("b", { text: name }), splitDoc(entry.doc).text));
      cmd.append(buildCommandForm(contract, entry,
        (body) => bus.call(this.nodeView.name, this.name, name, body),
        (body, rep) => {
          if (entry.job && rep.ok && rep.result && rep.result.job_id) this.job(rep.result.job_id, name);
        }));
      this.commandsBox.append(cmd);
    }
  }

  state(name) {
    let s = this.states.get(name);
    if (!s) {
      const api = contract && contract.services.get(this.service);
      s = new StateView(this, name, api ? api.states.get(name) : null);
      this.states.set(name, s);
    }
    return s;
  }

  job(id, command) {
    let j = this.jobs.get(id);
    if (!j) { j = new JobView(this, id, command); this.jobs.set(id, j); }
    return j;
  }

  render() {
    const [cls, text, color] = this.healthClass();
    this.card.dataset.health = cls;
    const motion = this.motion;
    this.stopLine.hidden = !motion;
    this.card.dataset.motion = String(motion);
    if (motion) {
      const [kind, stopText] = this.stopText();
      this.stopLine.dataset.stop = kind;
      setText(this.stopLine, stopText);
    }
    this.badge.className = `badge ${color}`;
    setText(this.badge, text);
    const h = this.health;
    let message = "", level = "info";
    if (h) {
      const yn = (v) => (v ? "yes" : "NO");
      setText(this.healthLine, `connection ${yn(h.connection)} · operational ${yn(h.operational)} · state ${h.state}` +
        ` · ${h.service} ${h.version} · ${clock(h.ts * 1000)}`);
      message = h.error || h.error_message ? h.error_message || "error" : "";
      level = cls === "error" ? "error" : cls === "warn" ? "warn" : "info";
      setText(this.detailsPre, JSON.stringify(h.details || {}, null, 1));
    }
    if (cls === "stale") {
      const st = this.nodeView.status;
      level = "stale";
      message = this.nodeView.online === false && !this.nodeView.staleSince()
        ? `node offline${st && st.reason ? `: ${st.reason}` : ""}; the health below is its last word`
        : `${staleWhy()}: the health and states below are the last received`;
    }
    this.errorLine.dataset.level = level;
    setText(this.errorLine, message);
    this.dirty = false;
  }
}

// A table: lists of plain values of one length side by side in one object (or one list of 8 or more), at least
// one of them not all numbers (pin modes beside their names, pin values with nulls for reserved pins): one row per
// index instead of a line per item. Lists of numbers only (sensor arrays) stay charts and values.
class Table { constructor(cols) { this.cols = cols; } }
const isPlain = (x) => x === null || typeof x !== "object";

function tables(v, path, out) {
  const byLen = new Map();
  for (const [k, x] of Object.entries(v)) {
    if (Array.isArray(x) && x.length > 1 && x.length <= 256 && x.every(isPlain)) {
      if (!byLen.has(x.length)) byLen.set(x.length, []);
      byLen.get(x.length).push(k);
    }
  }
  const taken = new Set();
  for (const keys of byLen.values()) {
    if ((keys.length < 2 && v[keys[0]].length < 8) || keys.every((k) => v[k].every((x) => typeof x === "number"))) {
      continue;
    }
    const cols = {};
    for (const k of keys) { cols[k] = v[k]; taken.add(k); }
    out.push([`${path ? `${path}.` : ""}[${keys.join(",")}]`, new Table(cols)]);
  }
  return taken;
}

// flatten a state message into [path, value] leaves; arrays of named objects are keyed by name
function flatten(v, path, out) {
  if (v === null || typeof v !== "object") { out.push([path, v]); return; }
  if (Array.isArray(v)) {
    if (v.length > 64) { out.push([path, `[${v.length} items]`]); return; }
    v.forEach((x, i) => {
      const seg = x && typeof x === "object" && typeof x.name === "string" ? x.name : String(i);
      flatten(x, path ? `${path}.${seg}` : seg, out);
    });
    return;
  }
  const taken = tables(v, path, out);
  for (const [k, x] of Object.entries(v)) {
    if (k === "name" && typeof x === "string" && path) continue; // already the path segment
    if (taken.has(k)) continue;
    flatten(x, path ? `${path}.${k}` : k, out);
  }
}

class StateView {
  constructor(dev, name, entry) {
    this.dev = dev;
    this.name = name;
    this.entry = entry;
    this.binary = !!entry && !entry.contentType.startsWith("application/json");
    this.series = new Map();
    this.charts = new Map();
    this.values = new Map();
    this.firstSeen = new Map(); // integer path -> [first value, rose, fell] until it charts
    this.tables = new Map();
    this.chartDraws = 0; // drawing passes of its charts (tests read it: charts stop while the device is stale)
    this.received = false;
    this.hiddenValues = 0;
    this.latest = null;
    this.textDirty = false;
    this.count = 0;
    const title = el("summary", {}, el("h4", { text: name }, entry ? el("small", { text: ` ${entry.doc}` }) : null));
    // <details>: a person folds what they do not watch, and folded states are not drawn
    // Shown once a message of it arrived: a module kind that never publishes a state of its service (an ODrive's
    // power on a GPIO module) shows no empty section. Until then the section is in the layout with no height, so
    // that it is still observed, and subscribed while on screen.
    this.section = el("details", { class: "state", "data-state": name, "data-received": "false", open: "" }, title);
    if (this.binary) {
      // a canvas fed by createImageBitmap: the JPEG decodes off the main thread, and no blob: URL goes
      // through the page's resource loader ten times a second per robot
      this.img = el("canvas", { class: "image", role: "img", "aria-label": `${dev.name} ${name}`, "data-frames": "0",
                                width: "160", height: "120" }); // drawn 1:1, scaled by the compositor
      this.section.append(el("div", { class: "camera" }, this.img));
      this.pendingImage = null; // the newest JPEG received
      this.ready = null;        // the newest decoded frame, drawn on the next tick
      this.decoding = false;
      this.frames = 0;
    } else {
      this.chartsBox = el("div", { class: "charts" });
      // every chart of the state is drawn on this one canvas over the box, at its plot's place: one layer for
      // the compositor instead of one per chart (a canvas is a layer of its own)
      this.plotCanvas = el("canvas", { class: "plots", width: "0", height: "0", "aria-hidden": "true" });
      this.chartsBox.append(this.plotCanvas);
      this.plotsPlaced = false;
      new ResizeObserver(() => { this.plotsPlaced = false; }).observe(this.chartsBox);
      this.valuesBox = el("dl", { class: "values" });
      this.valuesTitle = el("summary", { text: "values" });
      // open while the state has no charts; beside charts, the other fields fold away
      this.valuesFold = el("details", { class: "values", open: "" }, this.valuesTitle, this.valuesBox);
      this.more = el("div", { class: "more" });
      this.tablesBox = el("div", { class: "tables" });
      this.raw = el("pre", { class: "json" });
      this.rawBox = el("details", { class: "raw" }, el("summary", { text: "message" }), this.raw);
      this.section.append(this.chartsBox, this.tablesBox, this.valuesFold, this.more, this.rawBox);
    }
    // binary (camera) first, then states by name
    const after = [...dev.statesBox.children].find((c) => !c.querySelector(".image") && (this.binary || c.dataset.state > name));
    dev.statesBox.insertBefore(this.section, after || null);
    this.onScreen = false;
    this.filter = `${root}/${dev.key}/state/${name}`;
    if (entry) { // a state of the document: subscribed while on screen and open
      sectionViews.set(this.section, this);
      sectionObserver.observe(this.section);
      this.section.addEventListener("toggle", () => this.show(this.onScreen));
    }
  }

  show(onScreen) {
    this.onScreen = onScreen;
    later(this.dev, this.filter, onScreen && this.section.open);
  }

  markReceived() {
    this.received = true;
    this.section.dataset.received = "true";
  }

  onJson(data, nowMs) {
    this.latest = data;
    this.count++;
    const leaves = [];
    flatten(data, "", leaves);
    for (const [path, v] of leaves) {
      if (v instanceof Table) { this.table(path, v); continue; }
      const numeric = typeof v === "number" && Number.isFinite(v);
      let s = this.series.get(path);
      if (!s && numeric && !NOT_CHARTED.test(path) && !isTime(path, v) && this.charts.size < CHARTS_PER_STATE) {
        // Measurements (floats) chart at once; an integer charts once it has gone both up and down, so ids,
        // ports, sizes and counters stay plain values while a measured distance or level gets its chart.
        const seen = this.firstSeen.get(path);
        if (!Number.isInteger(v) || (seen && ((seen.rose && v < seen.last) || (seen.fell && v > seen.last)))) {
          s = new Series();
          this.series.set(path, s);
          this.addChart(path);
          this.firstSeen.delete(path);
        } else if (!seen) this.firstSeen.set(path, { last: v, rose: false, fell: false });
        else {
          if (v > seen.last) seen.rose = true;
          if (v < seen.last) seen.fell = true;
          seen.last = v;
        }
      }
      if (s) { if (numeric) s.push(nowMs, v); continue; }
      if (!this.values.has(path)) this.addValue(path);
      const dd = this.values.get(path);
      if (dd) dd.pending = v;
    }
    this.textDirty = true;
  }

  addChart(path) {
    const plot = el("div", { class: "plot" });
    const value = el("b");
    const label = path.startsWith(`${this.name}.`) ? path.slice(this.name.length + 1) : path;
    const fig = el("figure", { class: "spark", "data-path": path, "data-samples": "0" },
      el("figcaption", {}, el("span", { text: label, title: path }), value), plot);
    this.plotsPlaced = false;
    if (this.charts.size === 0) this.valuesFold.open = false;
    this.chartsBox.append(fig);
    const dd = this.values.get(path);
    if (dd) { dd.previousElementSibling.remove(); dd.remove(); this.values.delete(path); }
    this.charts.set(path, { fig, plot, value, x: 0, y: 0, w: 0, h: 0 });
  }

  // lists side by side as one table: a row per index, a column per list (cells written when they change)
  table(path, t) {
    let tv = this.tables.get(path);
    const names = Object.keys(t.cols);
    const rows = t.cols[names[0]].length;
    if (!tv || tv.rows.length !== rows) {
      const head = el("tr", {}, el("th", { text: "#" }), ...names.map((n) => el("th", { text: n })));
      const body = [];
      for (let i = 0; i < rows; i++) {
        body.push(el("tr", {}, el("th", { text: String(i) }), ...names.map(() => el("td"))));
      }
      const table = el("table", { class: "list-table", "data-path": path }, el("thead", {}, head), el("tbody", {}, ...body));
      if (tv) tv.table.replaceWith(table); else this.tablesBox.append(table);
      tv = { table, rows: body, pending: null };
      this.tables.set(path, tv);
    }
    tv.pending = t.cols;
  }

  addValue(path) {
    if (this.values.size >= VALUES_PER_STATE) { this.values.set(path, null); this.hiddenValues++; return; }
    const dd = el("dd", { "data-path": path });
    this.valuesBox.append(el("dt", { text: path }), dd);
    this.values.set(path, dd);
  }

  onImage(bytes, ctype) {
    if (!this.received) this.markReceived();
    this.pendingImage = new Blob([bytes], { type: ctype || this.entry.contentType });
    this.count++;
  }

  renderText() {
    if (!this.textDirty) return;
    for (const [path, c] of this.charts) setText(c.value, formatValue(this.series.get(path).last));
    for (const dd of this.values.values()) {
      if (dd && dd.pending !== undefined) {
        const v = dd.pending;
        setText(dd, isTime(dd.dataset.path, v) ? clock(v * 1000) : formatValue(v));
        dd.pending = undefined;
      }
    }
    for (const tv of this.tables.values()) {
      if (!tv.pending) continue;
      const cols = Object.values(tv.pending);
      tv.rows.forEach((tr, i) => cols.forEach((col, j) => setText(tr.cells[j + 1], formatValue(col[i]))));
      tv.pending = null;
    }
    setText(this.more, this.hiddenValues ? `+${this.hiddenValues} more fields (see message)` : "");
    setText(this.valuesTitle, this.charts.size ? `other fields (${this.values.size})` : "values");
    if (this.rawBox.open) this.raw.textContent = JSON.stringify(this.latest, null, 1);
    this.textDirty = false;
  }

  // where each chart's plot is in the box (read from layout only when the box or its charts changed)
  placePlots() {
    const box = this.chartsBox.getBoundingClientRect();
    const w = Math.round(box.width), h = Math.round(box.height);
    if (this.plotCanvas.width !== w || this.plotCanvas.height !== h) {
      this.plotCanvas.width = w;
      this.plotCanvas.height = h;
    }
    for (const c of this.charts.values()) {
      const r = c.plot.getBoundingClientRect();
      // inside the plot's 1 px border
      c.x = Math.round(r.left - box.left) + 1;
      c.y = Math.round(r.top - box.top) + 1;
      c.w = Math.round(r.width) - 2;
      c.h = Math.round(r.height) - 2;
    }
    this.plotsPlaced = true;
  }

  renderCharts(nowMs) {
    this.chartDraws++;
    if (!this.plotsPlaced) this.placePlots();
    const ctx = this.plotCanvas.getContext("2d");
    ctx.clearRect(0, 0, this.plotCanvas.width, this.plotCanvas.height);
    ctx.strokeStyle = "#2458b8";
    ctx.lineWidth = 1;
    for (const [path, c] of this.charts) {
      const s = this.series.get(path);
      if (c.w > 0 && c.h > 0) drawSparkline(ctx, c.x, c.y, c.w, c.h, s, nowMs);
      c.fig.dataset.samples = String(s.count);
    }
  }

  // Called in the page's drawing frame. A decoded frame is drawn here, in the same animation frame as every
  // other change of the tick, so that two cameras and the values cost one compositor frame per tick, not one
  // per decode; the newest JPEG is then handed to createImageBitmap (off the main thread) for the next tick.
  renderImage() {
    if (this.ready) {
      const bmp = this.ready;
      this.ready = null;
      if (this.img.width !== bmp.width || this.img.height !== bmp.height) {
        this.img.width = bmp.width;
        this.img.height = bmp.height;
      }
      this.img.getContext("2d").drawImage(bmp, 0, 0);
      this.img.dataset.width = String(bmp.width);
      this.img.dataset.height = String(bmp.height);
      bmp.close();
      this.frames++;
      this.img.dataset.frames = String(this.frames);
    }
    if (!this.pendingImage || this.decoding) return;
    const blob = this.pendingImage;
    this.pendingImage = null;
    this.decoding = true;
    createImageBitmap(blob).then((bmp) => {
      if (this.ready) this.ready.close(); // not drawn yet: the newer one wins
      this.ready = bmp;
      imagesPending = true; // drawn on the next tick
    }).catch((e) => {
      perf.bad++;
      this.img.dataset.error = `not an image: ${e.message}`;
    }).finally(() => { this.decoding = false; });
  }
}

class JobView {
  constructor(dev, id, command) {
    this.dev = dev;
    this.id = id;
    this.bar = el("progress", { max: "1", value: "0" });
    this.label = el("span", { class: "label", text: `${command} ${id}` });
    this.result = el("div", { class: "result" });
    this.cancel = el("button", { type: "button", text: "cancel" });
    this.cancel.addEventListener("click", async () => {
      this.cancel.disabled = true;
      const rep = await bus.call(dev.nodeView.name, dev.name, "cancel", { job_id: id });
      if (!rep.ok) { this.result.textContent = `cancel: ${rep.error.code}: ${rep.error.message}`; this.cancel.disabled = false; }
    });
    this.box = el("div", { class: "job", "data-job-id": id, "data-state": "running" },
                  this.label, this.bar, this.cancel, this.result);
    dev.jobsBox.prepend(this.box);
    while (dev.jobsBox.children.length > 8) dev.jobsBox.lastElementChild.remove();
  }

  progress(ev) {
    if (this.box.dataset.state !== "running") return;
    const total = ev.total || 0;
    if (total > 0) { this.bar.max = total; this.bar.value = Math.min(ev.done, total); }
    else this.bar.removeAttribute("value");
    const pct = total > 0 ? ` ${((100 * ev.done) / total).toFixed(0)} %` : "";
    this.label.textContent = `${ev.command} · ${ev.phase}${pct}`;
    this.box.dataset.phase = ev.phase;
  }

  finish(ev) {
    const st = ev.cancelled ? "cancelled" : ev.ok ? "ok" : "failed";
    this.box.dataset.state = st;
    this.cancel.remove();
    if (ev.ok) { this.bar.max = 1; this.bar.value = 1; }
    const what = ev.ok ? `done in ${ev.duration_s.toFixed(1)} s` : ev.cancelled ? "cancelled"
      : `failed: ${ev.error ? `${ev.error.code}: ${ev.error.message}` : "no reason given"}`;
    this.label.textContent = `${ev.command} · ${st}`;
    this.result.textContent = `${what}${ev.result ? ` — ${JSON.stringify(ev.result).slice(0, 300)}` : ""}`;
  }
}

// -- event log ---------------------------------------------------------------------------------------------
function logLine(node, device, name, text, alarm = false) {
  const li = el("li", { class: alarm ? "fault" : "", "data-event": name },
    el("time", { text: clock(Date.now()) }), el("b", { text: device ? `${node}/${device}` : node }), ` ${name} `, text);
  const log = $("#event-log");
  log.prepend(li);
  while (log.children.length > LOG_LINES) log.lastElementChild.remove();
}

// -- message routing ---------------------------------------------------------------------------------------
function node(name) {
  let n = nodes.get(name);
  if (!n) { n = new NodeView(name); nodes.set(name, n); }
  return n;
}

function onMessage(topic, payload, ctype, retained) {
  const t0 = performance.now();
  perf.msgs++;
  try {
    if (fleet && fleet.route(topic, payload.length ? decodeText(payload) : "") && !topic.startsWith(`${root}/`)) {
      perf.msgMs += performance.now() - t0;
      return; // another site's: the fleet view's alone
    }
    route(topic, payload, ctype, retained, t0);
  } catch (e) {
    perf.bad++;
    if (perf.bad <= 20 || perf.bad % 1000 === 0) logLine(topic, "", "bad message", `${e.message} (${perf.bad} so far)`, true);
  }
  perf.msgMs += performance.now() - t0;
}

function json(payload) { return JSON.parse(decodeText(payload)); }

function route(topic, payload, ctype, retained, nowMs) {
  if (!topic.startsWith(`${root}/`)) return;
  if (topic === bus.stopTopic) { onStop(SITE, payload); return; }
  if (bus.fleetTopic && topic === bus.fleetTopic) { onStop(FLEET, payload); return; }
  if (topic === bus.reachableTopic) { onReachable(payload); return; }
  const parts = topic.slice(root.length + 1).split("/");
  if (parts[2] !== "state") dirtyNodes = true; // status, health, events: draw on the next tick
  if (parts.length === 2 && parts[1] === "status") { node(parts[0]).setStatus(json(payload), retained); return; }
  if (parts.length === 3 && parts[2] === "health") {
    if (payload.length === 0) return; // a cleared retained message
    node(parts[0]).device(parts[1]).setHealth(json(payload));
    return;
  }
  if (parts.length !== 4) return;
  const [n, d, kind, name] = parts;
  if (d === "_node") {
    if (kind === "state" && name === "stats") { const nv = node(n); nv.stats = json(payload); nv.dirty = true; }
    if (kind === "state" && contract.stop && name === contract.stop.answer) onStopAnswer(node(n), payload);
    return;
  }
  const dev = node(n).device(d);
  if (kind === "state") {
    if (payload.length === 0) return;
    const sv = dev.state(name);
    if (sv.binary) { sv.onImage(payload, ctype); imagesPending = true; }
    else { // parsed on the next tick: the newest wins
      if (!sv.received) sv.markReceived();
      sv.pending = payload;
      pendingStates.add(sv);
    }
  } else if (kind === "event") {
    const ev = json(payload);
    if (name === "job_progress") { dev.job(ev.job_id, ev.command).progress(ev); return; }
    if (name === "job_result") {
      dev.job(ev.job_id, ev.command).finish(ev);
      logLine(n, d, "job_result", `${ev.command} ${ev.ok ? "ok" : ev.cancelled ? "cancelled" : "failed"}` +
        (ev.error ? `: ${ev.error.message}` : ""), !ev.ok);
      return;
    }
    const alarm = /fault|stop|error/i.test(name) || ev.ok === false;
    logLine(n, d, name, JSON.stringify(ev).slice(0, 240), alarm);
  }
}

// -- the bus stop --------------------------------------------------------------------------------------------
// {root}/_stop and {root}/_stop/fleet (shared/stop.py; docs/kit.md "Stopping everything"; stop.js). A message that
// is not a StopState is held as an active stop, as every node holds it; an empty retained message is no stop (a
// release). The page's STOP and release write the site's latch only.
const STOP_CONFIRM_MS = 5000; // after the broker's PUBACK: the page's own message must come back on the topic
let stopSend = null; // {state, what, timer}: the page's stop or release waiting to be seen on the topic

function onStop(channel, payload) {
  const { state, bad } = readStop(payload.length ? decodeText(payload) : "", (s) => contract.validate(contract.stop.schema, s));
  if (bad) perf.bad++;
  const latch = stop.latches[channel];
  const was = latch.state, wasBad = latch.bad;
  Object.assign(latch, { state, bad, gen: link.gen });
  stop.dirty = true;
  // a message on each latch in this session: the stop is known (as a node knows it), before the page's round trip
  if (CHANNELS.every((ch) => stop.latches[ch].gen === link.gen || (ch === FLEET && !bus.fleetTopic))) stop.known = true;
  if (JSON.stringify(was) !== JSON.stringify(state) || wasBad !== bad) {
    stop.changedAt = Date.now();
    const what = channel === FLEET ? `fleet bus stop (${bus.fleetTopic})` : "bus stop";
    if (bad) logLine(what, "", "unreadable", `${bad}: every node holds it as an active stop`, true);
    else if (!state) logLine(what, "", "removed", "no stop message on the broker (counts as released)");
    else logLine(what, "", state.active ? "ACTIVE" : "released",
                 `by ${state.source}${state.reason ? `: ${state.reason}` : ""} at ${clock(state.ts * 1000)}`, state.active);
  }
  if (channel !== SITE) { markAllDirty(); return; } // the page's own stop or release is the site's
  if (stopSend && state && !bad && state.ts === stopSend.state.ts && state.source === stopSend.state.source &&
      state.active === stopSend.state.active) {
    clearTimeout(stopSend.timer);
    stopOutcome("confirmed", `${stopSend.what} sent at ${clock(state.ts * 1000)}: the broker holds it on ${bus.stopTopic}`);
    stopSend = null;
  }
  markAllDirty();
}

function onStopAnswer(nv, payload) {
  let a = null;
  if (payload.length) {
    a = json(payload);
    const errs = contract.stop.answerSchema ? contract.validate(contract.stop.answerSchema, a) : [];
    if (errs.length) throw new Error(`not a StopAnswer: ${errs.map((e) => `${e.path} ${e.message}`).join("; ")}`);
  }
  nv.stopAnswer = a;
  nv.dirty = true;
  for (const d of nv.devices.values()) d.dirty = true;
  stop.dirty = true;
  dirtyNodes = true;
}

// Why what the page shows is not current (the page's own link first: then it knows nothing new of anything).
function staleWhy() { return link.connected && site.reachable === false ? "site unreachable from the centre" : "broker connection lost"; }

// fleet-watch's verdict on the site: "0" unreachable, "1" reachable, empty: withdrawn (nobody says).
function onReachable(payload) {
  const v = decodeText(payload).trim();
  if (v !== "0" && v !== "1" && v !== "") throw new Error(`${bus.reachableTopic} says ${JSON.stringify(v.slice(0, 40))}, not 0 or 1`);
  const reachable = v === "" ? null : v === "1";
  if (reachable === site.reachable) return;
  if (reachable === false) {
    site.since = Date.now();
    logLine("site", "", "unreachable", `the centre does not hear ${root}: what is shown is its last known`, true);
  } else if (site.reachable === false) logLine("site", "", "reachable", `after ${since(site.since)}`);
  site.reachable = reachable;
  const b = $("#site");
  b.hidden = reachable === null;
  b.dataset.state = reachable === null ? "unknown" : reachable ? "reachable" : "unreachable";
  b.className = `badge ${reachable ? "ok" : "bad"}`;
  b.textContent = reachable ? "site reachable" : `SITE UNREACHABLE since ${hms(site.since)}: last known values`;
  markAllDirty();
}

function markAllDirty() {
  for (const n of nodes.values()) { n.dirty = true; for (const d of n.devices.values()) d.dirty = true; }
  stop.dirty = true;
  dirtyNodes = true;
}

// What became of the page's own stop or release: sending, refused (the broker's PUBACK reason code), failed (not
// sent), unconfirmed (acknowledged, but the topic did not change), confirmed (the broker holds it).
function stopOutcome(outcome, text) {
  const r = $("#stop-result");
  r.dataset.outcome = outcome;
  r.textContent = text;
  if (outcome !== "sending") logLine("bus stop", "", `this page's ${outcome}`, text, outcome !== "confirmed");
}

async function sendStop(active) {
  const what = active ? "stop" : "release";
  const source = `${link.username || "anonymous"} via dashboard ${location.host}`.slice(0, 200);
  // a reason too long for the schema is cut, never a reason not to stop (the input's maxlength is the schema's)
  const input = $("#stop-reason");
  const reason = input.value.trim();
  const state = { active, source, reason: input.maxLength > 0 ? reason.slice(0, input.maxLength) : reason,
                  ts: Date.now() / 1000 };
  const errs = contract.validate(contract.stop.schema, state);
  if (errs.length) { stopOutcome("failed", `${what} not sent: ${errs.map((e) => `${e.path} ${e.message}`).join("; ")}`); return; }
  if (stopSend) clearTimeout(stopSend.timer);
  stopSend = null;
  stopOutcome("sending", `${what} sent, waiting for the broker…`);
  const ack = await bus.publishStop(state);
  if (ack.code === null) { stopOutcome("failed", `${what} not delivered: ${ack.text}`); return; }
  if (ack.code >= 0x80) {
    stopOutcome("refused", `${what} REFUSED by the broker: ${ack.text} (PUBACK reason code ${ack.code}). This MQTT ` +
      `user (${link.username || "anonymous"}) may not write ${bus.stopTopic}: only the operator role may set or ` +
      `release the bus stop. The stop is unchanged.`);
    return;
  }
  const site = stop.latches[SITE];
  if (!site.bad && site.state && state.ts === site.state.ts && state.source === site.state.source) {
    // back on the topic before its PUBACK (the broker delivers to its subscribers first)
    stopOutcome("confirmed", `${what} sent at ${clock(state.ts * 1000)}: the broker holds it on ${bus.stopTopic}`);
    return;
  }
  const pending = { state, what, timer: 0 };
  pending.timer = setTimeout(() => {
    if (stopSend !== pending) return;
    stopSend = null;
    stopOutcome("unconfirmed", `the broker acknowledged the ${what} but ${bus.stopTopic} did not change within ` +
      `${STOP_CONFIRM_MS / 1000} s: the broker did not take it (this user may not be allowed to write it). The ` +
      "stop is as shown.");
  }, STOP_CONFIRM_MS);
  stopSend = pending;
  stopOutcome("sending", `${what} acknowledged by the broker, waiting to see it on ${bus.stopTopic}…`);
}

// What the header shows of the stop: both latches (stop.js's banner), whether the page's release is offered (the
// site's latch is active: the fleet's is released only at the fleet's centre), and the online nodes' answers.
function stopView() {
  const b = banner(stop.latches, { known: stop.known, connected: link.connected,
                                   fleetTopic: bus ? bus.fleetTopic : "" }, { hms, since });
  const latches = Object.fromEntries(CHANNELS.map((ch) => [ch, { ...stop.latches[ch] }]));
  return { ...b, active: activeChannels(stop.latches), latches };
}

// The header's stop line: the stop's state (since when, by whom, why; which latch), the answers of the online
// nodes, and the release button while the site's stop is active.
function renderStop() {
  stop.dirty = false;
  const b = $("#stop-state");
  const v = stopView();
  let text = v.text;
  const stale = !link.connected || (!stop.known && CHANNELS.some((ch) => stop.latches[ch].state && stop.latches[ch].gen < link.gen));
  if (stale && v.kind !== "unknown") text += ` · stale since ${hms(link.lostAt || Date.now())}`;
  b.dataset.state = v.kind;
  b.dataset.channel = v.channel;
  b.dataset.stale = String(stale);
  b.className = `badge ${stale ? "stale" : { active: "stopped", none: "ok", released: "ok", unknown: "off" }[v.kind]}`;
  setText(b, text);
  $("#release-button").hidden = !v.release;
  const note = $("#stop-note");
  note.hidden = !v.note;
  setText(note, v.note);
  const answers = $("#stop-answers");
  if (v.active.length) {
    const online = [...nodes.values()].filter((n) => n.online);
    const answered = online.filter((n) => stopCurrent(n.stopAnswer));
    const settled = answered.filter((n) => n.stopAnswer.devices.every((d) => !d.pending && !d.error));
    answers.dataset.answered = String(answered.length);
    answers.dataset.online = String(online.length);
    setText(answers, `${answered.length} of ${online.length} online nodes answered, ${settled.length} with every ` +
      "device's stop written");
  } else {
    delete answers.dataset.answered;
    setText(answers, "");
  }
}

function setupStop() {
  const info = contract.stop;
  const bar = $("#stop-bar");
  if (!info) { bar.hidden = true; return; }
  const reasonMax = info.schema && contract.resolve(info.schema).properties;
  if (reasonMax && reasonMax.reason && reasonMax.reason.maxLength) $("#stop-reason").maxLength = reasonMax.reason.maxLength;
  $("#stop-button").addEventListener("click", () => sendStop(true));
  $("#release-button").addEventListener("click", () => sendStop(false));
  $("#stop-reason").addEventListener("keydown", (ev) => { if (ev.key === "Enter") sendStop(true); });
}

// -- drawing -----------------------------------------------------------------------------------------------
// (Un)subscribe a state filter for a device: at once when it comes on screen, a moment after it left.
function later(dev, filter, on, delay = UNWATCH_AFTER_MS) {
  clearTimeout(dev.unwatchTimers.get(filter));
  dev.unwatchTimers.delete(filter);
  if (on || delay === 0) { bus.watch(filter, on); return; }
  dev.unwatchTimers.set(filter, setTimeout(() => { dev.unwatchTimers.delete(filter); bus.watch(filter, false); }, delay));
}

const sectionViews = new WeakMap(); // state section element -> StateView
const sectionObserver = new IntersectionObserver((entries) => {
  for (const e of entries) {
    const s = sectionViews.get(e.target);
    if (s) s.show(e.isIntersecting);
  }
}, { root: document.querySelector("main") });

const cardViews = new WeakMap(); // card element -> DeviceView
const observer = new IntersectionObserver((entries) => {
  for (const e of entries) {
    const d = cardViews.get(e.target);
    if (d) d.setVisible(e.isIntersecting);
  }
}, { root: document.querySelector("main") });

// JSON states are parsed at most once per tick (10 Hz), the newest message of each: a chart keeps one
// sample per 100 ms anyway, so the joints' 100 Hz cost one parse in ten.
const pendingStates = new Set();
let imagesPending = false, dirtyNodes = true;
function parsePending() {
  const t0 = performance.now();
  for (const sv of pendingStates) {
    const payload = sv.pending;
    sv.pending = null;
    try {
      sv.onJson(json(payload), t0);
    } catch (e) {
      perf.bad++;
      if (perf.bad <= 20 || perf.bad % 1000 === 0) {
        logLine(sv.dev.nodeView.name, sv.dev.name, `state/${sv.name}`, `bad message: ${e.message} (${perf.bad} so far)`, true);
      }
    }
  }
  pendingStates.clear();
  perf.msgMs += performance.now() - t0;
}

let lastText = 0, lastChart = 0, lastSecond = 0, frameRequested = false;
let drawNeeded = true; // set by anything that changes what is on screen
setInterval(() => {
  if (pendingStates.size) { parsePending(); drawNeeded = true; }
  const now = performance.now();
  const due = now - lastSecond >= 1000 || (drawNeeded && (now - lastText >= TEXT_EVERY_MS || now - lastChart >= CHART_EVERY_MS));
  // no frame asked for when nothing changed: an idle page costs the compositor nothing
  if (!frameRequested && (due || imagesPending || dirtyNodes || (fleet && fleet.urgent))) {
    frameRequested = true;
    requestAnimationFrame(frame);
  }
}, TICK_MS);

function frame(now) {
  frameRequested = false;
  imagesPending = false;
  dirtyNodes = false;
  perf.draws++;
  const t0 = performance.now();
  const wallNow = t0;
  const text = now - lastText >= TEXT_EVERY_MS;
  const charts = !text && now - lastChart >= CHART_EVERY_MS;
  const second = now - lastSecond >= 1000;
  if (text) lastText = now;
  if (charts) { lastChart = now; drawNeeded = false; }
  if (second) lastSecond = now;
  if (fleet) fleet.render(second);
  for (const n of nodes.values()) {
    if (n.dirty || second) n.render();
    for (const d of n.devices.values()) {
      if (d.dirty) d.render();
      // a stale device's charts stop where its data stopped (they do not scroll on into an empty window)
      const stale = d.card.dataset.health === "stale";
      for (const s of d.states.values()) {
        if (!d.visible || !s.section.open || !s.received) continue;
        if (s.binary) { s.renderImage(); continue; }
        if (text) s.renderText();
        if (charts && !stale) s.renderCharts(wallNow);
      }
    }
  }
  if (stop.dirty || second) renderStop();
  if (second) showPerf(now);
  perf.renderMs += performance.now() - t0;
}

function showPerf(now) {
  const dt = (now - shown.at) / 1000;
  if (dt <= 0) return;
  const fps = (perf.frames - shown.frames) / dt, mps = (perf.msgs - shown.msgs) / dt;
  const busy = (perf.msgMs - shown.msgMs) / (dt * 10), drawing = (perf.renderMs - shown.renderMs) / (dt * 10);
  $("#perf").textContent = `${probing ? `${fps.toFixed(0)} fps · ` : ""}${mps.toFixed(0)} msg/s · ` +
    `messages ${busy.toFixed(1)} % · drawing ${drawing.toFixed(1)} % of a core` +
    (perf.bad ? ` · ${perf.bad} bad messages` : "");
  Object.assign(shown, { frames: perf.frames, msgs: perf.msgs, msgMs: perf.msgMs, renderMs: perf.renderMs, at: now });
}

// -- connecting --------------------------------------------------------------------------------------------
// The page's link to the broker. A loss is logged once, however often the reconnects fail, and so is the
// return; while it is lost every node and device shows "stale since" the time it was lost.
function onSession() { link.gen++; stop.known = false; stop.dirty = true; } // CONNACK: what arrives from here on is current
// The session's retained messages are all in: a stop not heard again in this session is gone from the broker.
function onSynced() {
  for (const ch of CHANNELS) {
    const l = stop.latches[ch];
    if (l.gen < link.gen && l.state) onStop(ch, new Uint8Array(0));
  }
  stop.known = true;
  markAllDirty();
}
function setConn(state, detail) {
  const b = $("#conn");
  const was = link.connected;
  if (state === "connected") {
    link.connected = true;
    if (link.down) {
      logLine("broker", "", "reconnected", `after ${since(link.lostAt)} (lost at ${hms(link.lostAt)}), ${detail || ""}`);
    } else if (!link.everConnected) logLine("broker", "", "connected", detail || "");
    link.down = false;
    link.everConnected = true;
    link.lastError = "";
  } else if (state === "disconnected") {
    if (!link.down) { // once per loss: the reconnects that fail every second are not news
      link.connected = false;
      link.lostAt = Date.now();
      link.down = true;
      logLine("broker", "", "disconnected", detail || "", true);
    }
  } else if (state === "error") {
    if (detail !== link.lastError) logLine("broker", "", "error", detail || "", true); // a new reason only
    link.lastError = detail || "";
  }
  b.dataset.state = state;
  b.className = `badge ${state === "connected" ? "ok" : state === "error" ? "bad" : state === "connecting" ? "warn" : "off"}`;
  const lost = !link.connected && link.down ? ` since ${hms(link.lostAt)}` : "";
  b.textContent = state === "connected" ? "connected" : `${state}${lost}${detail ? `: ${detail}` : ""}`;
  b.title = detail || "";
  if (was !== link.connected) markAllDirty();
}

function resetModel() {
  for (const n of nodes.values()) {
    n.row.remove();
    for (const d of n.devices.values()) {
      for (const t of d.unwatchTimers.values()) clearTimeout(t);
      for (const s of d.states.values()) sectionObserver.unobserve(s.section);
      observer.unobserve(d.card);
      d.card.remove();
    }
  }
  nodes.clear();
  $("#no-nodes").hidden = false;
  Object.assign(site, { reachable: null, since: 0 });
  $("#site").hidden = true;
  stop.latches = { [SITE]: newLatch(), [FLEET]: newLatch() };
  Object.assign(stop, { known: false, dirty: true });
}

// The broker the server gives the page: its websockets URL setting, else its relay, else the broker's own
// websockets listener on the page's host.
let serverDefault = { url: "", root: "robobus", username: "" };
const SAVED = "robobus.dashboard";

// `remember`: what a person typed and connected with is kept for the next visit (never the password); URL
// parameters and the server's defaults are not, so that `?broker=...` applies to that visit only.
function connect(form, remember) {
  const url = form.url.value.trim();
  const newRoot = form.root.value.trim() || "robobus";
  if (remember) {
    if (url === serverDefault.url && newRoot === serverDefault.root && form.username.value === serverDefault.username) {
      localStorage.removeItem(SAVED);
    } else {
      localStorage.setItem(SAVED, JSON.stringify({ url, root: newRoot, username: form.username.value }));
    }
  }
  resetModel();
  // a new session of the page's own: its first connect is logged as such, its losses as they come
  Object.assign(link, { connected: false, down: false, everConnected: false, lastError: "", lostAt: 0 });
  root = newRoot;
  link.username = form.username.value;
  showBroker(url);
  bus.connect({ url, root, username: form.username.value, password: form.password.value });
}

// Which broker the page uses, and whether it is the server's default (else a button goes back to it).
function showBroker(url) {
  const using = $("#broker-in-use");
  using.textContent = url;
  using.dataset.url = url;
  using.dataset.default = String(url === serverDefault.url);
  $("#use-default").hidden = url === serverDefault.url;
  $("#use-default").title = `connect to ${serverDefault.url}`;
}

async function main() {
  const [doc, cfg] = await Promise.all([fetch("/api/asyncapi.json").then((r) => r.json()),
                                        fetch("/api/config.json").then((r) => r.json())]);
  contract = new Contract(doc);
  document.title = cfg.title || "robobus";
  bus = new Bus({ onMessage, onState: setConn, onSession, onSynced,
                  stopTopic: contract.stop ? contract.stop.topic : "_stop",
                  fleetStopTopic: contract.stop ? contract.stop.fleetTopic : null });
  setupStop();
  const form = $("#connect");
  const sites = parseSites(new URLSearchParams(location.search).get("sites") ?? cfg.sites);
  if (sites.length) { // a fleet's centre: its sites' rows above the chosen site's own view
    fleet = new Fleet(sites, { onOpen: (r) => { form.root.value = r; connect(form, false); } });
    fleet.mount($("main"), $("#overview"));
    bus.extra = fleet.filters();
  }
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SAVED) || "{}") || {}; } catch { saved = {}; }
  const q = new URLSearchParams(location.search);
  // the server's relay (fewer websocket frames, see relay.py) when it has one, else the broker's own listener
  const relay = cfg.relay ? `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}${cfg.relay}` : "";
  serverDefault = { url: cfg.ws_url || relay || `ws://${location.hostname || "127.0.0.1"}:9001`,
                    root: cfg.topic_root || "robobus", username: cfg.username || "" };
  form.url.value = q.get("broker") || saved.url || serverDefault.url;
  form.root.value = q.get("root") || saved.root || serverDefault.root;
  form.username.value = q.get("username") ?? saved.username ?? serverDefault.username;
  form.addEventListener("submit", (ev) => { ev.preventDefault(); connect(form, true); });
  $("#use-default").addEventListener("click", () => {
    localStorage.removeItem(SAVED);
    form.url.value = serverDefault.url;
    form.root.value = serverDefault.root;
    form.username.value = serverDefault.username;
    connect(form, false);
  });
  if (q.get("fps") === "1") window.__robobusProbe(true);
  // A broker that needs a password waits for the person to type it.
  if (!form.username.value || q.get("connect") === "1") connect(form, false);
  else showBroker(form.url.value);
}

main().catch((e) => { setConn("error", `dashboard failed to start: ${e.message}`); throw e; });
