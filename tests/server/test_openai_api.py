"""The OpenAI API of a real server, through the official openai client (and raw SSE where the
client would hide what we check)."""
import concurrent.futures as cf
import json
import os

import httpx
import openai
import pytest

PROMPT = "Once upon a time, a little fox"
MESSAGES = [{"role": "system", "content": "You tell short stories."}, {"role": "user", "content": "Tell me one."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_lists_the_checkpoint_basename(client, server, tiny_llama):
    models = client.models.list().data
    assert [m.id for m in models] == [os.path.basename(tiny_llama)]
    assert models[0].max_model_len == 1024
    assert client.models.retrieve(models[0].id).id == models[0].id


def test_completion_stream_equals_non_stream_and_usage_counts(client, server, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert full.choices[0].text and streamed == full.choices[0].text
    assert full.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    n_prompt = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == n_prompt + 24
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    # the extension field with the request's phase timings
    m = full.choices[0].model_extra["metrics"]
    assert m["ttft_s"] > 0 and m["e2e_s"] >= m["ttft_s"] and m["num_prefill_steps"] >= 1
    assert m["num_preemptions"] == 0 and m["queue_time_s"] >= 0


def test_chat_stream_equals_non_stream_and_usage_counts(client, server, model):
    kw = dict(model=model, messages=MESSAGES, max_completion_tokens=20, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content and streamed == full.choices[0].message.content
    n_prompt = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt
    assert 1 <= full.usage.completion_tokens <= 20
    # the same counts, but the second request found the first's whole blocks in the prefix cache
    # (all but the one holding its last token)
    streamed_usage = chunks[-1].usage
    assert streamed_usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // 16 * 16
    streamed_usage.prompt_tokens_details = full.usage.prompt_tokens_details
    assert streamed_usage == full.usage
    assert "metrics" in full.choices[0].model_extra


def test_chat_without_max_tokens_may_run_to_the_context(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 1024   # the whole context of the tiny model


def test_n_with_seed_gives_different_choices_that_repeat(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, n=2, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert len(texts) == 2 and texts[0] != texts[1]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert a.usage.completion_tokens == 32   # counted over both choices
    unseeded = client.completions.create(**{**kw, "seed": None})
    assert unseeded.choices[0].text != unseeded.choices[1].text
    # choice 1 of seed s is choice 0 of seed s+1
    c = client.completions.create(**{**kw, "n": 1, "seed": 1235})
    assert c.choices[0].text == texts[1]


def test_prompt_forms_and_echo(client, server, model):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    kw = dict(model=model, max_tokens=8, temperature=0)
    by_text = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    assert client.completions.create(prompt=ids, **kw).choices[0].text == by_text
    batch = client.completions.create(prompt=[PROMPT, "The sea was"], **kw)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == by_text
    batch_ids = client.completions.create(prompt=[ids, ids[:3]], **kw)
    assert batch_ids.choices[0].text == by_text
    echoed = client.completions.create(prompt=PROMPT, echo=True, **kw).choices[0].text
    assert echoed == PROMPT + by_text


def test_logprobs(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-4)   # greedy: the sampled token is the top one
    assert "".join(lp.tokens) == r.choices[0].text
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, stream=True) if c.choices[0].logprobs]
    assert sum((c.tokens for c in streamed), []) == lp.tokens
    assert sum((c.token_logprobs for c in streamed), []) == lp.token_logprobs
    assert sum((c.text_offset for c in streamed), []) == lp.text_offset
    # sampled tokens (not the top one) come with their own logprob too
    sampled = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.5, n=2, seed=3,
                                        logprobs=1, extra_body={"ignore_eos": True})
    for choice in sampled.choices:
        assert len(choice.logprobs.token_logprobs) == 8 and all(v <= 0 for v in choice.logprobs.token_logprobs)
    c = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_stop_strings_and_stop_token_ids(client, model):
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[10:13]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[:base.index(stop)]
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == r.choices[0].text


def _solo_and_concurrent(server, model, n):
    prompts = [f"Story {i}: the {['cat', 'dog', 'owl', 'bee'][i % 4]} went" for i in range(n)]
    lengths = [4 + 7 * (i % 5) for i in range(n)]   # mixed: 4 to 32 tokens

    def body(i, stream):
        return {"model": model, "prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0, "stream": stream,
                "ignore_eos": True}
    solo = [httpx.post(server.url + "/v1/completions", json=body(i, False), timeout=60).json()["choices"][0]["text"]
            for i in range(n)]

    def stream(i):
        text, n_chunks = "", 0
        with httpx.stream("POST", server.url + "/v1/completions", json=body(i, True), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
                    n_chunks += 1
        return text, n_chunks
    with cf.ThreadPoolExecutor(n) as pool:
        together = list(pool.map(stream, range(n)))
    return solo, together, lengths


def test_16_concurrent_streams_match_their_solo_outputs_and_share_steps(server, model):
    before = server.metrics()
    solo, together, lengths = _solo_and_concurrent(server, model, 16)
    assert [t for t, _ in together] == solo
    assert all(n >= 1 for _, n in together)
    after = server.metrics()

    def multi_seq_steps(m):   # steps that held more than one sequence
        return m["pdserve:step_num_seqs_count"] - m['pdserve:step_num_seqs_bucket{le="1.0"}']
    assert multi_seq_steps(after) - multi_seq_steps(before) > 0
    assert after["pdserve:generation_tokens_total"] - before["pdserve:generation_tokens_total"] == 2 * sum(lengths)
    assert after['pdserve:request_success_total{finished_reason="length"}'] - \
        before.get('pdserve:request_success_total{finished_reason="length"}', 0) == 32
