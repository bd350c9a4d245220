// Canvas drawing for the live view. Both charts share their columns: column i is the i-th of the
// last `window` step events, so a request's lane lines up with the steps it was in.

export const COLORS = {
  prefill: "#f28e2b", decode: "#4e79a7", waiting: "#d3d8df", idle: "#eceff3", preempted: "#e15759",
  finished: "#59a14f", aborted: "#e15759", duration: "rgba(55, 65, 81, 0.55)", grid: "#e5e7eb", text: "#4b5563", hover: "#fde68a",
};
const LEFT = 128;    // gutter for the y axis and the lanes' labels
const RIGHT = 52;    // gutter for the duration axis
const ROW = 15;      // lane height
const MAX_LANES = 14;

// A canvas sized for its CSS box and the screen's pixel ratio; returns its context and CSS size.
function prepare(canvas, cssHeight) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(cssHeight * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(cssHeight * dpr);
    canvas.style.height = `${cssHeight}px`;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, cssHeight);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w, h: cssHeight };
}

// As many columns as steps to show (at least 40, so the first steps are not slivers), up to `window`.
function columns(w, window, n) {
  return { x0: LEFT, width: Math.max(1, (w - LEFT - RIGHT) / Math.min(window, Math.max(40, n))) };
}

// Stacked decode (bottom) and prefill tokens per step, the step budget, the step duration.
// Returns the column under `hover` ({x}), or null.
export function drawTimeline(canvas, events, window, config, hover) {
  const { ctx, w, h } = prepare(canvas, 220);
  const { x0, width } = columns(w, window, events.length);
  const top = 14, bottom = h - 22, plot = bottom - top;
  const steps = events.filter((e) => e.step);
  if (!events.length) {
    ctx.fillStyle = COLORS.text;
    ctx.fillText("No engine steps yet.", x0, (top + bottom) / 2);
  }
  const budget = config ? config.max_num_batched_tokens : 0;
  // scaled to the window's busiest step (the budget line is drawn when it is in range)
  const maxTokens = Math.max(8, ...steps.map((e) => e.step.prefill_tokens + e.step.decode_tokens)) * 1.1;
  const maxDur = Math.max(1e-4, ...steps.map((e) => e.step.duration_s));
  const y = (tokens) => bottom - (tokens / maxTokens) * plot * 0.95;
  const yd = (s) => bottom - (s / maxDur) * plot * 0.95;

  let col = null;
  if (hover && hover.x >= x0 && events.length) {
    col = Math.min(events.length - 1, Math.floor((hover.x - x0) / width));
    ctx.fillStyle = COLORS.hover;
    ctx.fillRect(x0 + col * width, top, width, plot);
  }
  // axes: tokens on the left, seconds on the right
  ctx.strokeStyle = COLORS.grid;
  ctx.fillStyle = COLORS.text;
  ctx.textAlign = "right";
  for (const frac of [0, 0.5, 1]) {
    const v = Math.round((maxTokens / 1.1) * frac);
    ctx.beginPath(); ctx.moveTo(x0, y(v)); ctx.lineTo(w - RIGHT, y(v)); ctx.stroke();
    ctx.fillText(`${v}`, x0 - 6, y(v) + 4);
  }
  ctx.save();
  ctx.translate(12, (top + bottom) / 2); ctx.rotate(-Math.PI / 2); ctx.textAlign = "center";
  ctx.fillText("tokens per step", 0, 0);
  ctx.restore();
  ctx.textAlign = "left";
  ctx.fillText(fmt(maxDur), w - RIGHT + 6, yd(maxDur) + 4);
  ctx.fillText("0 ms", w - RIGHT + 6, bottom + 4);

  events.forEach((e, i) => {
    if (!e.step) return;
    const x = x0 + i * width + (width > 3 ? 0.5 : 0), bw = Math.max(1, width - (width > 3 ? 1 : 0));
    // at least 2 px for any tokens: a few decodes beside a long prefill chunk stay visible
    const d = e.step.decode_tokens, p = e.step.prefill_tokens;
    const hd = d ? Math.max(2, bottom - y(d)) : 0, hp = p ? Math.max(2, y(d) - y(d + p)) : 0;
    ctx.fillStyle = COLORS.decode;
    ctx.fillRect(x, bottom - hd, bw, hd);
    ctx.fillStyle = COLORS.prefill;
    ctx.fillRect(x, bottom - hd - hp, bw, hp);
    if (e.step.preemptions) {
      ctx.fillStyle = COLORS.preempted;
      ctx.fillRect(x, top, bw, 4);
    }
  });
  if (budget && budget <= maxTokens) {   // the step's token budget
    ctx.setLineDash([4, 4]); ctx.strokeStyle = "#9ca3af";
    ctx.beginPath(); ctx.moveTo(x0, y(budget)); ctx.lineTo(w - RIGHT, y(budget)); ctx.stroke();
    ctx.setLineDash([]);
    ctx.fillStyle = COLORS.text; ctx.textAlign = "left";
    ctx.fillText(`budget ${budget}`, x0 + 4, y(budget) - 4);
  }
  // step duration, on the right axis
  ctx.strokeStyle = COLORS.duration; ctx.lineWidth = 1;
  ctx.beginPath();
  let started = false;
  events.forEach((e, i) => {
    if (!e.step) return;
    const x = x0 + (i + 0.5) * width, yy = yd(e.step.duration_s);
    started ? ctx.lineTo(x, yy) : ctx.moveTo(x, yy);
    started = true;
  });
  ctx.stroke();
  ctx.lineWidth = 1;
  // the window's first and last step numbers
  if (events.length) {
    ctx.fillStyle = COLORS.text;
    ctx.textAlign = "left";
    ctx.fillText(`#${events[0].seq}`, x0, h - 6);
    ctx.textAlign = "right";
    ctx.fillText(`#${events[events.length - 1].seq}`, x0 + events.length * width, h - 6);
    const span = events[events.length - 1].time - events[0].time;
    ctx.textAlign = "center";
    ctx.fillText(`${events.length} steps over ${span.toFixed(1)} s`, (x0 + w - RIGHT) / 2, h - 6);
  }
  return col;
}

