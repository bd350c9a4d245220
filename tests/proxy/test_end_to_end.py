"""The proxy over real workers: a prefill and a decode engine served in this process (their KV
moved over TCP), against a colocated engine; greedy answers through the proxy are the colocated
engine's, token for token, for completions and chat, streamed and not."""
import openai
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.entrypoints import proxy as launch
from tests.kv_transfer.pd import SECRET
from tests.proxy.conftest import Served, proxy_args
from tests.server.conftest import metrics
from tests.server.inprocess import serve

ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8)
PROMPT = "Once upon a time there was a little robot who lived in a lighthouse by the sea, and every night"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def servers(request, make_tiny):
    """(colocated URL, proxy URL, decode worker URL) over one tiny checkpoint."""
    path = make_tiny(request.param)
    with serve(LLMEngine(path, **ENGINE)) as both, \
            serve(LLMEngine(path, role="prefill", kv_transfer_secret=SECRET, **ENGINE)) as pre, \
            serve(LLMEngine(path, role="decode", kv_transfer_secret=SECRET, **ENGINE)) as dec:
        app, _ = launch.build(proxy_args([pre], [dec]))
        proxy = Served(app)
        yield both, proxy.url, dec
        proxy.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def completion(url: str, stream: bool, **kw) -> tuple[str, list[str] | None, int]:
    c = client(url)
    if stream:
        chunks = list(c.completions.create(model="tiny", stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        tokens = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
        return text, tokens, chunks[-1].usage.completion_tokens
    r = c.completions.create(model="tiny", **kw)
    return r.choices[0].text, r.choices[0].logprobs.tokens, r.usage.completion_tokens


def chat(url: str, stream: bool, **kw) -> tuple[str, list[str], int]:
    c = client(url)
    if stream:
        chunks = list(c.chat.completions.create(model="tiny", stream=True, stream_options={"include_usage": True},
                                                **kw))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        tokens = [t.token for ch in chunks if ch.choices and ch.choices[0].logprobs
                  for t in ch.choices[0].logprobs.content]
        return text, tokens, chunks[-1].usage.completion_tokens
    r = c.chat.completions.create(model="tiny", **kw)
    return r.choices[0].message.content, [t.token for t in r.choices[0].logprobs.content], r.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_completions_through_the_proxy_equal_colocated(servers, stream):
    both, proxy, dec = servers
    before = metrics(dec).get("pdserve:kv_transfers_total", 0)
    kw = dict(prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    ref = completion(both, stream, **kw)
    assert ref[2] == 12 and len(ref[1]) == 12
    assert completion(proxy, stream, **kw) == ref
    assert metrics(dec)["pdserve:kv_transfers_total"] == before + 1   # the decode worker pulled the KV


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_the_proxy_equals_colocated(servers, stream):
    both, proxy, dec = servers
    before = metrics(dec).get("pdserve:kv_transfers_total", 0)
    kw = dict(messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=10, temperature=0, logprobs=True,
              extra_body={"ignore_eos": True})
    ref = chat(both, stream, **kw)
    assert ref[2] == 10 and len(ref[1]) == 10
    assert chat(proxy, stream, **kw) == ref
    assert metrics(dec)["pdserve:kv_transfers_total"] == before + 1


def test_a_bad_request_gets_the_workers_400(servers):
    _, proxy, _ = servers
    with pytest.raises(openai.BadRequestError) as e:
        client(proxy).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature"
