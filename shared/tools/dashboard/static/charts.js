// Small time-series charts: one ring buffer per numeric field, drawn on a canvas a few times a second.
// A 100 Hz state keeps one sample per BUCKET_MS (the newest), so a minute is at most 600 points, and a
// chart draws at most two points per pixel column (min and max), whatever the message rate.

export const WINDOW_MS = 60_000;
const BUCKET_MS = 100;
const CAP = Math.ceil(WINDOW_MS / BUCKET_MS) + 8;

export class Series {
  constructor() {
    this.t = new Float64Array(CAP);
    this.v = new Float64Array(CAP);
    this.start = 0; // index of the oldest sample
    this.n = 0;
    this.last = NaN;
    this.count = 0; // every value pushed (tests read it)
  }

  push(tMs, value) {
    this.last = value;
    this.count++;
    if (this.n > 0) {
      const newest = (this.start + this.n - 1) % CAP;
      if (tMs - this.t[newest] < BUCKET_MS) { this.v[newest] = value; return; }
    }
    if (this.n === CAP) { this.start = (this.start + 1) % CAP; this.n--; }
    const i = (this.start + this.n) % CAP;
    this.t[i] = tMs;
    this.v[i] = value;
    this.n++;
  }

  // drop what fell out of the window
  trim(nowMs) {
    while (this.n > 0 && this.t[this.start] < nowMs - WINDOW_MS) { this.start = (this.start + 1) % CAP; this.n--; }
  }
}

export function formatValue(v) {
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  return a !== 0 && (a < 0.01 || a >= 1e5) ? v.toExponential(2) : v.toFixed(a < 10 ? 3 : 1);
}

// One sparkline into a w x h area at (x0, y0) of a shared 2D context: the charts of a state share one canvas
// (one compositor layer instead of one per chart).
export function drawSparkline(ctx, x0, y0, w, h, series, nowMs) {
  series.trim(nowMs);
  if (series.n === 0) return;
  let lo = Infinity, hi = -Infinity;
  for (let k = 0; k < series.n; k++) {
    const x = series.v[(series.start + k) % CAP];
    if (x < lo) lo = x;
    if (x > hi) hi = x;
  }
  if (hi === lo) { hi += 1; lo -= 1; }
  const sx = w / WINDOW_MS, sy = (h - 4) / (hi - lo), t0 = nowMs - WINDOW_MS;
  const base = y0 + h - 2;
  ctx.beginPath();
  let col = -1, cmin = 0, cmax = 0, started = false;
  const flush = () => {
    const y1 = base - (cmin - lo) * sy, y2 = base - (cmax - lo) * sy;
    if (!started) { ctx.moveTo(x0 + col, y1); started = true; } else ctx.lineTo(x0 + col, y1);
    if (y2 !== y1) ctx.lineTo(x0 + col, y2);
  };
  for (let k = 0; k < series.n; k++) {
    const i = (series.start + k) % CAP;
    const x = Math.round((series.t[i] - t0) * sx), y = series.v[i];
    if (x !== col) { if (col >= 0) flush(); col = x; cmin = y; cmax = y; }
    else { if (y < cmin) cmin = y; if (y > cmax) cmax = y; }
  }
  if (col >= 0) flush();
  ctx.stroke();
}
