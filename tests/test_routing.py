"""The router's choices, as a plain class (no Ray, no HTTP): pdserve/routing.py; and the prompt
it hashes is the one the engine gets."""
import json
import os
import shutil

import httpx
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.routing import PromptHasher, Router, prompt_block_hashes
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer
from tests.helpers import finish_all
from tests.server.harmony_model import ASK_WEATHER, harmony_model  # noqa: F401 (a fixture)
from tests.server.harmony_model import TOOLS as HARMONY_TOOLS
from tests.server.inprocess import serve
from tests.server.test_tool_calls import TEMPLATE, TOOLS

BS = 4


def hashes(tokens):
    return prompt_block_hashes(tokens, BS)


def test_block_hashes_chain_and_leave_out_the_last_token():
    a = list(range(13))   # 3 full blocks before the last token
    assert len(hashes(a)) == 3 and len(hashes(a[:12])) == 2   # 12 tokens: the 3rd block holds the last one
    b = [99] + a[1:]
    assert all(x != y for x, y in zip(hashes(a), hashes(b)))   # a change in block 0 changes every later hash
    c = a[:8] + [99] + a[9:]
    assert hashes(c)[:2] == hashes(a)[:2] and hashes(c)[2] != hashes(a)[2]
    assert prompt_block_hashes(a, BS, "salt")[0] != hashes(a)[0]   # cache_salt isolates, as in the engine


def test_prefix_aware_goes_where_the_longest_prefix_was_sent():
    r = Router("prefix-aware")
    system = list(range(100, 132))
    r.record("a", hashes(system + [1, 2, 3]))
    r.record("b", hashes(system[:8] + [7] * 30))
    r.sent("a"), r.sent("a")   # a is busier, but within max_imbalance
    assert r.choose(["a", "b"], hashes(system + [5, 6, 7, 8, 9])) == ("a", 8)
    assert r.choose(["a", "b"], hashes(system[:8] + [7] * 10)) == ("b", 4)


def test_no_match_or_a_short_one_goes_to_the_least_loaded():
    r = Router("prefix-aware", min_match_blocks=3)
    r.record("a", hashes(list(range(40))))
    r.sent("a")
    assert r.choose(["a", "b"], hashes([9] * 40))[0] == "b"            # nobody holds it
    assert r.choose(["a", "b"], hashes(list(range(8)) + [9] * 30))[0] == "b"   # 2 blocks < 3
    assert r.choose(["a", "b"], hashes(list(range(40)) + [1]))[0] == "a"


def test_too_busy_a_match_loses_to_the_least_loaded():
    r = Router("prefix-aware", max_imbalance=2)
    prompt = hashes(list(range(40)))
    r.record("a", prompt)
    for _ in range(3):
        r.sent("a")
    assert r.choose(["a", "b"], prompt)[0] == "b"
    r.completed("a")
    assert r.choose(["a", "b"], prompt)[0] == "a"   # 2 more in flight is within the bound


def test_new_prefixes_spread_over_idle_replicas():
    r = Router("prefix-aware")
    first, _ = r.choose(["a", "b"], hashes([1] * 20))
    r.record(first, hashes([1] * 20))
    second, _ = r.choose(["a", "b"], hashes([2] * 20))
    assert {first, second} == {"a", "b"}


def test_ties_go_round_in_turn():
    r = Router("least-loaded")
    assert [r.choose(["a", "b"])[0] for _ in range(4)] == ["a", "b", "a", "b"]
    r = Router("prefix-aware")   # prompts shorter than a block: nothing to match or to hold
    assert {r.choose(["a", "b"], hashes([1, 2]))[0] for _ in range(2)} == {"a", "b"}


def test_what_a_replica_holds_is_bounded_by_its_kv_cache():
    r = Router("prefix-aware")
    old, new = hashes(list(range(20))), hashes(list(range(50, 70)))
    r.record("a", old, capacity_blocks=6)
    r.record("a", new, capacity_blocks=6)   # 4 + 4 blocks: the 2 least recent of `old` are gone
    assert r.matched_blocks("a", new) == 4 and r.matched_blocks("a", old) == 0


def test_round_robin_and_least_loaded():
    r = Router("round-robin")
    assert [r.choose(["a", "b", "c"])[0] for _ in range(4)] == ["a", "b", "c", "a"]
    r = Router("least-loaded")
    r.sent("a"), r.sent("b"), r.sent("a")
    assert r.choose(["a", "b", "c"])[0] == "c"
    r.sent("c"), r.sent("c")
    assert r.choose(["a", "b", "c"])[0] == "b"


