"""Gemma 2, Gemma 3 (text) and Phi-3 generate exactly what transformers generates (fp32 greedy), on
prompts longer than their sliding windows, chunked, with the prefix cache, preemption and
speculation on: on torch's ops and on the CPU kernels (each build this CPU runs).

The tiny checkpoints (tools/make_model.py) make every feature matter: Gemma's local layer has a
16-token window, its attention scale is query_pre_attn_scalar's, Gemma 2's attention cap (5) and
both final caps (30) change tokens or logits, Gemma 3's local layers have their own RoPE base; the
Phi-3 checkpoint keeps qkv_proj and gate_up_proj fused and windows every layer to 32 tokens."""
import functools
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.backends.cpu import kernels
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import CheckpointError
from tests.conftest import KERNEL_ISAS
from tests.helpers import (PROMPT_LENS, assert_decode_equals_recompute, assert_last_position_logits_match,
                           chunked_logits, corpus_prompts, finish_all, hf_greedy, hf_logits)

VARIANTS = {"gemma2": ("gemma2", {}), "gemma3": ("gemma3", {}), "phi3": ("phi3", {"sliding_window": 32})}
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_path(request, make_tiny):
    arch, overrides = VARIANTS[request.param]
    return make_tiny(arch, **overrides)


@pytest.fixture(scope="module", params=[*KERNEL_ISAS, "torch"])
def cpu_kernels(request):
    """Each kernel build this CPU runs (cpu_kernels None: the default, on), then torch's ops."""
    kernels.use_isa(None if request.param == "torch" else request.param)
    yield False if request.param == "torch" else None
    kernels.use_isa(None)


@pytest.fixture(scope="module")
def llm(model_path, cpu_kernels):
    # small budget: the longer prompts are prefilled in chunks while the short ones decode
    return LLM(model_path, cpu_kernels=cpu_kernels, max_num_batched_tokens=64, max_num_seqs=16)


@functools.lru_cache(maxsize=None)
def reference(path: str, prompt: tuple, max_new_tokens: int = NEW_TOKENS) -> list[int]:
    return hf_greedy(path, list(prompt), max_new_tokens)


def test_greedy_batch_equals_transformers(llm, model_path):
    prompts = corpus_prompts(llm.tokenizer)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model_path, tuple(prompt)), f"prompt of {len(prompt)} tokens"
    assert max(PROMPT_LENS) > 32 and max(o.metrics.num_prefill_steps for o in outs) > 1   # past the windows, chunked
    llm.engine.block_manager.check_all_free()


def test_last_position_logits_match(llm, model_path):
    assert_last_position_logits_match(llm, model_path)


def test_decode_with_cache_equals_recompute(llm, model_path):
    """Each decode step's logits (one token against the cache, past the window) equal a full
    forward's without a cache."""
    assert_decode_equals_recompute(llm, model_path, prompt_len=30)


def test_a_shared_prefix_gives_the_tokens_of_the_prompt_alone(llm, model_path):
    system, q1, q2 = corpus_prompts(llm.tokenizer, lens=[70, 9, 30], offset=500)
    first = llm.generate([system + q1], GREEDY)[0]
    second = llm.generate([system + q2], GREEDY)[0]
    assert second.num_cached_tokens >= 64   # the system prompt's whole blocks, computed for the first
    assert first.token_ids == reference(model_path, tuple(system + q1))
    assert second.token_ids == reference(model_path, tuple(system + q2))


def test_preemption_keeps_outputs(model_path, cpu_kernels):
    # 12 blocks of 16 tokens for 8 requests needing up to 102 slots each: must preempt
    llm = LLM(model_path, cpu_kernels=cpu_kernels, num_kv_blocks=12, block_size=16, max_num_batched_tokens=64)
    prompts = corpus_prompts(llm.tokenizer, lens=[5, 40, 13, 90, 1, 27, 64, 8], offset=100)
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model_path, tuple(prompt)), f"prompt of {len(prompt)} tokens"
    llm.engine.block_manager.check_all_free()


