"""--quantization int8 on a mixture of experts: the experts become int8 codes, one scale per output
channel (CpuFusedMoE.quantize_int8, on kernels/moe_cpu.cpp), as the linears do, and greedy tokens
equal the torch path's on the same round-to-nearest weights (dequantized), logprobs within fp32
tolerance; on each kernel build."""
import pytest

from pdserve import LLM
from pdserve.backends.cpu.layers import CpuFusedMoE
from pdserve.backends.cpu.quant_linear import round_to_nearest
from tests.backends.cpu.test_quantized_model import _load_with, assert_close, generate
from tests.helpers import corpus_prompts

pytestmark = pytest.mark.usefixtures("cpu_isa")


def test_int8_experts_equal_torch_on_the_same_int8_weights(make_tiny, monkeypatch):
    path = make_tiny("qwen3_moe")
    llm = LLM(path, quantization="int8", max_num_batched_tokens=48)
    backend, model = llm.engine.runner.backend, llm.engine.runner.model
    moes = [m for m in model.modules() if isinstance(m, CpuFusedMoE)]
    assert moes and all(m.int8 and not hasattr(m, "gate_up_proj") for m in moes)
    assert {m.gate_up_proj_scale.shape[-1] for m in moes} == {1}   # per output channel
    assert "w8 per-channel experts" in backend.describe()
    prompts = corpus_prompts(llm.tokenizer, lens=[5, 30, 61, 1])
    got = generate(llm, prompts)
    head = "model.embed_tokens.weight" if llm.engine.model_config.tie_word_embeddings else "lm_head.weight"

    def rtn(name, t):   # every linear and expert projection per output channel; the router stays
        if name.endswith("_proj.weight") or name == head:
            return round_to_nearest(t, 8, t.shape[1]).dequantize()
        return t

    _load_with(monkeypatch, rtn)
    ref = generate(LLM(path, cpu_kernels=False, max_num_batched_tokens=48), prompts)
    assert_close(got, ref)
