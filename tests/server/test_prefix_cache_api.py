"""The prefix cache as clients see it: usage.prompt_tokens_details.cached_tokens, cache_salt, the
prefix_cache_queries / _hits counters and POST /reset_prefix_cache, on a server of its own."""
import argparse

import httpx
import openai
import pytest

from pdserve.engine.args import add_engine_args, engine_kwargs

PROMPT = list(range(300, 340))   # 40 token ids: two whole blocks of 16 can be reused


@pytest.fixture(scope="module")
def srv(start_server, tiny_llama):
    return start_server(tiny_llama, "--block-size", "16")


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def complete(client, prompt, **extra):
    return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=4,
                                     temperature=0, extra_body=extra or None)


def test_cached_tokens_in_usage_counters_and_reset(srv, client):
    before = srv.metrics()
    assert complete(client, PROMPT).usage.prompt_tokens_details.cached_tokens == 0
    again = complete(client, PROMPT + [7, 8])
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].model_extra["metrics"]["num_cached_tokens"] == 32
    # streamed usage says the same
    chunks = list(client.completions.create(model=again.model, prompt=PROMPT + [9], max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    m = srv.wait_for(lambda m: m["pdserve:prefix_cache_queries_total"] - before.get(
        "pdserve:prefix_cache_queries_total", 0) >= 40 + 42 + 41)
    assert m["pdserve:prefix_cache_queries_total"] - before.get("pdserve:prefix_cache_queries_total", 0) == 123
    assert m["pdserve:prefix_cache_hits_total"] - before.get("pdserve:prefix_cache_hits_total", 0) == 64
    r = httpx.post(srv.url + "/reset_prefix_cache", json={})
    assert r.status_code == 200 and r.json()["reset_blocks"] >= 2 and r.json()["cached_blocks_in_use"] == 0
    assert complete(client, PROMPT + [7, 8]).usage.prompt_tokens_details.cached_tokens == 0


def test_cache_salt_isolates_and_is_checked(srv, client):
    prompt = list(range(500, 540))
    complete(client, prompt, cache_salt="tenant-a")
    assert complete(client, prompt, cache_salt="tenant-b").usage.prompt_tokens_details.cached_tokens == 0
    assert complete(client, prompt).usage.prompt_tokens_details.cached_tokens == 0
    assert complete(client, prompt, cache_salt="tenant-a").usage.prompt_tokens_details.cached_tokens == 32
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, prompt, cache_salt="")
    assert e.value.body["param"] == "cache_salt"


def test_a_chat_history_is_reused_turn_after_turn(client):
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "You answer in one short sentence, always politely and kindly."},
                {"role": "user", "content": "What day comes after Friday? Please tell me."}]
    first = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And after that?"}]
    second = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (first.usage.prompt_tokens // 16) * 16 - 16 and cached % 16 == 0 and cached > 0


def test_prefix_caching_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["enable_prefix_caching"] is True
    assert engine_kwargs(parser.parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False
