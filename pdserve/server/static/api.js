// Talking to the server: the API key, error messages, and server-sent events read from fetch()
// (EventSource cannot send an Authorization header, and cannot be aborted per request).

const KEY = "pdserve-api-key";

export function apiKey() { return localStorage.getItem(KEY) || ""; }
export function setApiKey(key) { key ? localStorage.setItem(KEY, key) : localStorage.removeItem(KEY); }

export function headers(json = true) {
  const h = json ? { "Content-Type": "application/json" } : {};
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// fetch() with the key; a 401 asks the page for one (main.js shows the key box).
export async function call(path, { body, signal, method } = {}) {
  const res = await fetch(path, {
    method: method || (body === undefined ? "GET" : "POST"),
    headers: headers(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
  });
  if (res.status === 401) document.dispatchEvent(new CustomEvent("pdserve:need-key"));
  return res;
}

// The message of an OpenAI-format error response, or its status line.
export async function errorMessage(res) {
  try {
    const j = await res.json();
    return (j.error && j.error.message) || `${res.status} ${res.statusText}`;
  } catch {
    return `${res.status} ${res.statusText}`;
  }
}

// Yields {event, data, id} for each server-sent event of a fetch() response, until it ends.
export async function* sseEvents(res) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value;
      let end;
      while ((end = buf.search(/\r?\n\r?\n/)) >= 0) {
        const block = buf.slice(0, end);
        buf = buf.slice(end).replace(/^\r?\n\r?\n/, "");
        const ev = parseBlock(block);
        if (ev) yield ev;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

function parseBlock(block) {
  const ev = { event: "message", data: [], id: null };
  for (const line of block.split(/\r?\n/)) {
    if (!line || line.startsWith(":")) continue;   // a comment (keepalive)
    const i = line.indexOf(":");
    const field = i < 0 ? line : line.slice(0, i);
    const value = i < 0 ? "" : line.slice(i + 1).replace(/^ /, "");
    if (field === "data") ev.data.push(value);
    else if (field === "event") ev.event = value;
    else if (field === "id") ev.id = value;
  }
  if (!ev.data.length) return null;
  ev.data = ev.data.join("\n");
  return ev;
}

export function fmtMs(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
  const ms = seconds * 1000;
  if (ms >= 1000) return `${seconds.toFixed(2)} s`;
  return ms >= 100 ? `${ms.toFixed(0)} ms` : ms >= 10 ? `${ms.toFixed(1)} ms` : `${ms.toFixed(2)} ms`;
}
