"""gpt-oss (GptOssForCausalLM) generates exactly what transformers generates (fp32 greedy; logits
to 1e-4) from tiny checkpoints with dense experts and with MXFP4 experts as the Hub ships them
(transformers dequantizes those on the CPU; pdserve keeps the blocks and scales), on prompts longer
than its sliding window, on torch's ops and on the CPU kernels (each build this CPU runs, layer by
layer: sinks in the attention kernels, biases, clamp and MXFP4 in the fused-MoE kernel), with
chunked prefill, the prefix cache, preemption and n-gram speculation."""
import functools

import pytest
import torch
import transformers

from pdserve import LLM
from pdserve.layers.attention import PagedAttention
from pdserve.layers.moe import FusedMoE
from tests.helpers import (PROMPT_LENS, assert_decode_equals_recompute, assert_greedy_batch_equals_transformers,
                           assert_last_position_logits_match,
                           assert_outputs_survive_cache_preemption_and_speculation, hf_greedy, hf_model)

NEW_TOKENS = 12
MOE_DECODE_ATOL = 5e-4   # as the other MoE families (tests/models/test_moe.py)


@pytest.fixture(scope="module", params=["dense", "mxfp4"])
def model_path(request, make_tiny):
    return make_tiny("gpt_oss", mxfp4=request.param == "mxfp4")


@pytest.fixture(scope="module")
def llm(model_path, cpu_kernels):
    llm = LLM(model_path, max_num_batched_tokens=64, max_num_seqs=16, cpu_kernels=cpu_kernels)
    backend = llm.engine.runner.backend
    assert backend.name == ("cpu" if cpu_kernels else "torch")
    if cpu_kernels:
        assert backend.stack is None and "mixture-of-experts" in backend.why_no_stack
        assert "attention kernels" in backend.describe()
    return llm


@functools.lru_cache(maxsize=None)
def reference(path: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(path, list(prompt), NEW_TOKENS)


def test_tiny_checkpoints_have_the_parts_under_test(model_path, llm):
    """Windows shorter than the prompts, alternating with full layers; YaRN; sinks; biased router
    and experts; MXFP4 experts kept as uint8 blocks and scales (no dense copy of them)."""
    hf = transformers.AutoConfig.from_pretrained(model_path)
    assert hf.layer_types == ["sliding_attention", "full_attention"] and hf.sliding_window * 4 < max(PROMPT_LENS)
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.num_experts_per_tok == 2
    model = llm.engine.runner.model
    windows = [m.sliding_window for m in model.modules() if isinstance(m, PagedAttention)]
    assert windows == [hf.sliding_window, None]
    assert all(m.sinks is not None and m.sinks.abs().sum() > 0 for m in model.modules() if isinstance(m, PagedAttention))
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    mxfp4 = getattr(hf, "quantization_config", None) is not None
    assert all(m.mxfp4 == mxfp4 and m.gate_up_proj_bias is not None for m in experts)
    if mxfp4:
        assert not any(n.endswith(("gate_up_proj", "down_proj")) for n, _ in model.named_parameters())
        assert all(m.gate_up_proj_blocks.dtype == torch.uint8 for m in experts)


def test_experts_load_as_transformers_holds_them(model_path):
    """The loader's transpose and gate-first reorder (and MXFP4 decode) give transformers' experts."""
    llm = LLM(model_path, cpu_kernels=False)
    ours = next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE))
    theirs = hf_model(model_path).model.layers[0].mlp.experts
    I = ours.intermediate_size
    for e in (0, 5):
        w13, w2 = ours.expert(e, torch.float32)
        hf13 = theirs.gate_up_proj[e].T   # (2I, H), gate and up rows interleaved
        assert torch.equal(w13[:I], hf13[0::2]) and torch.equal(w13[I:], hf13[1::2])
        assert torch.equal(w2, theirs.down_proj[e].T)
        assert torch.equal(ours.gate_up_proj_bias[e][:I], theirs.gate_up_proj_bias[e][0::2])


def test_greedy_batch_equals_transformers(llm, model_path):
    assert_greedy_batch_equals_transformers(llm, model_path, reference, NEW_TOKENS)


def test_last_position_logits_match(llm, model_path):
    assert_last_position_logits_match(llm, model_path)


def test_decode_with_cache_equals_recompute(llm, model_path):
    assert_decode_equals_recompute(llm, model_path, prompt_len=60, atol=MOE_DECODE_ATOL)


def test_prefix_cache_preemption_and_speculation_keep_outputs(model_path, cpu_kernels):
    assert_outputs_survive_cache_preemption_and_speculation(model_path, cpu_kernels, reference, NEW_TOKENS)
