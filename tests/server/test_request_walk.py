"""The request's walk: a plain chat completion (no tools, no template variables, no earlier calls)
runs no code of the opt-in features' modules; a request that uses them does (so the check can fail)."""
import os
import sys
import threading

from fastapi.testclient import TestClient

import pdserve
from pdserve.server.app import build_app
from pdserve.server.config import ServerConfig
from tests.server.fake_engine import FakeEngine

SERVER = os.path.join(os.path.dirname(pdserve.__file__), "server")
FEATURES = {"tool_calls.py", "reasoning.py"}


def server_files_run(body: dict) -> set[str]:
    """The pdserve/server files whose functions ran while the app answered `body` (after a warm-up)."""
    seen, on = set(), [False]

    def profile(frame, event, arg):
        if on[0] and event == "call" and frame.f_code.co_filename.startswith(SERVER):
            seen.add(os.path.basename(frame.f_code.co_filename))

    threading.setprofile(profile)   # the app's portal thread, started below, inherits it
    sys.setprofile(profile)
    try:
        with TestClient(build_app(FakeEngine(), ServerConfig(served_model_name="fake-model"))) as c:
            assert c.post("/v1/chat/completions", json=body).status_code == 200
            on[0] = True
            assert c.post("/v1/chat/completions", json=body).status_code == 200
            on[0] = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


def test_plain_chat_runs_no_feature_code():
    ran = server_files_run({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert "openai_api.py" in ran and "protocol.py" in ran   # the profile saw the handler
    assert not ran & FEATURES, f"a plain chat completion ran {sorted(ran & FEATURES)}"


def test_features_run_when_asked_for():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
    ran = server_files_run({"model": "fake-model", "max_tokens": 2, "chat_template_kwargs": {"mood": "calm"},
                            "messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": None, "tool_calls": [call]},
                                         {"role": "tool", "tool_call_id": "call_1", "content": "2"},
                                         {"role": "user", "content": "and?"}]})
    assert FEATURES <= ran
