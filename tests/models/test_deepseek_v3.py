"""DeepSeek-V3 (multi-head latent attention, grouped sigmoid MoE) generates exactly what transformers
generates (fp32 greedy; logits to 1e-4), with q through its low-rank latent and without one
(q_lora_rank null), on torch's ops and on the CPU kernels (each build this CPU runs: the linears
and experts on the kernels, MLA and the rest layer by layer), with chunked prefill, the prefix
cache, preemption and n-gram speculation. The paged cache holds kv_lora_rank + qk_rope_head_dim
values per token and layer, and decode reads it in the absorbed form."""
import functools
import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.config_fields import CONFIG_FIELDS
from pdserve.errors import CheckpointError
from pdserve.layers import mla
from pdserve.layers.moe import SparseMoeBlock
from pdserve.models.deepseek_v3 import DeepseekV3ForCausalLM, mla_shape, softmax_scale
from tests.helpers import (assert_decode_equals_recompute, assert_greedy_batch_equals_transformers,
                           assert_last_position_logits_match, assert_outputs_survive_cache_preemption_and_speculation,
                           chunked_logits, corpus_prompts, hf_greedy, hf_logits)

NEW_TOKENS = 12
# make_model's tiny checkpoint (tools/make_model.py): 3 layers, layer 0 dense; latents of 32, rope
# keys of 16; q through a rank-32 latent, or (q_lora_rank null) straight from the hidden state
VARIANTS = {"q_lora": {}, "q_proj": {"q_lora_rank": None}}
LATENT = 32 + 16   # kv_lora_rank + qk_rope_head_dim


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_path(request, make_tiny):
    return make_tiny("deepseek_v3", **VARIANTS[request.param])


@pytest.fixture(scope="module")
def llm(model_path, cpu_kernels):
    # small budget: the longer prompts are prefilled in chunks while the short ones decode
    llm = LLM(model_path, max_num_batched_tokens=64, max_num_seqs=16, cpu_kernels=cpu_kernels)
    backend = llm.engine.runner.backend
    assert backend.name == ("cpu" if cpu_kernels else "torch")
    if cpu_kernels:   # the stack has no MLA or MoE part: layer by layer, and the log line says why
        assert backend.stack is None and "latent attention" in backend.why_no_stack
        assert backend.weight_format == "fp32" and "packed linears" in backend.describe()
    return llm