def test_ngram_speculation_keeps_greedy_output(llm, model_path, cpu_kernels):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    # the last prompt holds most of the vocabulary: n-gram lookup finds whatever the model generates
    prompts = corpus_prompts(llm.tokenizer, lens=[5, 40]) + [list(range(3, 1000))]
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    engine = LLMEngine(model_path, cpu_kernels=cpu_kernels, max_num_batched_tokens=64, speculative_config=(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'))
    engine.speculator.cost_model = None   # propose in every step, whatever the cost model says
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out = finish_all(engine)
    assert [out[str(i)].token_ids for i in range(len(prompts))] == plain
    assert engine.speculator.stats.num_draft_tokens > 0
    engine.block_manager.check_all_free()


# ------------------------------------------------------------------ config.json spellings

def variant_of(path: str, out: str, **changes) -> str:
    """A copy of the checkpoint at `path` with config.json keys changed (None: removed)."""
    shutil.copytree(path, out)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def transformers4_spelling(config: dict) -> dict:
    """The keys transformers 4 wrote for the same model: rope_theta (Gemma 3: and rope_local_base_freq)
    instead of rope_parameters, no layer_types (Gemma 3: sliding_window_pattern gives them)."""
    rope = config["rope_parameters"]
    changes = {"rope_parameters": None, "layer_types": None, "rope_scaling": None}
    if "full_attention" in rope:
        changes.update(rope_theta=rope["full_attention"]["rope_theta"],
                       rope_local_base_freq=rope["sliding_attention"]["rope_theta"], _sliding_window_pattern=None)
        assert config["sliding_window_pattern"] == 2
        assert config["layer_types"] == ["sliding_attention", "full_attention"]
    else:
        changes.update(rope_theta=rope["rope_theta"])
    if config["model_type"] == "gemma2":   # transformers' Gemma 2 always alternates, local first
        assert config["layer_types"] == ["sliding_attention", "full_attention"]
    return changes


def test_the_transformers4_spelling_gives_the_same_tokens(model_path, tmp_path):
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    old = variant_of(model_path, str(tmp_path / "t4"), **transformers4_spelling(config))
    llm = LLM(old, cpu_kernels=False, max_num_batched_tokens=64)
    prompts = corpus_prompts(llm.tokenizer, lens=[17, 200])
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == reference(model_path, tuple(prompt)) == hf_greedy(old, prompt, NEW_TOKENS)


# ------------------------------------------------------------------ what is refused, in one line

def refusal(path: str) -> str:
    with pytest.raises(CheckpointError) as e:
        LLM(path, cpu_kernels=False)
    message = str(e.value)
    assert "\n" not in message and os.path.join(path, "config.json") in message
    return message


@pytest.mark.parametrize("arch, changes, reason", [
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("gemma3", {"layer_types": ["full_attention"]}, "layer_types must be 2"),
    ("gemma3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "per layer type"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "ntk-by-parts", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "'ntk-by-parts'"),
    ("phi3", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("phi3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
])
def test_configs_it_cannot_serve_exactly_are_refused(make_tiny, tmp_path, arch, changes, reason):
    assert reason in refusal(variant_of(make_tiny(arch), str(tmp_path / "m"), **changes))


def test_a_phi3_checkpoint_without_its_fused_tensor_is_refused(make_tiny, tmp_path):
    path = variant_of(make_tiny("phi3"), str(tmp_path / "m"))
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.self_attn.qkv_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.self_attn.qkv_proj.weight'"):
        LLM(path, cpu_kernels=False)


# ------------------------------------------------------------------ RoPE the rope work brings

LONGROPE = dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.2, 2.6, 3.1, 3.5, 4.0],
                              "long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]},
                original_max_position_embeddings=256)


def exact_on_both_paths(path: str, **engine_args):
    for cpu_kernels in (None, False):
        llm = LLM(path, cpu_kernels=cpu_kernels, max_num_batched_tokens=64, **engine_args)
        prompts = corpus_prompts(llm.tokenizer, lens=[17, 200])
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert out.token_ids == hf_greedy(path, prompt, NEW_TOKENS)
            ours = chunked_logits(llm.engine, prompt, chunk=len(prompt))[-1]
            torch.testing.assert_close(ours, hf_logits(path, prompt)[-1], atol=1e-4, rtol=0)


def test_phi4_mini_partial_rotary_is_exact(make_tiny):
    exact_on_both_paths(make_tiny("phi3", partial_rotary_factor=0.75))


def test_phi3_longrope_is_exact_within_the_original_length(make_tiny):
    # served up to original_max_position_embeddings: the short factors, as transformers uses there
    exact_on_both_paths(make_tiny("phi3", **LONGROPE), max_model_len=256)


def test_gemma3_linear_rope_scaling_of_the_global_layers_is_exact(make_tiny):
    # Gemma 3 4B-27B: factor 8 on the global layers, the local ones unscaled
    exact_on_both_paths(make_tiny("gemma3", rope_scaling={"rope_type": "linear", "factor": 8.0}))


# ------------------------------------------------------------------ the Hub's own config.json files

# As the Hub ships them (transformers-4 spelling), trimmed to the keys the model reads. Phi-3's
# also carry an auto_map (their first remote code), never run: the built-in class serves it.
GEMMA3_1B = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", attn_logit_softcapping=None,
                 final_logit_softcapping=None, head_dim=256, hidden_activation="gelu_pytorch_tanh", hidden_size=1152,
                 intermediate_size=6912, max_position_embeddings=32768, num_attention_heads=4, num_hidden_layers=26,
                 num_key_value_heads=1, query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_local_base_freq=10000,
                 rope_scaling=None, rope_theta=1000000, sliding_window=512, sliding_window_pattern=6,
                 vocab_size=262144, torch_dtype="bfloat16")
GEMMA2_2B = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, head_dim=256, hidden_act="gelu_pytorch_tanh",
                 hidden_activation="gelu_pytorch_tanh", hidden_size=2304, intermediate_size=9216,
                 max_position_embeddings=8192, num_attention_heads=8, num_hidden_layers=26, num_key_value_heads=4,
                 query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                 vocab_size=256000, torch_dtype="float32")
PHI3_MINI_4K = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_act="silu", hidden_size=3072,
                    intermediate_size=8192, max_position_embeddings=4096, num_attention_heads=32,
                    num_hidden_layers=32, num_key_value_heads=32, original_max_position_embeddings=4096,
                    rms_norm_eps=1e-5, rope_scaling=None, rope_theta=10000.0, sliding_window=2047,
                    tie_word_embeddings=False, vocab_size=32064, torch_dtype="bfloat16",
                    auto_map={"AutoConfig": "configuration_phi3.Phi3Config",
                              "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"})


