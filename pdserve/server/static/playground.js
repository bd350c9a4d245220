// The playground: chat (the server applies the chat template) or plain completion, streamed,
// with each answer's TTFT, TPOT, tokens and cached prompt tokens. Stop aborts the fetch: the
// server sees the disconnect and frees the request's KV blocks within a step.
import { call, errorMessage, fmtMs, sseEvents } from "./api.js";

const $ = (id) => document.getElementById(id);

let mode = "chat";
let history = [];       // chat messages sent so far: {role, content}
let current = null;     // the answer being streamed: {controller}

export function initPlayground() {
  for (const b of document.querySelectorAll("#mode-tabs button")) {
    b.addEventListener("click", () => setMode(b.dataset.mode));
  }
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", () => current && current.controller.abort());
  $("clear").addEventListener("click", clear);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
}

function setMode(m) {
  mode = m;
  for (const b of document.querySelectorAll("#mode-tabs button")) b.classList.toggle("active", b.dataset.mode === m);
  $("chat-view").hidden = m !== "chat";
  $("completion-view").hidden = m !== "completion";
  $("input").placeholder = m === "chat" ? "Message (Enter sends, Shift+Enter for a new line)"
                                        : "Prompt to continue (Enter sends)";
}

function clear() {
  if (current) current.controller.abort();
  history = [];
  $("messages").replaceChildren();
  $("completion-out").replaceChildren();
}

// The sampling parameters as the API takes them; blank fields are left to the server's defaults.
function samplingParams() {
  const p = {};
  const num = (id) => { const v = $(id).value.trim(); return v === "" ? undefined : Number(v); };
  for (const [id, key] of [["temperature", "temperature"], ["top_p", "top_p"], ["max_tokens", "max_tokens"],
                           ["seed", "seed"]]) {
    const v = num(id);
    if (v !== undefined) p[key] = v;
  }
  if ($("ignore_eos").checked) p.ignore_eos = true;   // vLLM's extension: generate all max tokens
  // several stop strings separated by |; \n and \t as typed escapes
  const stop = $("stop_strings").value.split("|").map((s) => s.replace(/\\n/g, "\n").replace(/\\t/g, "\t"))
    .filter((s) => s.length);
  if (stop.length) p.stop = stop;
  return p;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

async function send() {
  const text = $("input").value;
  if (current || !text.trim()) return;
  let path, body, out, stats;
  const convo = history;
  if (mode === "chat") {
    const system = $("system").value.trim();
    history.push({ role: "user", content: text });
    $("messages").append(el("div", "msg user", text));
    const answer = el("div", "msg assistant");
    out = el("div", "content");
    stats = el("div", "answer-stats", "waiting for the first token…");
    answer.append(out, stats);
    $("messages").append(answer);
    answer.scrollIntoView({ block: "end" });
    path = "/v1/chat/completions";
    body = { messages: system ? [{ role: "system", content: system }, ...history] : [...history] };
    out.parentElement.dataset.state = "streaming";
  } else {
    const box = $("completion-out");
    box.replaceChildren();
    const pre = el("div", "completion-text");
    pre.append(el("span", "prompt", text));
    out = el("span", "gen");
    pre.append(out);
    stats = el("div", "answer-stats", "waiting for the first token…");
    const answer = el("div", "msg completion");
    answer.append(pre, stats);
    box.append(answer);
    path = "/v1/completions";
    body = { prompt: text };
    answer.dataset.state = "streaming";
  }
  $("input").value = "";
  const answerEl = out.closest(".msg");
  const controller = new AbortController();
  current = { controller };
  $("send").disabled = true;
  $("stop").disabled = false;
  const result = await stream(path, { ...body, ...samplingParams(), stream: true,
                                      stream_options: { include_usage: true } }, controller.signal, out);
  current = null;
  $("send").disabled = false;
  $("stop").disabled = true;
  answerEl.dataset.state = result.state;
  stats.textContent = describe(result);
  if (result.state === "error") stats.classList.add("error");
  if (body.messages && convo === history) {   // (not cleared meanwhile)
    if (result.text) history.push({ role: "assistant", content: result.text });
    else history.pop();   // nothing came back: the question can be asked again
  }
}

// Streams one request into `out`; returns what the stats line needs.
async function stream(path, body, signal, out) {
  const r = { state: "done", text: "", events: 0, sent: performance.now(), first: null, last: null,
              finish: null, metrics: null, usage: null, error: null };
  try {
    const res = await call(path, { body, signal });
    if (!res.ok) return { ...r, state: "error", error: await errorMessage(res) };
    for await (const ev of sseEvents(res)) {
      if (ev.data === "[DONE]") break;
      const j = JSON.parse(ev.data);
      if (j.error) { r.state = "error"; r.error = j.error.message; continue; }
      if (j.id && !r.id) {
        r.id = j.id;
        // engine request `{id}-0` is this answer: the live view marks its lane
        document.dispatchEvent(new CustomEvent("pdserve:mine", { detail: `${j.id}-0` }));
      }
      if (j.usage) r.usage = j.usage;
      const c = j.choices && j.choices[0];
      if (!c) continue;
      if (!(c.delta && c.delta.role)) {   // not chat's opening {role} chunk
        const piece = c.delta ? c.delta.content : c.text;
        r.events++;   // one event per generated token (its text may be empty)
        const now = performance.now();
        if (r.first === null) r.first = now;
        r.last = now;
        if (piece) { r.text += piece; out.textContent += piece; }
      }
      if (c.finish_reason) { r.finish = c.finish_reason; r.metrics = c.metrics || null; }
    }
  } catch (e) {
    if (e.name === "AbortError") return { ...r, state: "stopped" };
    return { ...r, state: "error", error: String(e) };
  }
  return r;
}

function describe(r) {
  if (r.state === "error") return `error: ${r.error}`;
  const parts = [];
  const m = r.metrics;
  // the engine's own timings when the request finished; the browser's otherwise (it was stopped)
  const ttft = m && m.ttft_s !== null ? m.ttft_s : r.first === null ? null : (r.first - r.sent) / 1000;
  const tpot = m && m.tpot_s !== null ? m.tpot_s
    : r.events > 1 ? (r.last - r.first) / 1000 / (r.events - 1) : null;
  parts.push(`TTFT ${fmtMs(ttft)}`, `TPOT ${fmtMs(tpot)}`);
  const tokens = r.usage ? r.usage.completion_tokens : r.events;
  parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
  if (r.usage) {
    const cached = r.usage.prompt_tokens_details && r.usage.prompt_tokens_details.cached_tokens;
    parts.push(cached !== undefined && cached !== null
      ? `prompt ${r.usage.prompt_tokens} (${cached} cached)` : `prompt ${r.usage.prompt_tokens}`);
  }
  parts.push(r.state === "stopped" ? "stopped" : r.finish || "ended");
  return parts.join(" · ");
}
