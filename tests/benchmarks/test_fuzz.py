"""Schemathesis against the live server's own OpenAPI schema, at test size (~100 cases)."""
from benchmarks import fuzz


def test_checks_catch_what_they_should():
    ok = '{"error": {"message": "bad", "type": "invalid_request_error", "param": null, "code": null}}'
    assert fuzz.check_response(400, "application/json", ok) is None
    assert fuzz.check_response(200, "application/json", "{}") is None
    assert "HTTP 500" in fuzz.check_response(500, "application/json", ok)
    assert "OpenAI" in fuzz.check_response(422, "application/json", '{"detail": [{"loc": ["body"]}]}')
    assert "OpenAI" in fuzz.check_response(400, "application/json", '{"error": {"message": "x"}}')
    assert "not JSON" in fuzz.check_response(404, "text/plain", "Not Found")
    stream = 'data: {"error": {"message": "boom", "type": "server_error", "param": null, "code": null}}\n\n'
    assert "stream" in fuzz.check_response(200, "text/event-stream", stream)


def test_fuzz_every_endpoint(tiny_llama, tmp_path):
    s = fuzz.run_fuzz(tiny_llama, num_cases=100, log_dir=str(tmp_path))
    assert s["failures"] == [] and s["ok"], s["problems"]
    assert s["cases"] >= 100 and len(s["cases_by_operation"]) == s["operations"] >= 12
    assert s["server_errors_5xx"] == 0 and s["hangs_or_transport_errors"] == 0 and s["non_openai_errors"] == 0
    assert not s["kv_leak"]
