// The fleet view: at a fleet's centre, one row per site, from what the centre holds of each site: fleet-watch's
// verdict ({root}/_bridge/reachable), the nodes' retained status, the devices' health, the centre's stop for the
// site ({root}/_stop, which the site's bridge carries in as its fleet latch). The unreachable sites and those
// with a problem come first, so a fleet of a hundred reads from the top; a row's link opens that site's own view
// (the page's topic root). Shown only when the server names the sites (ROBOBUS_CENTRAL_SITES).

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  e.append(...children);
  return e;
}

// Text only written when it changed (a write lays the cell out again even when the text is the same).
function setText(e, text) {
  if (e.__text === text) return;
  e.__text = text;
  e.textContent = text;
}

// "site-a=site-a/robobus site-b=site-b/robobus" (ROBOBUS_CENTRAL_SITES), or roots alone: [[name, root], ...]
export function parseSites(text) {
  return (text || "").split(/[\s,]+/).filter(Boolean).map((item) => {
    const [name, root] = item.includes("=") ? item.split("=", 2) : [item.split("/")[0], item];
    return [name, root];
  });
}

class Site {
  constructor(name, root) {
    this.name = name;
    this.root = root;
    this.reachable = null; // fleet-watch's verdict: null when none
    this.nodes = new Map(); // node -> online
    this.health = new Map(); // "node/device" -> operational
    this.stop = null; // the centre's stop for the site: true active, false released, null none
    this.newest = 0; // when the page last heard anything of the site (ms)
    this.row = null; // its table row, made once and updated in place
  }

  // What the row says, and how bad it is (0 fine, 1 a problem, 2 unreachable).
  summary() {
    const online = [...this.nodes.values()].filter(Boolean).length;
    const notOperational = [...this.health.values()].filter((ok) => !ok).length;
    const problems = [];
    if (this.reachable === null) problems.push("no verdict");
    if (online < this.nodes.size) problems.push(`${this.nodes.size - online} node(s) offline`);
    if (notOperational) problems.push(`${notOperational} device(s) not operational`);
    if (this.stop) problems.push("stopped");
    const level = this.reachable === false ? 2 : problems.length ? 1 : 0;
    return { online, known: this.nodes.size, devices: this.health.size, notOperational, problems, level };
  }
}

export class Fleet {
  constructor(sites, { onOpen = () => {}, now = () => Date.now() } = {}) {
    this.sites = new Map(sites.map(([name, root]) => [root, new Site(name, root)]));
    this.onOpen = onOpen;
    this.now = now;
    this.dirty = true; // something changed: drawn at the next second
    this.urgent = true; // a site's reachability or stop changed: drawn at the next tick
    this.bad = 0;
    this.section = null;
    this.order = ""; // the rows' order as last drawn
  }

  // What the page subscribes to for the fleet: four filters a site, each under its own root (a clustered centre's
  // access rules refuse a wildcard for the site).
  filters() {
    const subs = {};
    for (const root of this.sites.keys()) {
      for (const f of ["_bridge/reachable", "+/status", "+/+/health", "_stop"]) subs[`${root}/${f}`] = { qos: 1 };
    }
    return subs;
  }

  // A message of one of the sites (true), or not the fleet's (false).
  route(topic, text) {
    for (const [root, site] of this.sites) {
      if (!topic.startsWith(`${root}/`)) continue;
      const parts = topic.slice(root.length + 1).split("/");
      site.newest = this.now();
      const mine = parts[0] === "_stop" || parts[0] === "_bridge" || parts[parts.length - 1] === "status" ||
                   (parts.length === 3 && parts[2] === "health");
      if (!mine) return true; // the open site's states and events: heard (its age), nothing to draw
      this.dirty = true;
      try {
        if (parts.length === 2 && parts[0] === "_bridge" && parts[1] === "reachable") {
          const was = site.reachable;
          site.reachable = text.trim() === "" ? null : text.trim() === "1" ? true : text.trim() === "0" ? false : site.reachable;
          if (was !== site.reachable) this.urgent = true;
        } else if (parts.length === 1 && parts[0] === "_stop") {
          const was = site.stop;
          site.stop = text ? Boolean(JSON.parse(text).active ?? true) : null;
          if (was !== site.stop) this.urgent = true;
        } else if (parts.length === 2 && parts[1] === "status") {
          if (!text) site.nodes.delete(parts[0]);
          else site.nodes.set(parts[0], Boolean(JSON.parse(text).online));
        } else if (parts.length === 3 && parts[2] === "health") {
          const key = `${parts[0]}/${parts[1]}`;
          if (!text) site.health.delete(key);
          else site.health.set(key, Boolean(JSON.parse(text).operational));
        }
      } catch {
        this.bad++; // a stop that is not JSON is held active by the nodes: show it so
        if (parts[0] === "_stop") site.stop = true;
      }
      return true;
    }
    return false;
  }

