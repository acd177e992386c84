// The bus stop's two latches as the page shows them (shared/stop.py; docs/kit.md "Stopping everything"): the
// site's own `{root}/_stop` (the page's STOP and release write it) and the fleet centre's `{root}/_stop/fleet`
// (the site's bridge brings the centre's stop onto it; no client at the site writes it). Every node is stopped
// while either is active; a release lifts only its own latch, so the page's release cannot lift the fleet's stop.
// Pure functions of the page's model (no DOM, no MQTT): app.js draws what they say; the tests run them in node.

export const SITE = "site";
export const FLEET = "fleet";
export const CHANNELS = [SITE, FLEET];

// The document's two stop channels (x-robobus kind "stop"): the site's `<root>/<name>` and the fleet's, whose
// address is the site's with one more level (`<root>/_stop/fleet`). -> {topic, fleetTopic} (names under the
// root; fleetTopic null when the document has no fleet latch), or null without a stop channel.
export function stopTopics(doc) {
  const addrs = Object.values(doc.channels || {})
    .filter((ch) => ch["x-robobus"] && ch["x-robobus"].kind === "stop" && typeof ch.address === "string")
    .map((ch) => ch.address);
  const site = addrs.filter((a) => !addrs.some((b) => b !== a && a.startsWith(`${b}/`)))
    .sort((a, b) => a.length - b.length)[0];
  const m = site && /^(?:\{root\}|[^{}]+)\/([^{}/]+)$/.exec(site);
  if (!m) return null;
  const fleet = addrs.find((a) => a.startsWith(`${site}/`) && !a.slice(site.length + 1).includes("/"));
  return { topic: m[1], fleetTopic: fleet ? `${m[1]}/${fleet.slice(site.length + 1)}` : null };
}

export function newLatch() { return { state: null, bad: "", gen: -1 }; }

// One latch's message as every node reads it: empty -> no stop (a release); not a StopState -> held as an active
// stop of source "unknown", ts 0 (and `bad` says why). `validate(state)` -> [] or [{path, message}].
export function readStop(text, validate) {
  if (!text) return { state: null, bad: "" };
  let state, bad = "";
  try {
    state = JSON.parse(text);
    const errs = validate(state);
    if (errs.length) bad = errs.map((e) => `${e.path || "message"} ${e.message}`).join("; ");
  } catch (e) { bad = `not JSON: ${e.message}`; }
  if (bad) state = { active: true, source: "unknown", reason: "", ts: 0 };
  return { state, bad };
}

function isActive(l) { return !!(l && l.state && l.state.active); }

// The active latches, the newest stop first (the one the nodes name as their effective stop).
export function activeChannels(latches) {
  return CHANNELS.filter((ch) => isActive(latches[ch])).sort((a, b) => latches[b].state.ts - latches[a].state.ts);
}

// The stop the page shows first: the newest active one, else the site's release, else the fleet's: [channel, latch].
export function effective(latches) {
  const act = activeChannels(latches);
  if (act.length) return [act[0], latches[act[0]]];
  for (const ch of CHANNELS) if (latches[ch] && latches[ch].state) return [ch, latches[ch]];
  return ["", null];
}

// A node's answer ({root}/{node}/_node/state/stop) answers the present state of the latch it names (the same ts,
// source and active), not an earlier one (retained).
export function answerCurrent(latches, a) {
  if (!a) return false;
  const l = latches[a.channel || SITE];
  const s = l && l.state;
  return !!(s && a.stop_ts === s.ts && a.active === s.active && a.source === s.source);
}

const WHO = { [SITE]: "", [FLEET]: "FLEET " };

function who(l) {
  const s = l.state;
  return l.bad ? `unreadable stop message (${l.bad})` : `by ${s.source}${s.reason ? `: ${s.reason}` : ""}`;
}

// The header's banner: {kind (unknown|none|released|active), channel ("", site, fleet, both), text, note,
// release (offer the page's release: the site's latch is active)}. `fmt`: {hms(ms), since(ms)}; `opts`:
// {known, connected, fleetTopic (the full topic)}.
export function banner(latches, opts, fmt) {
  const site = latches[SITE], fleet = latches[FLEET];
  const act = activeChannels(latches);
  const release = isActive(site);
  let note = "";
  if (isActive(fleet)) {
    note = `The fleet's stop (${opts.fleetTopic || "the fleet latch"}) is the fleet centre's: only the centre ` +
      "releases it. This page's release lifts only the site's stop.";
  }
  if (!opts.known && !site.state && !fleet.state) {
    return { kind: "unknown", channel: "", text: opts.connected ? "bus stop: reading…" : "bus stop: not known", note, release };
  }
  if (!act.length) {
    const [ch, l] = effective(latches);
    if (!l) return { kind: "none", channel: "", text: "no bus stop", note, release };
    const rel = CHANNELS.filter((c) => latches[c].state)
      .map((c) => `${c === FLEET ? "fleet " : ""}released ${fmt.hms(latches[c].state.ts * 1000)} by ${latches[c].state.source}` +
        `${latches[c].state.reason ? `: ${latches[c].state.reason}` : ""}`);
    return { kind: "released", channel: ch, text: `no bus stop · ${rel.join(" · ")}`, note, release };
  }
  const parts = act.map((ch) => {
    const l = latches[ch], s = l.state;
    if (l.bad) return `${WHO[ch]}BUS STOP: unreadable stop message (${l.bad}): held as active by every node`;
    return `${WHO[ch]}BUS STOP ACTIVE since ${fmt.hms(s.ts * 1000)} (${fmt.since(s.ts * 1000)}) ${who(l)}`;
  });
  return { kind: "active", channel: act.length === 2 ? "both" : act[0], text: parts.join(" · and "), note, release };
}

// The head of a motion device's stop line while a stop is active: the effective stop's.
export function deviceHead(latches, fmt) {
  const act = activeChannels(latches);
  if (!act.length) return "";
  const l = latches[act[0]], s = l.state;
  const also = act.length === 2 ? ` (and the ${act[1] === FLEET ? "fleet's" : "site's"} stop)` : "";
  return `${WHO[act[0]]}BUS STOP ${who(l)}${s.ts ? ` · since ${fmt.hms(s.ts * 1000)}` : ""}${also}`;
}