def meta_model(config: dict, tmp_path):
    """The model a config.json describes, built on the meta device (no memory, no weights)."""
    from pdserve.config import ModelConfig
    from pdserve.models import ARCHITECTURES
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    cfg = ModelConfig.from_dir(str(tmp_path))
    with torch.device("meta"):
        return ARCHITECTURES[cfg.architecture](cfg)


def test_gemma3_1b_as_the_hub_ships_it(tmp_path):
    model = meta_model(GEMMA3_1B, tmp_path)
    local = [(i + 1) % 6 != 0 for i in range(26)]   # five local layers, then a global one
    attn = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attn] == [512 if x else None for x in local]
    assert {(a.scale, a.logit_softcap, a.head_dim, a.num_kv_heads) for a in attn} == {(256 ** -0.5, None, 256, 1)}
    assert (model.model.rotary.theta, model.model.rotary_local.theta) == (1e6, 1e4) and model.final_softcap is None
    spec = model.decoder_spec()
    assert spec.layer_rotary == tuple("model.rotary_local" if x else "model.rotary" for x in local)
    assert (spec.q_norm, spec.k_norm, spec.post_attn_norm, spec.post_mlp_norm, spec.mlp_norm, spec.activation) == (
        "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "post_feedforward_layernorm",
        "pre_feedforward_layernorm", "gelu_tanh_and_mul")
    assert model.lm_head.weight is model.model.embed_tokens.weight   # tied by default


def test_gemma2_2b_as_the_hub_ships_it(tmp_path):
    model = meta_model(GEMMA2_2B, tmp_path)
    attn = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attn] == [4096, None] * 13   # local first, alternating
    assert {(a.scale, a.logit_softcap, a.head_dim) for a in attn} == {(1 / 16, 50.0, 256)}
    assert model.final_softcap == 30.0 and model.model.rotary_local is None and model.model.rotary.theta == 1e4
    spec = model.decoder_spec()
    assert spec.q_norm is None and spec.layer_rotary is None and spec.post_mlp_norm == "post_feedforward_layernorm"


def test_phi3_mini_4k_as_the_hub_ships_it(tmp_path):
    # without rms_norm_eps: Phi3Config's default, 1e-5 (Llama's is 1e-6)
    model = meta_model({k: v for k, v in PHI3_MINI_4K.items() if k != "rms_norm_eps"}, tmp_path)
    attn = [layer.self_attn.attn for layer in model.model.layers]
    assert {(a.sliding_window, a.scale, a.head_dim, a.num_kv_heads) for a in attn} == {(2047, 96 ** -0.5, 96, 32)}
    assert {m.eps for n, m in model.named_modules() if n.endswith("norm")} == {1e-5}
    assert model.decoder_spec().activation == "silu_and_mul"
