"""`pdserve serve model.gguf` end to end with the openai client: the chat is rendered with the
GGUF's own template and stops at its end-of-turn token."""
import os

import pytest

from tests.server.conftest import Server


@pytest.fixture
def gguf_server(make_gguf, tmp_path):
    model_dir, gguf = make_gguf("qwen2", "q8_0")
    server = Server(gguf, "--num-kv-blocks", "64", log_dir=str(tmp_path))
    yield server, model_dir, gguf
    server.stop()


def test_serve_a_gguf_file_and_chat(gguf_server):
    from openai import OpenAI

    from pdserve import LLM, SamplingParams
    server, model_dir, gguf = gguf_server
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    [model] = [m.id for m in client.models.list().data]
    assert model == os.path.basename(gguf)
    messages = [{"role": "user", "content": "Tell me a story about a dog."}]
    r = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12, temperature=0)
    # the same prompt rendered by the HF checkpoint's template, greedily, offline on the same file
    from pdserve.tokenizer import Tokenizer
    prompt = Tokenizer.from_dir(model_dir).encode_chat(messages)
    assert r.usage.prompt_tokens == len(prompt)
    want = LLM(gguf, dtype="float32").generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