function fmt(seconds) {
  const ms = seconds * 1000;
  return ms >= 1000 ? `${seconds.toFixed(1)} s` : ms >= 10 ? `${ms.toFixed(0)} ms` : `${ms.toFixed(1)} ms`;
}

// "chatcmpl-1f0c…-0" -> "chat 1f0c·0": the endpoint, the id's first characters, the choice.
const KINDS = { chatcmpl: "chat", cmpl: "cmpl", gen: "gen" };
function shortId(id) {
  const m = id.match(/^([a-z]+)-([0-9a-f]{4})[0-9a-f]*-(\d+)$/);
  return m ? `${KINDS[m[1]] || m[1]} ${m[2]}·${m[3]}` : id.slice(0, 14);
}

// One lane per request seen in the window, most recent at the bottom. Returns how many were drawn.
export function drawLanes(canvas, events, window, lanes, mine, hoverCol) {
  const index = new Map(events.map((e, i) => [e.seq, i]));
  let shown = lanes.filter((l) => l.cells.some(([seq]) => index.has(seq)));
  const hidden = Math.max(0, shown.length - MAX_LANES);
  shown = shown.slice(-MAX_LANES);
  const h = Math.max(2, shown.length) * ROW + 8 + (hidden ? ROW : 0);
  const { ctx, w } = prepare(canvas, h);
  const { x0, width } = columns(w, window, events.length);
  if (hoverCol !== null) {
    ctx.fillStyle = COLORS.hover;
    ctx.fillRect(x0 + hoverCol * width, 0, width, h);
  }
  ctx.textBaseline = "middle";
  if (!shown.length) {
    ctx.fillStyle = COLORS.text;
    ctx.fillText("Requests appear here, one lane each, while the page is watching.", x0, ROW);
  }
  shown.forEach((lane, row) => {
    const yTop = 4 + row * ROW;
    ctx.fillStyle = mine.has(lane.id) ? "#111827" : COLORS.text;
    ctx.font = mine.has(lane.id) ? "bold 11px system-ui, sans-serif" : "11px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.fillText((mine.has(lane.id) ? "▸ " : "") + shortId(lane.id), x0 - 6, yTop + ROW / 2);
    for (const [seq, kind] of lane.cells) {
      const i = index.get(seq);
      if (i === undefined) continue;
      ctx.fillStyle = COLORS[kind];
      ctx.fillRect(x0 + i * width, yTop + 2, Math.max(1, width), ROW - 4);
    }
    const end = lane.end === null ? undefined : index.get(lane.end);
    if (end !== undefined) {   // the finish: a cap, red if aborted or failed
      const bad = lane.reason === "abort" || lane.reason === "error";
      ctx.fillStyle = bad ? COLORS.aborted : COLORS.finished;
      const x = x0 + (end + 1) * width;
      ctx.fillRect(x, yTop + 1, 3, ROW - 2);
      ctx.font = "10px system-ui, sans-serif";
      ctx.textAlign = "left";
      ctx.fillText(lane.reason || "", x + 5, yTop + ROW / 2);
    }
  });
  if (hidden) {
    ctx.fillStyle = COLORS.text;
    ctx.textAlign = "left";
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillText(`+ ${hidden} more requests`, x0, 4 + shown.length * ROW + ROW / 2);
  }
  return shown.length;
}
