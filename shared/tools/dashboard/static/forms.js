// A form for any command, generated from its request's JSON Schema (pydantic's output): numbers with
// their ranges, enums as choices, booleans, strings, nested objects; anything else (lists, maps, unions)
// as a JSON text box. Values are checked against the schema with Ajv before anything is sent.

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") e.textContent = v; else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c) e.append(c);
  return e;
}

// anyOf [X, {type: null}] or type [X, "null"] -> X, nullable
function unwrapNullable(contract, schema) {
  const s = contract.resolve(schema);
  if (Array.isArray(s.type) && s.type.includes("null")) {
    const types = s.type.filter((t) => t !== "null");
    if (types.length === 1) {
      const { default: dflt, ...rest } = s;
      return { schema: { ...rest, type: types[0], ...(dflt === null ? {} : { default: dflt }) }, nullable: true };
    }
  }
  const alts = s.anyOf || s.oneOf;
  if (alts) {
    const nonNull = alts.filter((a) => a.type !== "null");
    if (nonNull.length === 1 && nonNull.length < alts.length) {
      return { schema: { ...contract.resolve(nonNull[0]), ...pick(s, "default", "description", "title") }, nullable: true };
    }
  }
  return { schema: s, nullable: false };
}

function pick(o, ...keys) {
  const out = {};
  for (const k of keys) if (o[k] !== undefined) out[k] = o[k];
  return out;
}

function choices(s) {
  if (Array.isArray(s.enum)) return s.enum;
  if (s.const !== undefined) return [s.const];
  return null;
}

// Returns {node, read(): value | undefined, setErrors(map path->msg)}
function field(contract, name, rawSchema, required, path) {
  const { schema: s, nullable } = unwrapNullable(contract, rawSchema);
  const id = `f-${path.join("-")}-${Math.random().toString(36).slice(2, 7)}`;
  const label = el("label", { for: id, text: `${s.title || name}${required ? " *" : ""}` });
  const help = [s.description, range(s)].filter(Boolean).join(" · ");
  const err = el("span", { class: "err", "data-path": path.join(".") });
  const wrap = (input, read) => {
    const node = el("div", { class: "field", "data-field": path.join(".") }, label, input,
                    help ? el("span", { class: "help", text: help }) : null, err);
    return { node, read, errs: [[path.join("."), err]] };
  };
  const opts = choices(s);
  if (opts) {
    const sel = el("select", { id, name });
    if (!required || nullable) sel.append(el("option", { value: "", text: "(none)" }));
    opts.forEach((o, i) => sel.append(el("option", { value: String(i), text: String(o) })));
    if (s.default !== undefined && opts.includes(s.default)) sel.value = String(opts.indexOf(s.default));
    return wrap(sel, () => (sel.value === "" ? undefined : opts[Number(sel.value)]));
  }
  if (s.type === "boolean") {
    const cb = el("input", { id, name, type: "checkbox" });
    cb.checked = s.default === true;
    return wrap(cb, () => cb.checked);
  }
  if (s.type === "integer" || s.type === "number") {
    const inp = el("input", { id, name, type: "number", step: s.type === "integer" ? "1" : "any",
                              min: s.minimum ?? s.exclusiveMinimum, max: s.maximum ?? s.exclusiveMaximum,
                              value: s.default ?? undefined, placeholder: nullable ? "(empty = none)" : undefined });
    // The browser's own number check is off (form.noValidate): the schema gives the message.
    return wrap(inp, () => {
      const t = inp.value.trim();
      if (t === "") return undefined;
      const n = Number(t);
      return Number.isNaN(n) ? t : n;
    });
  }
  if (s.type === "string") {
    const big = (s.maxLength ?? 0) > 4096; // firmware images, not file names
    const inp = big ? el("textarea", { id, name, rows: "3" }) : el("input", { id, name, type: "text" });
    if (typeof s.default === "string") inp.value = s.default;
    let node = inp;
    if (big) { // e.g. firmware as Intel HEX text: let a person load it from a file
      const file = el("input", { type: "file", "aria-label": `${name} from a file` });
      file.addEventListener("change", async () => { if (file.files[0]) inp.value = await file.files[0].text(); });
      node = el("div", {}, inp, file);
    }
    return wrap(node, () => (inp.value === "" && (nullable || !required) ? undefined : inp.value));
  }
  if (s.type === "object" && s.properties) {
    const sub = objectFields(contract, s, path);
    const fs = el("fieldset", { "data-field": path.join(".") }, el("legend", { text: s.title || name }), ...sub.nodes);
    return { node: fs, read: sub.read, errs: sub.errs };
  }
  // lists, maps, unions: JSON, with the default as a starting point
  const ta = el("textarea", { id, name, rows: "2", placeholder: "JSON" });
  if (s.default !== undefined && s.default !== null) ta.value = JSON.stringify(s.default);
  return wrap(ta, () => {
    const t = ta.value.trim();
    if (t === "") return undefined;
    try { return JSON.parse(t); } catch (e) { return new NotJson(e.message); }
  });
}

