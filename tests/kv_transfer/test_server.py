"""Two servers, a prefill worker and a decode worker, driven by hand the way the proxy drives
them: the prefill call (max_tokens 1, do_remote_decode), then the decode call with the
kv_transfer_params it returned; the answer equals a colocated server's."""
import json
import logging

import httpx
import pytest

from pdserve.engine.llm_engine import LLMEngine
from tests.kv_transfer.pd import SECRET
from tests.server.conftest import metrics
from tests.server.inprocess import serve
from tests.server.test_step_events import StepStream

ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8)
PROMPT = "Once upon a time there was a little robot who lived in a lighthouse by the sea, and every night"


@pytest.fixture(scope="module")
def urls(tiny_qwen2):
    with serve(LLMEngine(tiny_qwen2, **ENGINE)) as both, \
            serve(LLMEngine(tiny_qwen2, role="prefill", kv_transfer_secret=SECRET, **ENGINE)) as pre, \
            serve(LLMEngine(tiny_qwen2, role="decode", kv_transfer_secret=SECRET, **ENGINE)) as dec:
        yield both, pre, dec


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _prefill(pre: str, dec: str, path: str, body: dict) -> dict:
    """The prefill call, its lease made for the decode worker at `dec`: the kv_transfer_params."""
    dec_id = httpx.get(dec + "/v1/kv_transfer").json()["engine_id"]
    first = {**body, "max_tokens": 1, "stream": False,
             "kv_transfer_params": {"do_remote_decode": True, "decode_engine_id": dec_id}}
    r = _post(pre, path, first)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _via_pair(pre: str, dec: str, path: str, body: dict) -> tuple[dict, httpx.Response]:
    kv = _prefill(pre, dec, path, body)
    return kv, _post(dec, path, {**body, "kv_transfer_params": kv})


def test_kv_transfer_endpoint(urls):
    both, pre, dec = (httpx.get(u + "/v1/kv_transfer").json() for u in urls)
    assert both["role"] == "both" and both["kv_port"] is None
    assert pre["role"] == "prefill" and isinstance(pre["kv_port"], int) and pre["kv_host"] == "127.0.0.1"
    assert dec["role"] == "decode"
    for info in (both, pre, dec):
        assert info["block_size"] == 16 and info["dtype"] == "float32" and info["model"] == "tiny"
    assert pre["engine_id"] != dec["engine_id"]


def test_completion_through_the_pair_equals_colocated(urls):
    both, pre, dec = urls
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    ref = _post(both, "/v1/completions", body).json()
    kv, r = _via_pair(pre, dec, "/v1/completions", body)
    info = httpx.get(pre + "/v1/kv_transfer").json()
    assert kv["do_remote_prefill"] is True and kv["remote_port"] == info["kv_port"]
    assert kv["remote_engine_id"] == info["engine_id"] and kv["num_tokens"] == ref["usage"]["prompt_tokens"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    assert r.json()["usage"] == ref["usage"]
    assert "kv_transfer_params" not in r.json()
    m = metrics(dec)
    assert m["pdserve:kv_transfer_bytes_total"] > 0 and m["pdserve:kv_transfers_total"] >= 1
    assert metrics(pre)["pdserve:kv_transfer_bytes_total"] == m["pdserve:kv_transfer_bytes_total"]


def test_streamed_chat_through_the_pair_equals_colocated(urls):
    both, pre, dec = urls
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10, "temperature": 0}
    ref = _post(both, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    _, r = _via_pair(pre, dec, "/v1/chat/completions", {**body, "stream": True})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == ref


def test_plain_requests_are_served_by_either_role(urls):
    both, pre, dec = urls
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    ref = _post(both, "/v1/completions", body).json()["choices"][0]["text"]
    for url in (pre, dec):
        assert _post(url, "/v1/completions", body).json()["choices"][0]["text"] == ref


@pytest.mark.parametrize("kv, param", [
    ({"do_remote_prefill": True, "remote_port": "80"}, "kv_transfer_params"),
    ({"do_remote_prefill": True, "remote_port": 9, "remote_request_id": "x", "num_tokens": 3}, "kv_transfer_params.remote_host"),
    ({"do_remote_prefill": True, "do_remote_decode": True}, "kv_transfer_params.do_remote_prefill"),
    ({"transport": "rdma"}, "kv_transfer_params"),
    ("yes", "kv_transfer_params"),
])
def test_bad_kv_transfer_params_are_400(urls, kv, param):
    r = _post(urls[2], "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": kv})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_remote_decode_needs_one_unstreamed_choice(urls):
    pre = urls[1]
    for extra in ({"n": 2}, {"stream": True}, {"prompt": [PROMPT, PROMPT]}):
        body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}, **extra}
        r = _post(pre, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.do_remote_decode"
    r = _post(urls[0], "/v1/completions", {"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "--role both" in r.json()["error"]["message"]


def test_decode_worker_refuses_a_mismatched_block_size(urls):
    both, pre, dec = urls
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    kv, _ = _via_pair(pre, dec, "/v1/completions", body)   # (this one pulls and releases)
    r = _post(dec, "/v1/completions", {**body, "kv_transfer_params": {**kv, "block_size": 32}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.block_size"


def test_the_lease_token_is_shown_by_no_endpoint_or_log(urls, caplog):
    """Only the prefill response carries the lease's token: not /v1/engine/steps (which lists the
    prefill request), /metrics, /v1/kv_transfer, nor the workers' logs at INFO."""
    both, pre, dec = urls
    caplog.set_level(logging.INFO)
    steps = StepStream(pre, lambda events: any(r["state"] == "finished" for e in events for r in e["requests"]))
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    kv = _prefill(pre, dec, "/v1/completions", body)
    shown = json.dumps(steps.join())
    assert '"finished"' in shown   # the stream saw the prefill request
    r = _post(dec, "/v1/completions", {**body, "kv_transfer_params": kv})
    assert r.status_code == 200, r.text
    for url in (pre, dec):
        shown += httpx.get(url + "/metrics").text + httpx.get(url + "/v1/kv_transfer").text
    assert kv["remote_request_id"] not in shown + caplog.text

