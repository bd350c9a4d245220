"""The multi-turn chat workload and the prefix-cache figures of `pdserve bench`, without a server."""
import json

import pytest

from pdserve.bench.bench_metrics import RequestResult, compute_metrics
from pdserve.bench.datasets import multi_turn_conversations
from pdserve.bench.multi_turn import ChatRecorder, turn_summary
from pdserve.bench.client import StreamRecorder


def test_conversations_are_corpus_questions_fixed_by_the_seed():
    convs = multi_turn_conversations(6, 4, seed=3)
    assert len(convs) == 6 and all(len(c) == 4 and all(isinstance(q, str) and q for q in c) for c in convs)
    assert convs == multi_turn_conversations(6, 4, seed=3) and convs != multi_turn_conversations(6, 4, seed=4)
    with pytest.raises(ValueError, match="--num-turns"):
        multi_turn_conversations(1, 0, seed=0)


def test_passages_make_each_turn_longer_and_differ_between_turns():
    plain = multi_turn_conversations(3, 4, seed=3)
    quoted = multi_turn_conversations(3, 4, seed=3, passage_words=50)
    for conv_plain, conv in zip(plain, quoted):
        for q, turn in zip(conv_plain, conv):
            passage, question = turn.rsplit("\n\n", 1)
            assert question == q and len(passage.split()) == 50
    assert len({turn.rsplit("\n\n", 1)[0] for conv in quoted for turn in conv}) == 12
    with pytest.raises(ValueError, match="--turn-passage-words"):
        multi_turn_conversations(1, 1, seed=0, passage_words=-1)


def chat_chunk(delta, finish=None, usage=None):
    event = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if delta is not None else []}
    if usage:
        event["usage"] = usage
    return "data: " + json.dumps(event)


def test_a_role_only_chunk_is_not_the_first_token_and_the_answer_is_kept():
    rec = ChatRecorder(sent=1.0)
    usage = {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}}
    for t, line in [(1.01, chat_chunk({"role": "assistant", "content": ""})), (1.5, chat_chunk({"content": "Hi"})),
                    (1.6, chat_chunk({})), (1.7, chat_chunk({"content": " there"}, finish="length")),
                    (1.8, chat_chunk(None, usage=usage)), (1.9, "data: [DONE]")]:
        if not rec.feed(line, t):
            break
    r = rec.result(None)
    assert r.success and r.ttft == pytest.approx(0.5) and len(r.itl) == 2   # the empty delta is a token too
    assert rec.text == "Hi there" and (r.prompt_len, r.cached_tokens) == (40, 32)


def test_cached_tokens_are_optional_in_usage():
    rec = StreamRecorder(sent=0.0)
    rec.feed('data: {"choices": [{"text": "a", "finish_reason": null}]}', 0.1)
    rec.feed('data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}', 0.2)
    assert rec.result(5).cached_tokens is None
    res = compute_metrics([rec.result(5)], 1.0)
    assert res["prefix_cache_hit_rate"] is None and res["total_cached_tokens"] is None


def ok(kind, prompt, cached, ttft):
    return RequestResult(prompt_len=prompt, output_tokens=2, ttft=ttft, latency=ttft + 0.1, success=True,
                         kind=kind, cached_tokens=cached)


def test_hit_rate_and_per_turn_ttft():
    results = [ok("turn1", 20, 0, 0.4), ok("turn1", 20, 0, 0.6), ok("turn2", 60, 32, 0.2), ok("turn2", 60, 48, 0.1),
               ok("turn3", 100, 96, 0.05), RequestResult(prompt_len=100, kind="turn3", error="HTTP 500")]
    res = compute_metrics(results, 2.0)
    assert res["total_cached_tokens"] == 176 and res["prefix_cache_hit_rate"] == pytest.approx(176 / 260)
    s = turn_summary(results)
    assert [(t["turn"], t["completed"], t["mean_prompt_tokens"]) for t in s["turns"]] == [(1, 2, 20), (2, 2, 60),
                                                                                         (3, 1, 100)]
    assert [t["prefix_cache_hit_rate"] for t in s["turns"]] == [0.0, pytest.approx(80 / 120), pytest.approx(0.96)]
    assert s["turns"][0]["median_ttft_ms"] == pytest.approx(500)
    assert s["later_turns_median_ttft_ms"] == pytest.approx(100)
