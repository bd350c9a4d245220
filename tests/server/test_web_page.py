"""The web page in a real browser: headless Chromium (Debian's `chromium` package) driven by
Playwright's Python API, against `pdserve serve` on the bundled default model, with every request
to anywhere but the server refused (the page must work offline).

PDSERVE_SCREENSHOTS=docs/img pytest tests/server/test_web_page.py rewrites the docs' screenshots.
"""
import json
import os
import re
import shutil

import pytest

from pdserve.engine.args import DEFAULT_MODEL

sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright: pip install -e '.[browser]' "
                                                             "(.ci/run installs it)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install -y chromium; .ci/run "
                                                "installs it)"),
    pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL, "config.json")),
                       reason="the bundled default model has not been built"),
]

DECODE_RGB = (0x4E, 0x79, 0xA7)   # charts.js COLORS.decode


@pytest.fixture(scope="module")
def page_server(start_server):
    return start_server(None, "--num-kv-blocks", "256")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, page_server):
    """A page that may load only from the server; what it tried elsewhere is in page.external."""
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.external, page.errors = [], []

    def route(r):
        url = r.request.url
        if url.startswith(page_server.url) or url.startswith("data:"):
            r.continue_()
        else:
            page.external.append(url)
            r.abort()
    page.route("**/*", route)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    yield page
    page.close()
    assert not page.errors, page.errors
    assert not page.external, page.external


def shots_dir(tmp_path) -> str:
    return os.environ.get("PDSERVE_SCREENSHOTS") or str(tmp_path)


def canvas_pixels(page, selector: str, rgb: tuple[int, int, int]) -> int:
    return page.evaluate("""([sel, [r, g, b]]) => {
        const c = document.querySelector(sel);
        const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i] === r && d[i + 1] === g && d[i + 2] === b) n++;
        return n;
    }""", [selector, list(rgb)])


def aborts(m):
    return m.get('pdserve:request_success_total{finished_reason="abort"}', 0)


def set_params(page, max_tokens: int, ignore_eos: bool) -> None:
    page.fill("#max_tokens", str(max_tokens))
    page.set_checked("#ignore_eos", ignore_eos)


def test_playground_streams_the_live_view_draws_and_stop_ends_the_request(page, page_server, tmp_path):
    page.goto(page_server.url + "/")
    page.wait_for_selector("body[data-stream=live]")
    # the name comes from its own /v1/models fetch, which may land after the stream opens (seen on a busy core)
    page.wait_for_function("document.querySelector('#model-name').textContent.length > 0")
    assert page.text_content("#model-name") == "default-model"

    # completion mode: the prompt, then its continuation, with the answer's figures
    page.click("#mode-tabs button[data-mode=completion]")
    set_params(page, 12, ignore_eos=True)
    page.fill("#input", "Once upon a time")
    page.click("#send")
    page.wait_for_selector(".msg.completion[data-state=done]", timeout=60_000)
    assert page.text_content(".completion-text .prompt") == "Once upon a time"
    assert page.text_content(".completion-text .gen").strip()
    assert re.fullmatch(r"TTFT [\d.]+ m?s · TPOT [\d.]+ m?s · 12 tokens · prompt \d+ \(\d+ cached\) · length",
                        page.text_content(".msg.completion .answer-stats")), page.text_content(".answer-stats")

    # chat: tokens arrive while the answer streams; the timeline draws the steps; stop ends it
    page.click("#mode-tabs button[data-mode=chat]")
    set_params(page, 900, ignore_eos=True)
    page.fill("#input", "Tell me a story about a cat.")
    before = aborts(page_server.metrics())
    page.click("#send")
    answer = ".msg.assistant[data-state=streaming] .content"
    page.wait_for_function(f"document.querySelector('{answer}')?.textContent.length > 0", timeout=60_000)
    first = len(page.text_content(answer))
    page.wait_for_function(f"document.querySelector('{answer}')?.textContent.length > {first + 40}",
                           timeout=60_000)   # still streaming, and more has come
    page.wait_for_function("Number(document.querySelector('#timeline').dataset.steps) >= 10")
    assert canvas_pixels(page, "#timeline", DECODE_RGB) > 0   # decode bars drawn
    assert canvas_pixels(page, "#lanes", DECODE_RGB) > 0      # and this request's lane
    page.wait_for_function("document.querySelector('#running').textContent === '1'")
    assert page.is_enabled("#stop") and not page.is_enabled("#send")
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-state=stopped]")
    assert page.text_content(".msg.assistant .answer-stats").endswith("stopped")
    # the server saw the disconnect: the request was aborted and its KV blocks freed
    page_server.wait_for(lambda m: aborts(m) == before + 1 and m["pdserve:kv_cache_usage_perc"] == 0
                         and m["pdserve:num_requests_running"] == 0)
    page.wait_for_function("document.querySelector('#running').textContent === '0'")
    page.wait_for_function("document.querySelector('#kv').textContent === '0.0 %'")

    # a short chat answer that finishes by itself
    set_params(page, 24, ignore_eos=False)
    page.fill("#input", "Hello! What do you like?")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=60_000)
    assert re.match(r"TTFT [\d.]+ m?s · TPOT ", page.text_content(".msg.assistant[data-state=done] .answer-stats"))

    # the demo burst: six short prompts and a long one, whose prefill is cut into chunks
    steps = int(page.text_content("#steps-seen"))
    page.wait_for_function("!document.querySelector('#burst').disabled")
    page.click("#burst")
    page.wait_for_function("Number(document.querySelector('#lanes').dataset.lanes) >= 7", timeout=60_000)
    page.wait_for_function("document.querySelector('#running').textContent === '0'", timeout=120_000)
    assert int(page.text_content("#steps-seen")) > steps
    page.screenshot(path=os.path.join(shots_dir(tmp_path), "web-page.png"))


def test_docs_and_redoc_render_offline(page, page_server, tmp_path):
    page.goto(page_server.url + "/docs")
    page.wait_for_selector(".swagger-ui .info .title")
    assert "pdserve" in page.text_content(".swagger-ui .info .title")
    page.wait_for_selector(".opblock[id*='v1_chat_completions']")
    refused = []   # CSP reports each load it blocks (a CDN logo in ReDoc's bundle did) on the console
    page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
    page.goto(page_server.url + "/redoc")
    page.wait_for_selector("h1:has-text('pdserve')", timeout=30_000)
    page.get_by_text("/v1/engine/steps").first.wait_for()
    assert not refused, refused


def test_an_answer_shows_the_cached_prompt_tokens_the_server_reports(page, page_server):
    # pdserve reports usage.prompt_tokens_details.cached_tokens once it caches prefixes; the page
    # shows it whenever it is there: a stream that carries it, as the browser would receive it
    chunks = [{"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
              {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop",
                                                "metrics": {"ttft_s": 0.0125, "tpot_s": 0.004}}]},
              {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 2,
                                                            "total_tokens": 22,
                                                            "prompt_tokens_details": {"cached_tokens": 16}}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda r: r.fulfill(status=200, body=body,
                                                             headers={"Content-Type": "text/event-stream"}))
    page.goto(page_server.url + "/")
    page.fill("#input", "Hello")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state=done]")
    assert page.text_content(".msg.assistant .content") == "Hi!"
    assert page.text_content(".msg.assistant .answer-stats") == \
        "TTFT 12.5 ms · TPOT 4.00 ms · 2 tokens · prompt 20 (16 cached) · stop"
