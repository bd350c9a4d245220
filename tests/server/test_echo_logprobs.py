"""Prompt logprobs over the API, through the official openai client: completions' echo with
logprobs (and max_tokens 0), vLLM's prompt_logprobs on completions and chat, streamed echo, and
the limits. Values are transformers' log_softmax of the whole prompt (fp32, 1e-4)."""
import httpx
import openai
import pytest
import torch

from tests.helpers import hf_logits

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."


@pytest.fixture(scope="module")
def server(start_server, tiny_llama):
    # a small step budget: the prompts are prefilled in several chunks
    return start_server(tiny_llama, "--dtype", "float32", "--max-num-batched-tokens", "8",
                        "--max-request-cost", "3000")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def ids(server):
    return httpx.post(server.url + "/tokenize", json={"prompt": TEXT}).json()["tokens"]


@pytest.fixture(scope="module")
def ref(tiny_llama, ids):
    """ref[i - 1, t]: transformers' logprob of token t at prompt position i."""
    return torch.log_softmax(hf_logits(tiny_llama, ids), dim=-1)


def detok(server, tid: int) -> str:
    return httpx.post(server.url + "/detokenize", json={"tokens": [tid]}).json()["prompt"]


def test_echo_with_max_tokens_0_scores_the_prompt(client, server, model, ids, ref):
    """lm-evaluation-harness's and perplexity's request: the prompt's tokens with their logprobs,
    the first null, nothing generated."""
    r = client.completions.create(model=model, prompt=TEXT, echo=True, logprobs=3, max_tokens=0)
    c = r.choices[0]
    assert c.text == TEXT and c.finish_reason == "length"
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-4, f"position {i}"
        best = ref[i - 1].max().item()
        assert 1 <= len(lp.top_logprobs[i]) <= 3 and abs(max(lp.top_logprobs[i].values()) - best) < 1e-4
    # text_offset: where each token's text starts in the concatenated token texts
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert lp.tokens[1] == detok(server, ids[1])
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    # the one token the server runs and drops neither shows nor ends it, even when it would stop
    stop_id = int(ref[-1].argmax())   # the greedy next token
    r = client.completions.create(model=model, prompt=TEXT, echo=True, logprobs=0, max_tokens=0, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].text == TEXT and r.choices[0].finish_reason == "length"
    assert r.choices[0].model_extra["stop_reason"] is None


def test_echo_with_a_completion_puts_the_prompt_first(client, model, ids, ref):
    kw = dict(model=model, prompt=TEXT, logprobs=2, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(**kw, echo=True).choices[0]
    assert echoed.text == TEXT + plain.text
    lp = echoed.logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 4 and lp.tokens[n:] == plain.logprobs.tokens
    assert lp.token_logprobs[n:] == plain.logprobs.token_logprobs
    assert lp.text_offset[n] == sum(len(t) for t in lp.tokens[:n])
    assert abs(lp.token_logprobs[n - 1] - ref[n - 2, ids[n - 1]].item()) < 1e-4


def check_vllm_shape(entries, ids, ref, k):
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        e = entries[i]
        own = e[str(ids[i])]
        assert abs(own["logprob"] - ref[i - 1, ids[i]].item()) < 1e-4
        assert own["rank"] == (ref[i - 1] > ref[i - 1, ids[i]]).sum().item() + 1
        ranks = sorted(v["rank"] for t, v in e.items() if v["rank"] <= k)
        assert ranks == list(range(1, k + 1)) and isinstance(own["decoded_token"], str)
        vals = sorted((v["logprob"] for v in e.values() if v["rank"] <= k), reverse=True)
        torch.testing.assert_close(torch.tensor(vals), ref[i - 1].topk(k).values, atol=1e-4, rtol=0)


def test_prompt_logprobs_field_on_completions_and_chat(client, model, ids, ref):
    r = client.completions.create(model=model, prompt=TEXT, max_tokens=2, extra_body={"prompt_logprobs": 2})
    check_vllm_shape(r.choices[0].model_extra["prompt_logprobs"], ids, ref, 2)
    assert r.choices[0].logprobs is None
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": TEXT}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 1})
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None
    assert all(len(e) in (1, 2) for e in entries[1:])


def test_streamed_echo_carries_the_prompt_logprobs_in_its_first_chunk(client, model, ids):
    kw = dict(model=model, prompt=TEXT, echo=True, logprobs=1, temperature=0)
    for max_tokens in (0, 3):
        full = client.completions.create(**kw, max_tokens=max_tokens).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(**kw, max_tokens=max_tokens, stream=True)
                  if c.choices]
        assert chunks[0].text.startswith(TEXT) and chunks[0].logprobs.token_logprobs[0] is None
        assert "".join(c.text for c in chunks) == full.text
        streamed = [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs]
        assert streamed == full.logprobs.token_logprobs
        offsets = [t for c in chunks if c.logprobs for t in c.logprobs.text_offset]
        assert offsets == full.logprobs.text_offset
        assert chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"prompt": TEXT, "echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
    ({"prompt": TEXT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": TEXT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": TEXT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": TEXT, "max_tokens": 0}, "max_tokens"),
    # 3000 (--max-request-cost) < prompt tokens x (1 + 20)
    ({"prompt": TEXT * 8, "echo": True, "logprobs": 20, "max_tokens": 0}, "logprobs"),
    ({"prompt": TEXT * 8, "prompt_logprobs": 20, "max_tokens": 1}, "prompt_logprobs"),
])
def test_prompt_logprobs_are_bounded_like_logprobs(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


def test_chat_prompt_logprobs_count_towards_the_request_cost(server):
    chat = {"messages": [{"role": "user", "content": TEXT * 8}], "prompt_logprobs": 20}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    # without a max_tokens, the default (the rest of the context) is lowered to leave room for them:
    # ~110 prompt tokens x 21 + the rest of the 1024 would be over 3000
    chat = {"messages": [{"role": "user", "content": TEXT * 3}], "prompt_logprobs": 20, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    used = body["usage"]["prompt_tokens"] * 21 + body["usage"]["completion_tokens"]
    assert body["usage"]["total_tokens"] < 1024 < body["usage"]["prompt_tokens"] * 21 + 1024
    assert used <= 3000 and body["choices"][0]["finish_reason"] == "length"