@functools.lru_cache(maxsize=None)
def reference(path: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(path, list(prompt), NEW_TOKENS)


def test_tiny_checkpoint_has_the_parts_under_test(model_path):
    """A dense layer before the MoE ones, grouped routing with a router bias, interleaved yarn RoPE
    whose mscale_all_dim changes the softmax scale, v heads unlike q/k heads."""
    hf = transformers.AutoConfig.from_pretrained(model_path)
    assert hf.first_k_dense_replace == 1 and hf.num_hidden_layers == 3
    assert (hf.n_routed_experts, hf.num_experts_per_tok, hf.n_group, hf.topk_group) == (8, 2, 4, 2)
    assert hf.rope_interleave and hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["mscale_all_dim"]
    assert hf.v_head_dim != hf.qk_nope_head_dim + hf.qk_rope_head_dim
    assert load_file(os.path.join(model_path, "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path)
    cfg = ModelConfig.from_dir(model_path)
    for layer in model.model.layers:
        assert softmax_scale(cfg, mla_shape(cfg)) == layer.self_attn.scaling != mla_shape(cfg).qk_head_dim ** -0.5
    assert (hf.q_lora_rank is None) == (model.model.layers[0].self_attn.q_proj is not None)


def test_greedy_batch_equals_transformers(llm, model_path):
    assert_greedy_batch_equals_transformers(llm, model_path, reference, NEW_TOKENS)


# The kernels' linears sum in another order than torch's: measured up to 1.05e-4 on logits of ~40
# (the AVX2 build, q_proj checkpoint; torch's ops give transformers' logits exactly)
KERNEL_LOGITS_ATOL = 2e-4


def test_last_position_logits_match(llm, model_path, cpu_kernels):
    assert_last_position_logits_match(llm, model_path, atol=KERNEL_LOGITS_ATOL if cpu_kernels else 1e-4)


# Decode's matrix-vector products (and its absorbed attention: q_nope through W_UK, the latent
# output through W_UV) round otherwise than transformers' full forward: measured up to 4.9e-4 on
# torch's ops and 2.3e-4 on the kernels (logits up to ~40), as the other MoE families (test_moe.py).
MLA_DECODE_ATOL = 1e-3


def test_decode_with_cache_equals_recompute(llm, model_path):
    """Each decode step's logits (one token against the latent cache, the absorbed form) equal a
    full forward without a cache."""
    assert_decode_equals_recompute(llm, model_path, prompt_len=60, atol=MLA_DECODE_ATOL)


def test_prefix_cache_preemption_and_speculation_keep_outputs(model_path, cpu_kernels):
    assert_outputs_survive_cache_preemption_and_speculation(model_path, cpu_kernels, reference, NEW_TOKENS)


# ---------------------------------------------------------------- the latent cache

def test_the_cache_holds_the_latent_and_the_rope_key_per_token(make_tiny):
    """kv_lora_rank + qk_rope_head_dim values per token and layer, in one plane: a memory budget
    holds budget / (block_size x layers x 48 values x 4 bytes) blocks (full K/V, 2 x 4 heads x 32
    values, would hold 16/3 times fewer), and the scheduler admits by those blocks."""
    path = make_tiny("deepseek_v3")
    L, bs, budget = 3, 16, 1 << 20
    llm = LLM(path, cpu_kernels=False, kv_cache_memory=budget, block_size=bs)
    runner = llm.engine.runner
    assert runner.kv_cache.shape == (1, L, runner.num_blocks * bs, 1, LATENT)
    assert runner.bytes_per_block == bs * L * LATENT * 4
    assert llm.engine.block_manager.num_blocks == budget // (bs * L * LATENT * 4) == 113
    for layer in llm.engine.runner.model.model.layers:
        assert layer.self_attn.latent_cache.shape == (runner.num_blocks * bs, 1, LATENT)


def test_decode_reads_only_the_latents(model_path):
    """The absorbed form: decodes never expand per-head K/V (kv_b's product runs for the prefill
    chunks only), and the tokens are transformers'."""
    llm = LLM(model_path, cpu_kernels=False, max_num_batched_tokens=64)
    expanded_rows = []
    real = mla.MultiHeadLatentAttention._expanded

    def counting(self, qn, qp, latents, mask):
        expanded_rows.append(qn.shape[1])
        return real(self, qn, qp, latents, mask)
    mla.MultiHeadLatentAttention._expanded = counting
    try:
        prompt = corpus_prompts(llm.tokenizer, lens=[40])[0]
        out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))[0]
    finally:
        mla.MultiHeadLatentAttention._expanded = real
    assert out.token_ids == reference(model_path, tuple(prompt))
    assert expanded_rows and min(expanded_rows) > 1   # prefill chunks only, in every layer
    assert len(expanded_rows) == 3   # one 40-token chunk, three layers


def test_absorbed_decode_equals_expanded_attention(model_path):
    """The absorbed form and per-head K/V give the same decode logits (to fp32 rounding: measured
    1.5e-4 apart on logits of ~40)."""
    llm = LLM(model_path, cpu_kernels=False)
    prompt = corpus_prompts(llm.tokenizer, lens=[50])[0]
    absorbed = chunked_logits(llm.engine, prompt, chunk=1)
    real = mla.MultiHeadLatentAttention._absorbed
    mla.MultiHeadLatentAttention._absorbed = lambda self, qn, qp, latents, w, mask: self._expanded(qn, qp, latents, mask)
    try:
        expanded = chunked_logits(llm.engine, prompt, chunk=1)
    finally:
        mla.MultiHeadLatentAttention._absorbed = real
    torch.testing.assert_close(absorbed, expanded, atol=5e-4, rtol=0)   # measured 1.5e-4 (logits ~40)
    torch.testing.assert_close(expanded, hf_logits(model_path, prompt), atol=MLA_DECODE_ATOL, rtol=0)


# ---------------------------------------------------------------- config.json, as transformers reads it

def test_layers_and_routing_are_transformers():
    """Dense and MoE layers, routing switches and MLA sizes from a config.json as the Hub ships it
    (DeepSeek-V3's defaults, fewer layers) equal transformers' modules."""
    raw = dict(architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=4, first_k_dense_replace=2,
               hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_attention_heads=4,
               q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
               vocab_size=64)
    hf = transformers.DeepseekV3Config(**raw)
    with torch.device("meta"):
        ours = DeepseekV3ForCausalLM(ModelConfig("/ckpt", "DeepseekV3ForCausalLM",
                                                 **CONFIG_FIELDS["DeepseekV3ForCausalLM"](raw), torch_dtype=None,
                                                 raw=json.loads(json.dumps(raw))))
        theirs = transformers.DeepseekV3ForCausalLM(hf)
    ours_sd = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    for layer, hf_layer in zip(ours.model.layers, theirs.model.layers):
        assert isinstance(layer.mlp, SparseMoeBlock) == hasattr(hf_layer.mlp, "experts")
        if isinstance(layer.mlp, SparseMoeBlock):
            r, g = layer.mlp.gate.routing, hf_layer.mlp.gate
            assert (r.num_experts, r.top_k, r.n_group, r.topk_group, r.routed_scaling_factor, r.renormalize) == (
                g.num_experts, g.top_k, g.num_group, g.topk_group, g.routed_scaling_factor, g.norm_topk_prob)
            assert r.scoring == "sigmoid" and r.score_bias and r.fp32_logits
            assert layer.mlp.shared_experts.down_proj.weight.shape == hf_layer.mlp.shared_experts.down_proj.weight.shape
    # every transformers tensor has its place here (gate/up merged, experts stacked as transformers stacks them)
    for name, tensor in theirs.state_dict().items():
        merged = name.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.", ".gate_up_proj.")
        assert merged in ours_sd, name
        if merged == name:
            assert ours_sd[name] == tuple(tensor.shape), name


# ---------------------------------------------------------------- checkpoints

def test_multi_token_prediction_layers_are_skipped(make_tiny, tmp_path):
    """A checkpoint with its MTP layer after the last one (model.layers.3...: DeepSeek-V3 ships
    layer 61) loads and generates as without it, as transformers ignores it; another unknown
    tensor is still refused in one line."""
    src = make_tiny("deepseek_v3")
    out = str(tmp_path / "mtp")
    shutil.copytree(src, out)
    file = os.path.join(out, "model.safetensors")
    tensors = load_file(file)
    tensors.update({n.replace("layers.2.", "layers.3."): t.clone() for n, t in tensors.items() if ".layers.2." in n})
    save_file(tensors, file, metadata={"format": "pt"})
    llm = LLM(out, cpu_kernels=False)
    prompt = corpus_prompts(llm.tokenizer, lens=[17])[0]
    assert llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))[0].token_ids == \
        reference(src, tuple(prompt))
    tensors["model.norm.extra"] = torch.zeros(2)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.norm.extra'"):
        LLM(out, cpu_kernels=False)


def test_configs_it_cannot_serve_exactly_are_refused(make_tiny, tmp_path):
    src = make_tiny("deepseek_v3")
    for edit, words in [(dict(n_group=3), "n_group"), (dict(num_experts_per_tok=8, topk_group=1), "topk_group"),
                        (dict(hidden_act="gelu"), "hidden_act"), (dict(v_head_dim=0), "v_head_dim")]:
        out = str(tmp_path / "-".join(edit))
        shutil.copytree(src, out)
        with open(os.path.join(out, "config.json")) as f:
            raw = json.load(f)
        raw.update(edit)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(raw, f)
        with pytest.raises(CheckpointError) as e:
            LLM(out, cpu_kernels=False)
        assert words in str(e.value) and "\n" not in str(e.value) and out in str(e.value)