  // The rows in the order a person reads them: unreachable, then with a problem, then the rest; by name within.
  ordered() {
    return [...this.sites.values()].map((s) => [s, s.summary()])
      .sort((a, b) => b[1].level - a[1].level || a[0].name.localeCompare(b[0].name));
  }

  counts() {
    const rows = this.ordered();
    return { sites: rows.length, reachable: rows.filter(([s]) => s.reachable === true).length,
             unreachable: rows.filter(([s]) => s.reachable === false).length,
             problems: rows.filter(([, m]) => m.level === 1).length,
             notOperational: rows.reduce((n, [, m]) => n + m.notOperational, 0),
             stopped: rows.filter(([s]) => s.stop).length };
  }

  mount(parent, before) {
    this.section = el("section", { id: "fleet", "aria-label": "fleet" });
    this.head = el("p", { id: "fleet-summary" });
    this.body = el("tbody");
    const cols = ["site", "reachable", "nodes online", "devices not operational", "centre's stop", "last heard", "note"];
    this.section.append(this.head, el("table", { id: "fleet-sites" },
                                      el("thead", {}, el("tr", {}, ...cols.map((c) => el("th", {}, c)))), this.body));
    parent.insertBefore(this.section, before);
  }

  // Drawn when a reachability or a stop changed (at once) and otherwise at most once a second (the ages, the
  // counts): a person reads it, and a hundred sites' heartbeats change something many times a second. Each row
  // is made once and its cells written only when their text changed; the rows are put in order again only when
  // the order changed.
  render(second = false) {
    if (!this.section || !(this.urgent || second)) return; // every second: the ages move
    this.urgent = false;
    this.dirty = false;
    const c = this.counts();
    setText(this.head, `${c.reachable} of ${c.sites} sites reachable` +
      (c.unreachable ? ` · ${c.unreachable} UNREACHABLE` : "") + (c.problems ? ` · ${c.problems} with a problem` : "") +
      ` · ${c.notOperational} devices not operational · ${c.stopped} stopped`);
    this.head.dataset.unreachable = String(c.unreachable);
    const now = this.now();
    const rows = this.ordered();
    for (const [s, m] of rows) {
      if (!s.row) s.row = this.makeRow(s);
      const cells = s.row.cells;
      setText(cells[1], s.reachable === null ? "?" : s.reachable ? "yes" : "NO");
      setText(cells[2], `${m.online}/${m.known}`);
      setText(cells[3], `${m.notOperational} of ${m.devices}`);
      setText(cells[4], s.stop === null ? "-" : s.stop ? "ACTIVE" : "released");
      setText(cells[5], s.newest ? `${Math.max(0, (now - s.newest) / 1000).toFixed(0)} s ago` : "-");
      setText(cells[6], s.reachable === false ? "STALE: last known" : m.problems.join(", "));
      if (s.row.dataset.level !== String(m.level)) s.row.dataset.level = String(m.level);
    }
    const order = rows.map(([s]) => s.name).join("\n");
    if (order !== this.order) {
      this.order = order;
      this.body.replaceChildren(...rows.map(([s]) => s.row));
    }
  }

  makeRow(s) {
    const open = el("a", { href: "#", "data-root": s.root }, s.name);
    open.addEventListener("click", (ev) => { ev.preventDefault(); this.onOpen(s.root); });
    const row = el("tr", { "data-site": s.name, "data-level": "0" }, el("td", {}, open), el("td", { class: "reach" }));
    for (let i = 0; i < 5; i++) row.append(el("td"));
    return row;
  }
}