class NotJson { constructor(message) { this.message = message; } }

function range(s) {
  const lo = s.minimum ?? s.exclusiveMinimum, hi = s.maximum ?? s.exclusiveMaximum;
  if (lo !== undefined && hi !== undefined) return `${lo} … ${hi}`;
  if (lo !== undefined) return `≥ ${lo}`;
  if (hi !== undefined) return `≤ ${hi}`;
  if (s.maxLength !== undefined) return `up to ${s.maxLength} characters`;
  return "";
}

function objectFields(contract, schema, path) {
  const req = new Set(schema.required || []);
  const parts = Object.entries(schema.properties || {}).map(
    ([k, v]) => [k, field(contract, k, v, req.has(k), [...path, k])]);
  return {
    nodes: parts.map(([, f]) => f.node),
    errs: parts.flatMap(([, f]) => f.errs),
    read() {
      const out = {};
      for (const [k, f] of parts) { const v = f.read(); if (v !== undefined) out[k] = v; }
      return out;
    },
  };
}

// The document's command summary is the doc string with "Error codes: a, b." appended (shared/tools/asyncapi.py).
export function splitDoc(summary) {
  const m = /^(.*?)\s*Error codes: ([^]*?)\.?$/s.exec(summary || "");
  return m ? { text: m[1], errors: m[2] } : { text: summary || "", errors: "" };
}

// buildCommandForm(contract, entry, send(body) -> Promise<reply>, onReply(body, reply))
export function buildCommandForm(contract, entry, send, onReply) {
  const schema = contract.resolve(entry.schema);
  const fields = objectFields(contract, schema, []);
  const formError = el("div", { class: "form-error", role: "alert" });
  const button = el("button", { type: "submit", text: entry.job ? "start" : "send" });
  // What the command does, next to its button, in the contract's words: the command's doc string in the
  // service's API and its request model's (e.g. that a motion expires unless renewed), then its error codes.
  const { text: doc, errors } = splitDoc(entry.doc);
  const about = [doc, schema.description].filter((t, i, all) => t && all.indexOf(t) === i).join(" ");
  const help = el("p", { class: "cmd-help" }, about ? el("span", { class: "about", text: about }) : null,
                  errors ? el("span", { class: "codes", text: ` May answer: ${errors}` }) : null);
  const form = el("form", { class: "cmd", "data-command": entry.name }, ...fields.nodes, formError,
                  el("div", { class: "submit" }, button, help));
  form.noValidate = true;
  const reply = el("pre", { class: "reply", "aria-live": "polite" });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    for (const [, e] of fields.errs) e.textContent = "";
    formError.textContent = "";
    reply.textContent = "";
    delete reply.dataset.ok;
    const body = fields.read();
    const notJson = Object.entries(body).filter(([, v]) => v instanceof NotJson);
    if (notJson.length) {
      for (const [k, v] of notJson) show(fields.errs, formError, k, `not JSON: ${v.message}`);
      form.dataset.result = "refused";
      return;
    }
    const errors = contract.validate(entry.schema, body);
    if (errors.length) {
      for (const e of errors) show(fields.errs, formError, e.path, e.message);
      form.dataset.result = "refused";
      return;
    }
    button.disabled = true;
    form.dataset.result = "sent";
    try {
      const rep = await send(body);
      reply.dataset.ok = String(!!rep.ok);
      reply.textContent = JSON.stringify(rep, null, 2);
      form.dataset.result = rep.ok ? "ok" : "error";
      onReply(body, rep);
    } finally {
      button.disabled = false;
    }
  });
  return el("div", {}, form, reply);
}

// Put a message next to its field; errors about the whole request (or a field without an input) go on top.
function show(errs, formError, path, message) {
  let best = null;
  for (const [p, e] of errs) {
    if (path === p || path.startsWith(`${p}.`)) { if (!best || p.length > best[0].length) best = [p, e]; }
  }
  if (best && best[0] !== "") best[1].textContent = best[1].textContent ? `${best[1].textContent}; ${message}` : message;
  else formError.textContent = `${formError.textContent ? `${formError.textContent}; ` : ""}${path ? `${path}: ` : ""}${message}`;
}
