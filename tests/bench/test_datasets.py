"""Prompt generation of `pdserve bench`: lengths as asked, shared prefixes, the long-short mix,
files, and the token pool from either style of /tokenize."""
import json
from collections import Counter

import httpx
import numpy as np
import pytest

from pdserve.bench.datasets import (fetch_token_pool, file_requests, long_short_requests, random_requests,
                                         sample_lengths, shared_prefix_requests)

POOL = list(range(100, 400))


def test_random_lengths_and_ids():
    reqs = random_requests(POOL, 50, input_len=32, output_len=8, range_ratio=0.0, seed=1)
    assert [len(r.prompt) for r in reqs] == [r.prompt_len for r in reqs] == [32] * 50
    assert [r.output_len for r in reqs] == [8] * 50
    assert all(t in POOL for r in reqs for t in r.prompt)
    assert len({tuple(r.prompt) for r in reqs}) == 50   # no two prompts alike


def test_random_range_ratio_spreads_lengths_within_bounds():
    reqs = random_requests(POOL, 200, input_len=40, output_len=10, range_ratio=0.5, seed=2)
    ins, outs = [len(r.prompt) for r in reqs], [r.output_len for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 60 and len(set(ins)) > 10
    assert min(outs) >= 5 and max(outs) <= 15 and len(set(outs)) > 5


def test_prompts_are_fixed_by_the_seed_and_fresh_for_a_new_one():
    a = random_requests(POOL, 5, 16, 4, 0.0, seed=7)
    assert a == random_requests(POOL, 5, 16, 4, 0.0, seed=7)
    b = random_requests(POOL, 5, 16, 4, 0.0, seed=8)
    assert all(x.prompt[:4] != y.prompt[:4] for x, y in zip(a, b))   # no shared prefix to hit a cache


def test_sample_lengths_validates_the_ratio_and_floors_at_low():
    with pytest.raises(ValueError):
        sample_lengths(None, 3, 10, 1.0)
    assert min(sample_lengths(np.random.default_rng(0), 100, 1, 0.9, low=1)) == 1


def test_shared_prefix_groups_share_their_prefix():
    reqs = shared_prefix_requests(POOL, 12, num_groups=3, prefix_len=20, suffix_len=6, output_len=4,
                                  range_ratio=0.0, seed=3)
    prefixes = Counter(tuple(r.prompt[:20]) for r in reqs)
    assert len(prefixes) == 3 and set(prefixes.values()) == {4}
    assert all(len(r.prompt) == r.prompt_len == 26 for r in reqs)
    assert len({tuple(r.prompt[20:]) for r in reqs}) == 12   # suffixes are each request's own
    order = [list(prefixes).index(tuple(r.prompt[:20])) for r in reqs]
    assert order != sorted(order)   # groups interleave rather than arrive one after another


def test_long_short_mix():
    reqs = long_short_requests(POOL, 20, short_len=8, long_len=100, output_len=4, long_fraction=0.1,
                               range_ratio=0.0, seed=4)
    kinds = [r.kind for r in reqs]
    assert kinds.count("long") == 2 and kinds.count("short") == 18
    assert all(len(r.prompt) == (100 if r.kind == "long" else 8) == r.prompt_len for r in reqs)
    long_at = [i for i, k in enumerate(kinds) if k == "long"]
    assert long_at[0] > 0 and long_at[1] - long_at[0] >= 5   # spread out, short requests before each
    assert [r.kind for r in long_short_requests(POOL, 3, 8, 100, 4, 0.01, 0.0, seed=4)].count("long") == 1


def test_file_requests(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Once upon a time", "max_tokens": 5}) + "\n\n"
                    + json.dumps({"prompt": [1, 2, 3]}) + "\n")
    reqs = file_requests(str(path), None, default_output_len=9)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [("Once upon a time", None, 5), ([1, 2, 3], 3, 9)]
    assert len(file_requests(str(path), 1, 9)) == 1
    with pytest.raises(ValueError, match="has 2 prompts"):
        file_requests(str(path), 3, 9)
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        file_requests(str(path), None, 9)


def test_token_pool_from_vllm_or_llama_server_style_tokenize():
    def vllm_like(request):
        body = json.loads(request.content)
        return httpx.Response(200, json={"tokens": [5, 3, 5, 9], "count": 4} if "prompt" in body else {})

    def llama_server_like(request):   # ignores `prompt`, tokenizes `content`
        body = json.loads(request.content)
        return httpx.Response(200, json={"tokens": [7, {"id": 8, "piece": "x"}] if "content" in body else []})

    def no_tokenize(request):
        return httpx.Response(404, json={"error": {"message": "not found"}})

    pool = lambda handler: fetch_token_pool("http://s", client=httpx.Client(transport=httpx.MockTransport(handler)))
    assert pool(vllm_like) == [3, 5, 9]
    assert pool(llama_server_like) == [7, 8]
    with pytest.raises(RuntimeError, match="--vocab-size"):
        pool(no_tokenize)


def test_edit_prompts_hold_the_text_the_answer_repeats():
    from pdserve.bench.datasets import EDIT_INSTRUCTION, edit_requests
    reqs = edit_requests(20, output_len=40, seed=3)
    assert len(reqs) == 20 and all(r.output_len == 40 and r.prompt_len is None for r in reqs)
    for r in reqs:
        story, rest = r.prompt.split(f"\n\n{EDIT_INSTRUCTION}\n\n")
        assert story.startswith(rest) and len(story.split()) <= 40 and len(rest) < len(story)
    assert len({r.prompt for r in reqs}) > 5
    assert [r.prompt for r in edit_requests(5, 40, 3)] == [r.prompt for r in reqs[:5]]
