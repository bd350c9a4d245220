// The live engine view, fed by GET /v1/engine/steps: the last WINDOW steps as stacked prefill and
// decode tokens (the step's duration drawn over them), and below them, on the same columns, each
// request as a lane through its phases: waiting, prefill chunks, decode, preempted, finished.
import { call, errorMessage, fmtMs, sseEvents } from "./api.js";
import { drawLanes, drawTimeline } from "./charts.js";

const WINDOW = 120;   // steps drawn, and kept

const $ = (id) => document.getElementById(id);

const state = {
  config: null,
  events: [],            // step events, oldest first
  lanes: new Map(),      // request id -> {id, first, last, cells: [[seq, kind, tokens]], end, reason}
  mine: new Set(),       // engine request ids of the playground's answers
  frozen: null,          // the events shown while paused
  hover: null,           // column under the mouse
  lastSeq: null,
  skipped: 0,            // steps this page missed (it fell behind; the server dropped them for it)
  stepsSeen: 0,
  waitingForDecode: [],  // demo burst: resolvers waiting for a step with decodes
};

export function initEngineView() {
  $("pause").addEventListener("click", () => {
    state.frozen = state.frozen ? null : [...state.events];
    $("pause").textContent = state.frozen ? "Resume" : "Pause";
    redraw();
  });
  $("burst").addEventListener("click", burst);
  document.addEventListener("pdserve:mine", (e) => { state.mine.add(e.detail); redraw(); });
  const timeline = $("timeline");
  timeline.addEventListener("mousemove", (e) => {
    const rect = timeline.getBoundingClientRect();
    state.hover = { x: e.clientX - rect.left };
    redraw();
  });
  timeline.addEventListener("mouseleave", () => { state.hover = null; redraw(); });
  window.addEventListener("resize", redraw);
  connect();
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function setStream(text, live) {
  $("stream-state").textContent = text;
  $("stream-state").classList.toggle("live", !!live);
  document.body.dataset.stream = live ? "live" : "down";
}

async function connect() {
  for (;;) {
    try {
      const res = await call(`/v1/engine/steps?history=${WINDOW}`);
      if (!res.ok) {
        setStream(`step stream: ${await errorMessage(res)}`, false);
      } else {
        setStream("live", true);
        for await (const ev of sseEvents(res)) {
          if (ev.event === "config") onConfig(JSON.parse(ev.data));
          else if (ev.event === "step") onStep(JSON.parse(ev.data));
        }
        setStream("stream ended; reconnecting", false);
      }
    } catch (e) {
      setStream("disconnected; reconnecting", false);
    }
    await sleep(2000);
  }
}

function onConfig(c) {
  // a (re)connection: the server resends its recent history, so start over
  state.config = c;
  state.events = [];
  state.lanes.clear();
  state.lastSeq = null;
  const cap = c.max_prefill_tokens_with_decodes ? ` · prefill ≤ ${c.max_prefill_tokens_with_decodes} beside decodes` : "";
  $("engine-config").textContent = `${c.model} (${c.backend}) · step budget ${c.max_num_batched_tokens} tokens` +
    ` · ≤ ${c.max_num_seqs} sequences${cap} · context ${c.max_model_len} · KV block ${c.block_size} tokens`;
  redraw();
}

function cellKind(r) {
  if (r.preempted) return "preempted";
  if (r.step_tokens > 0) return r.step_prefill ? "prefill" : "decode";
  return r.state === "waiting" ? "waiting" : "idle";
}

function onStep(e) {
  if (state.lastSeq !== null && e.seq <= state.lastSeq) return;   // already seen
  if (state.lastSeq !== null && e.seq > state.lastSeq + 1) state.skipped += e.seq - state.lastSeq - 1;
  state.lastSeq = e.seq;
  state.events.push(e);
  if (state.events.length > WINDOW) state.events.splice(0, state.events.length - WINDOW);
  if (e.step) state.stepsSeen++;
  for (const r of e.requests || []) {
    let lane = state.lanes.get(r.id);
    if (!lane) state.lanes.set(r.id, lane = { id: r.id, first: e.seq, cells: [], end: null, reason: null });
    lane.last = e.seq;
    lane.cells.push([e.seq, cellKind(r), r.step_tokens]);
    if (r.state === "finished") { lane.end = e.seq; lane.reason = r.finish_reason; }
  }
  // what has scrolled out of the window (or the paused view): whole lanes, and old cells of long ones
  const oldest = (state.frozen && state.frozen.length ? state.frozen : state.events)[0].seq;
  for (const [id, lane] of state.lanes) {
    if (lane.last < oldest) state.lanes.delete(id);
    else while (lane.cells[0][0] < oldest) lane.cells.shift();
  }
  if (e.step && e.step.decode_tokens > 0) state.waitingForDecode.splice(0).forEach((resolve) => resolve());
  updateCards(e);
  redraw();
}

function visible() { return state.frozen || state.events; }

function updateCards(e) {
  $("running").textContent = e.running;
  $("waiting").textContent = e.waiting;
  $("kv").textContent = `${(100 * e.kv_cache_usage).toFixed(1)} %`;
  $("kv-bar").style.width = `${(100 * e.kv_cache_usage).toFixed(1)}%`;
  $("kv-detail").textContent = `${e.kv_total_blocks - e.kv_free_blocks} of ${e.kv_total_blocks} blocks`;
  const steps = state.events.filter((x) => x.step);
  if (e.step) $("last-step").textContent = fmtMs(e.step.duration_s);
  const busy = steps.reduce((s, x) => s + x.step.duration_s, 0);
  const pre = steps.reduce((s, x) => s + x.step.prefill_tokens, 0);
  const dec = steps.reduce((s, x) => s + x.step.decode_tokens, 0);
  $("prefill-rate").textContent = busy > 0 ? `${Math.round(pre / busy)}` : "–";
  $("decode-rate").textContent = busy > 0 ? `${Math.round(dec / busy)}` : "–";
  $("steps-seen").textContent = state.stepsSeen;
  $("skipped").textContent = state.skipped ? `${state.skipped} steps skipped (this page fell behind)` : "";
  $("burst").disabled = e.running + e.waiting > 0;
}

let drawPending = false;
function redraw() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => {
    drawPending = false;
    const events = visible();
    const t = $("timeline");
    const col = drawTimeline(t, events, WINDOW, state.config, state.hover);
    t.dataset.steps = events.filter((x) => x.step).length;
    const lanes = [...state.lanes.values()];
    const l = $("lanes");
    l.dataset.lanes = drawLanes(l, events, WINDOW, lanes, state.mine, col);
    $("step-detail").textContent = describeStep(col === null ? events[events.length - 1] : events[col]);
  });
}

