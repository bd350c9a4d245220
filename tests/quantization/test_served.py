"""A GPTQ int4 checkpoint served end to end (`pdserve serve`, the official openai client): the
completion is transformers' greedy continuation on the dequantized weights, and the log names the
quantization."""
import openai
import pytest

from tests.helpers import corpus_prompts, hf_logits
from tools import quantize_hub as formats
from tests.server.conftest import Server

from pdserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def gptq(make_tiny, tmp_path_factory):
    base = make_tiny("qwen2", hidden_size=128, intermediate_size=256)
    dst = str(tmp_path_factory.mktemp("served") / "gptq-int4")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    formats.quantize_checkpoint(base, dst, qc, lambda m, w: formats.rtn(w, 4, 32, True), formats.gptq_tensors)
    return dst


def test_openai_client_gets_the_greedy_tokens_of_the_dequantized_model(gptq, tmp_path):
    server = Server(gptq, "--dtype", "float32", log_dir=str(tmp_path))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        prompt = corpus_prompts(Tokenizer.from_dir(gptq), lens=[24])[0]
        out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=10,
                                        temperature=0, extra_body={"ignore_eos": True})
        ref = []
        for _ in range(10):   # transformers' greedy tokens on W_dq, past any EOS as ignore_eos
            ref.append(int(hf_logits(gptq + "-dq", prompt + ref)[-1].argmax()))
        assert out.usage.completion_tokens == 10
        assert out.choices[0].text == Tokenizer.from_dir(gptq).decode(ref)
        assert "gptq (int4 group 32 sym): 14 linears in the group form" in server.log()
    finally:
        server.stop()
