// The page's entry: the playground, the live view, the model's name, the health dot, the API key.
import { apiKey, call, setApiKey } from "./api.js";
import { initEngineView } from "./engine_view.js";
import { initPlayground } from "./playground.js";

const $ = (id) => document.getElementById(id);

async function showModel() {
  try {
    const res = await call("/v1/models");
    if (res.ok) $("model-name").textContent = (await res.json()).data[0].id;
  } catch { /* the health dot says the server is down */ }
}

async function pollHealth() {
  for (;;) {
    let ok = false, why = "unreachable";
    try {
      const res = await fetch("/health");
      ok = res.ok;
      why = ok ? "healthy" : (await res.json()).error.message;
    } catch { /* unreachable */ }
    $("health").className = `dot ${ok ? "ok" : "bad"}`;
    $("health").title = why;
    await new Promise((r) => setTimeout(r, 5000));
  }
}

function initKey() {
  $("api-key").value = apiKey();
  $("api-key").addEventListener("change", () => { setApiKey($("api-key").value.trim()); location.reload(); });
  document.addEventListener("pdserve:need-key", () => { $("key-box").hidden = false; $("api-key").focus(); });
  if (apiKey()) $("key-box").hidden = false;
}

initKey();
initPlayground();
initEngineView();
showModel();
pollHealth();