function describeStep(e) {
  if (!e) return "No steps yet: send a message, or a demo burst.";
  if (!e.step) return `#${e.seq}: no forward (requests ended by abort) · running ${e.running} · waiting ${e.waiting}`;
  const s = e.step;
  return `step #${e.seq}: ${s.prefill_tokens} prefill + ${s.decode_tokens} decode tokens, ${s.num_seqs} sequence${s.num_seqs === 1 ? "" : "s"}` +
    ` · ${fmtMs(s.duration_s)} (forward ${fmtMs(s.forward_s)})` + (s.preemptions ? ` · ${s.preemptions} preempted` : "") +
    ` · after it: running ${e.running}, waiting ${e.waiting}, KV ${(100 * e.kv_cache_usage).toFixed(1)} %`;
}

// A long prompt among short ones: the short ones start decoding, then the long one's prefill is
// cut into chunks that share steps with their decodes.
async function burst() {
  const c = state.config;
  if (!c) return;
  $("burst").disabled = true;
  const sentence = "The little robot walked through the quiet town and looked at every window and every door. ";
  const shorts = ["Once upon a time", "The dog ran", "In the morning", "A girl named Lily", "The sun was", "One day"];
  const shortTokens = Math.max(1, Math.min(64, c.max_model_len - 16));
  // one HTTP request for all the short prompts: a browser opens at most 6 connections to a server
  const requests = [call("/v1/completions",
    { body: { prompt: shorts, max_tokens: shortTokens, temperature: 0.8, ignore_eos: true } })];
  try {
    const per = (await (await call("/tokenize", { body: { prompt: sentence } })).json()).count;
    const want = Math.min(c.max_model_len - 48, 2 * c.max_num_batched_tokens);
    const longPrompt = sentence.repeat(Math.max(1, Math.floor(want / Math.max(1, per))));
    await Promise.race([new Promise((r) => state.waitingForDecode.push(r)), sleep(2000)]);
    requests.push(call("/v1/completions", { body: { prompt: longPrompt, max_tokens: 8, temperature: 0.8 } }));
    const failed = (await Promise.all(requests)).filter((r) => !r.ok);
    if (failed.length) $("notice").textContent = `demo burst: ${await errorMessage(failed[0])}`;
  } catch (e) {
    $("notice").textContent = `demo burst: ${e}`;
  }
}
