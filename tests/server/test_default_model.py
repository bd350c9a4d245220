"""`pdserve serve` with no --model serves the bundled default model."""
import os

import httpx
import pytest

from pdserve.engine.args import DEFAULT_MODEL


@pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL, "config.json")),
                    reason="the bundled default model has not been built")
def test_serve_without_model_serves_the_default(start_server):
    server = start_server(None, "--num-kv-blocks", "64")   # a small KV cache: this test needs little
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["default-model"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": "default-model", "messages": [{"role": "user", "content": "Hello!"}],
                         "max_completion_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    server.stop()