def test_a_removed_replica_is_forgotten():
    r = Router("prefix-aware")
    r.record("a", hashes(list(range(20))))
    r.keep_only({"b"})
    assert r.choose(["b"], hashes(list(range(20)))) == ("b", 0) and "a" not in r.held


def test_bad_policy_and_no_replicas_are_refused():
    with pytest.raises(ValueError, match="routing policy"):
        Router("random")
    with pytest.raises(ValueError, match="no replicas"):
        Router().choose([], [])


def test_the_router_counts_the_blocks_the_engine_finds_cached(tiny_llama):
    """What the router believes a replica holds is what the engine's prefix cache serves."""
    engine = LLMEngine(tiny_llama, block_size=BS, max_model_len=128, num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    first = list(range(10, 40))
    engine.add_request("first", first, greedy)
    finish_all(engine)
    r = Router("prefix-aware")
    r.record("engine", hashes(first))
    seen = []
    for i, prompt in enumerate([first[:17] + [5] * 9, first + [6, 7], first[:3] + [8] * 20]):
        engine.add_request(f"r{i}", prompt, greedy)
        cached = finish_all(engine)[f"r{i}"].num_cached_tokens
        assert cached == r.matched_blocks("engine", hashes(prompt)) * BS
        seen.append(cached)
    assert seen == [16, 28, 0]


@pytest.fixture(scope="module")
def tool_model(tiny_qwen2, tmp_path_factory):
    """tiny qwen2 with a template that renders a tool call's arguments with tojson: an object and
    the string a client sends for it render differently."""
    path = str(tmp_path_factory.mktemp("tools") / "tiny-tools")
    shutil.copytree(tiny_qwen2, path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return path


def test_a_chat_with_tool_calls_is_hashed_over_the_prompt_the_engine_gets(tool_model):
    engine = LLMEngine(tool_model, block_size=BS, max_model_len=1024, num_kv_blocks=300)
    prompts, add = [], engine.add_request

    def spy(request_id, prompt, params, arrival_time=None):   # what the engine is given
        prompts.append(list(prompt))
        return add(request_id, prompt, params, arrival_time=arrival_time)
    engine.add_request = spy
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    body = {"model": "tiny", "tools": TOOLS, "max_tokens": 1, "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "user", "content": "And tomorrow?"}]}
    with serve(engine, tool_call_parser="hermes") as url:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    hashes = PromptHasher(Tokenizer.from_dir(tool_model), BS)("/v1/chat/completions", body)
    assert len(prompts) == 1 and len(hashes) == (len(prompts[0]) - 1) // BS > 10
    assert hashes == prompt_block_hashes(prompts[0], BS)


def test_a_harmony_chat_is_hashed_over_harmonys_rendering(harmony_model):
    # --reasoning-parser gpt_oss: the server renders chats with harmony, not the chat template
    engine = LLMEngine(harmony_model, block_size=BS, num_kv_blocks=300)
    prompts, add = [], engine.add_request

    def spy(request_id, prompt, params, arrival_time=None):
        prompts.append(list(prompt))
        return add(request_id, prompt, params, arrival_time=arrival_time)
    engine.add_request = spy
    body = {"model": "tiny", "max_tokens": 1, "reasoning_effort": "high", "tools": HARMONY_TOOLS,
            "messages": [{"role": "system", "content": "Be brief."}, *ASK_WEATHER]}
    with serve(engine, reasoning_parser="gpt_oss") as url:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    tokenizer = Tokenizer.from_dir(harmony_model)
    hashes = PromptHasher(tokenizer, BS, "gpt_oss")("/v1/chat/completions", body)
    assert len(prompts) == 1 and len(hashes) == (len(prompts[0]) - 1) // BS > 10
    assert hashes == prompt_block_hashes(prompts[0], BS)
    assert PromptHasher(tokenizer, BS)("/v1/chat/completions", body) != hashes   # the template's rendering differs


def test_a_body_the_router_cannot_read_has_no_hashes(tiny_llama):
    hasher = PromptHasher(Tokenizer.from_dir(tiny_llama), BS)
    assert hasher("/v1/completions", {"prompt": "a b c d e f g h i j k l"})
    for path, body in [("/v1/completions", {}), ("/v1/chat/completions", {"messages": "not a list"}),
                       ("/v1/models", {"prompt": "a b c d e f g h i j k l"})]:
        assert hasher(path, body) == []
