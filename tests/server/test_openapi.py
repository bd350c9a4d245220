"""/openapi.json describes the server as it answers: 400 in OpenAI's format (never 422), every
status declared, and schemathesis finds no response the schema does not allow, no schema-
invalid request accepted and no 5xx (on the fake engine, in-process, a bounded number of cases)."""
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings

from pdserve.server.app import build_app
from pdserve.server.config import ServerConfig
from pdserve.server.web import ENDLESS_STREAMS
from tests.server.fake_engine import FakeEngine
from tests.server.test_connections import running_app


def make_app(**config):
    return build_app(FakeEngine(max_model_len=256), ServerConfig(served_model_name="fake-model", **config))


def test_the_schema_declares_400_in_openai_format_and_no_422():
    with TestClient(make_app(api_key="k")) as c:
        schema = c.get("/openapi.json").json()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            assert "422" not in codes and {"200", "400", "500"} <= codes, (path, method)
            ref = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse")
            if method == "post":
                assert {"413", "415", "401"} <= codes, path
    assert "401" not in schema["paths"]["/health"]["get"]["responses"]   # open without the key
    assert "text/event-stream" in schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    responses = schema["paths"]["/v1/responses"]["post"]   # the Responses API: its body, its stream, its statuses
    assert responses["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert "text/event-stream" in responses["responses"]["200"]["content"]
    assert {"404", "503", "504"} <= set(responses["responses"])
    assert schema["components"]["schemas"]["ResponsesRequest"]["properties"]["max_output_tokens"]["anyOf"][0] == \
        {"type": "integer", "minimum": 1, "maximum": 255}
    prompt = schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    assert len(prompt["anyOf"]) == 4   # the shapes the validator accepts, not "anything"
    # the ranges the server checks, with the launch caps (here the defaults)
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["n"]["maximum"] == 64 and chat["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert chat["temperature"]["anyOf"][0]["minimum"] == 0 and chat["top_p"]["anyOf"][0]["maximum"] == 1
    assert chat["stop"]["anyOf"][1]["maxItems"] == 16


# the server schemathesis runs against: short generations and many seats, so that no generated case
# (n up to 64, the default max_tokens) takes long on a busy machine
FUZZED = dict(max_tokens_cap=16)


def _operations():
    import schemathesis
    schema = schemathesis.openapi.from_dict(make_app(**FUZZED).openapi())
    return [op for op in (r.ok() for r in schema.get_all_operations()) if op.path not in ENDLESS_STREAMS]


OPERATIONS = _operations()


@pytest.fixture(scope="module")
def base_url():
    with running_app(FakeEngine(max_model_len=256, max_num_seqs=64, step_time=0.0), **FUZZED) as (host, port):
        yield f"http://{host}:{port}"


@pytest.mark.parametrize("op", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_schemathesis_finds_the_schema_and_the_server_agree(op, base_url):
    from schemathesis import GenerationMode
    from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                     response_schema_conformance, status_code_conformance)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              negative_data_rejection]
    has_input = bool(op.body or op.path_parameters or op.query)
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_input else (GenerationMode.POSITIVE,):
        @settings(max_examples=15 if has_input else 1, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        @given(op.as_strategy(mode))
        def run(case):
            case.call_and_validate(base_url=base_url, checks=checks, timeout=60)
        try:
            run()
        except Exception as e:
            if type(e).__name__ == "Unsatisfiable":   # e.g. no string path parameter violates the schema
                continue
            raise
