"""Every admission refusal and default of server/limits.py, decided with no engine: a Limits over
a ServerConfig and the numbers an engine publishes, each refusal sent through the server's error
handlers so its status and OpenAI-format body are checked too."""
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pdserve.server.config import ServerConfig
from pdserve.server.errors import install_error_handlers
from pdserve.server.limits import Limits, queue_full


def limits(room: bool = True, **config) -> Limits:
    return Limits(ServerConfig("m", **config), max_model_len=100, max_seq_len=80, max_num_seqs=4,
                  has_room=lambda n: room, max_token_chars=2)


def refusal(check) -> tuple[int, dict, dict]:
    """(status, error body, headers) of the refusal `check()` raises, as a handler's client gets it."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/")
    def refuse():
        check()
        return {}
    r = TestClient(app).get("/")
    return r.status_code, r.json()["error"], r.headers


CASES = [   # (check, status, param, code, words of the message)
    (lambda: limits().check_model("other"), 404, "model", "model_not_found", "does not exist"),
    (lambda: limits(max_stop_strings=1).check_stop(["a", "b"]), 400, "stop", None, "at most 1 stop strings"),
    (lambda: limits(max_stop_length=2).check_stop(["abc"]), 400, "stop", None, "at most 2 characters"),
    (lambda: limits(max_stop_token_ids=1).check_stop([], [1, 2]), 400, "stop_token_ids", None, "--max-stop-token-ids"),
    (lambda: limits(max_n=2).check_n(3), 400, "n", None, "--max-n"),
    (lambda: limits().check_logprobs(-1, "logprobs"), 400, "logprobs", None, "must be >= 0"),
    (lambda: limits(max_logprobs=3).check_logprobs(4, "top_logprobs"), 400, "top_logprobs", None, "--max-logprobs"),
    (lambda: limits(max_waiting=2).check_queue(7), 400, "n", None, "at most 6 can be admitted"),
    (lambda: limits(room=False).check_queue(1), 503, None, "queue_full", "--max-waiting 256"),
    (lambda: limits(max_request_cost=10).check_cost(2, 3, 1), 400, "max_tokens", None, "= 12 tokens"),
    (lambda: limits().check_prompt_logprobs(1, "prompt_logprobs"), 400, "prompt_logprobs", None, "not computed"),
    (lambda: limits(max_request_cost=7).check_prompt_cost(1, 2, None, [[1, 2, 3]], 1, 1, "prompt_logprobs"), 400,
     "prompt_logprobs", None, "= 8 tokens"),
    (lambda: limits(max_prompt_tokens=3).check_prompt_chars(["abcdefg"]), 400, "prompt", None, "7 characters"),
    (lambda: limits(max_tokens_cap=5).check_max_tokens(6), 400, "max_tokens", None, "--max-tokens-cap"),
    (lambda: limits(max_tokens_cap=5).request_max_tokens(6, 16, 1, None), 400, "max_tokens", None, "at most 5"),
    (lambda: limits(max_prompt_tokens=2).check_prompt_len([[1, 2, 3]], "messages"), 400, "messages", None,
     "at most 2 prompt tokens"),
]


@pytest.mark.parametrize("check, status, param, code, words", CASES)
def test_each_refusal_has_its_status_and_openai_body(check, status, param, code, words):
    got, error, headers = refusal(check)
    assert got == status and error["param"] == param and error["code"] == code and words in error["message"]
    assert error["type"] == ("server_error" if status == 503 else "invalid_request_error")
    assert (headers.get("retry-after") == "1") == (status == 503)


def test_what_passes_is_not_refused():
    ok = limits(max_stop_strings=1, max_n=2, max_tokens_cap=5, max_prompt_tokens=3)
    ok.check_model(None), ok.check_model("m"), ok.check_stop(["a"]), ok.check_n(2), ok.check_logprobs(20, "logprobs")
    ok.check_queue(1), ok.check_cost(1, 5, None), ok.check_max_tokens(5), ok.check_prompt_len([[1, 2, 3]])
    ok.check_prompt_chars(["abcdef"]), ok.check_prompt_logprobs(None, "prompt_logprobs")


def test_defaults_are_lowered_to_the_room_the_cap_and_the_cost():
    assert limits().request_max_tokens(None, 16, 1, None) == 16
    assert limits().request_max_tokens(None, 50, 1, None, room=30) == 30
    assert limits(max_tokens_cap=8).request_max_tokens(None, 50, 1, None, room=30) == 8
    assert limits(max_request_cost=40).request_max_tokens(None, 50, 2, 1) == 10   # 2 x 10 x (1 + 1) = 40
    assert limits(max_request_cost=40).request_max_tokens(None, 50, 1, None, spent=35) == 5
    assert limits().request_max_tokens(None, 50, 1, None, room=-3) == 1   # the prompt alone is too long: 1
    assert limits().request_max_tokens(70, 16, 1, None) == 70   # the client's own is kept (the engine checks it)
    assert limits().default_within_context(64, [0] * 90) == 10 and limits().default_within_context(64, [0] * 99) == 1


def test_the_queue_full_refusal_is_worded_once():
    assert queue_full(4).message == "too many requests waiting (--max-waiting 4); retry later"
    assert queue_full(4, 9).message == "too many requests waiting (9, --max-waiting 4); retry later"
    assert queue_full(4).status == 503 and queue_full(4).code == "queue_full"
