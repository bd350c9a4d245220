"""The app in-process on the fake engine: error formatting, middleware, health states, CLI flags."""
import subprocess
import sys

import pytest
import torch
from fastapi.testclient import TestClient

from pdserve.server.app import build_app
from pdserve.server.errors import validation_message
from pdserve.server.config import ServerConfig
from tests.server.fake_engine import FakeEngine


@pytest.mark.parametrize("errors,message,param", [
    ([{"type": "missing", "loc": ("body", "prompt"), "msg": "Field required"}], "prompt: Field required", "prompt"),
    ([{"type": "string_type", "loc": ("body", "messages", 0, "content", "str"), "msg": "Input should be a valid string"}],
     "messages[0].content: Input should be a valid string", "messages"),
    ([{"type": "int_type", "loc": ("body", "stop_token_ids", "list[int]", 2), "msg": "bad"}],
     "stop_token_ids[2]: bad", "stop_token_ids"),
    ([{"type": "value_error", "loc": ("body", "prompt"), "msg": "Value error, nope", "ctx": {"error": ValueError("nope")}}],
     "prompt: nope", "prompt"),
    ([{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}],
     "request body is not valid JSON: Expecting value (at character 7)", None),
    ([{"type": "dict_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}],
     "request body must be a JSON object matching the schema: Input should be a valid dictionary", None),
])
def test_validation_message_names_the_field(errors, message, param):
    assert validation_message(errors) == (message, param)


def app_client(engine=None, **config):
    engine = engine or FakeEngine()
    return TestClient(build_app(engine, ServerConfig(served_model_name="fake-model", **config)))


def test_api_key_and_body_limit_middleware():
    with app_client(api_key="k", max_body_bytes=100) as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert c.get("/health").status_code == 200
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ab"
        big = c.post("/v1/completions", json={"prompt": "x" * 200}, headers={"Authorization": "Bearer k"})
        assert big.status_code == 413 and "100 bytes" in big.json()["error"]["message"]
        # a chunked body (no Content-Length) is counted as it arrives
        chunked = c.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 200, b'"}']),
                         headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
        assert chunked.status_code == 413


def test_health_reports_a_dead_engine_and_shutdown():
    with app_client(FakeEngine(fail_at_step=1)) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        health = c.get("/health")
        assert health.status_code == 503 and "fake engine failure" in health.json()["error"]["message"]
    with app_client() as c:
        c.app.state.pdserve.async_engine.accepting = False   # what SIGTERM does
        assert c.get("/health").status_code == 503
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def test_serve_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--model", "--dtype", "--device", "--block-size", "--num-kv-blocks", "--kv-cache-memory",
                 "--max-num-batched-tokens", "--max-num-seqs", "--max-model-len", "--seed", "--host", "--port",
                 "--served-model-name", "--api-key", "--max-waiting", "--max-body-bytes", "--max-stop-strings",
                 "--max-stop-length", "--max-prompt-tokens", "--max-tokens-cap", "--max-n", "--max-logprobs",
                 "--request-timeout",
                 "--shutdown-timeout", "--log-level"):
        assert flag in out, flag
    assert "PDSERVE_API_KEY" in out and "127.0.0.1" in out


def test_kernel_pool_bytes_exported_at_each_scrape():
    from prometheus_client.parser import text_string_to_metric_families
    from pdserve.backends.cpu.kernels import cpu_ops, pool_cached_bytes
    from pdserve.server.metrics import ServerMetrics
    if cpu_ops() is None:
        pytest.skip("this CPU runs none of the kernels' builds")

    def scraped(metrics) -> float:
        families = text_string_to_metric_families(metrics.render().decode())
        return next(s.value for f in families for s in f.samples if s.name == "pdserve:cpu_kernel_pool_bytes")

    metrics, ops = ServerMetrics(), cpu_ops()
    y = ops.silu_and_mul(torch.randn(600, 2 * 4096))   # a 9.4 MiB output: its buffer goes to the pool when freed
    assert scraped(metrics) == pool_cached_bytes()   # every loaded build's pool
    size = y.numel() * 4
    del y
    assert scraped(metrics) == pool_cached_bytes() >= ops.pool_cached_bytes() >= size
