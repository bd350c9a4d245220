"""Qwen3, OLMo 2, Granite, SmolLM3, Ministral and Ministral 3 generate exactly what transformers
generates (fp32 greedy; logits to 1e-4), on prompts longer than their sliding windows, on torch's
ops and on the CPU kernels (each build this CPU runs), with chunked prefill, the prefix cache,
preemption and n-gram speculation; each reads its config.json in transformers-4 and -5 spellings
as transformers does, and a config it cannot serve exactly is refused in one line."""
import functools
import json
import os
import shutil

import pytest
import torch
import transformers

from pdserve import LLM
from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.config_fields import CONFIG_FIELDS
from pdserve.models import ARCHITECTURES
from tests.helpers import (PROMPT_LENS, assert_decode_equals_recompute, assert_greedy_batch_equals_transformers,
                           assert_last_position_logits_match,
                           assert_outputs_survive_cache_preemption_and_speculation, chunked_logits, corpus_prompts,
                           hf_greedy, hf_logits)

NEW_TOKENS = 12

# Ministral 3 as it ships: yarn RoPE (Ministral 3's parameters, at a tiny context)
YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 64,
        "max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1}


# make_model's tiny checkpoints of each family (tools/make_model.py): windows of 16 tokens
VARIANTS = {
    "qwen3": ("qwen3", {}),                 # per-head q/k norms, head_dim 32 (hidden / heads is 16), layer 1 windowed
    "olmo2": ("olmo2", {}),                 # post-block norms, q/k norms over the projections
    "granite": ("granite", {}),             # the four multipliers
    "smollm3": ("smollm3", {}),             # NoPE layers 1 and 3, windowed layers 1 and 2
    "ministral": ("ministral", {}),         # windowed, full
    "ministral3": ("ministral3", {"sliding_window": 16}),   # q scaled from position 64 on, every layer windowed
    "ministral3-yarn": ("ministral3", {"rope_parameters": YARN}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_path(request, make_tiny):
    arch, overrides = VARIANTS[request.param]
    return make_tiny(arch, **overrides)


@pytest.fixture(scope="module")
def llm(model_path, cpu_kernels):
    # small budget: the longer prompts are prefilled in chunks while the short ones decode
    llm = LLM(model_path, max_num_batched_tokens=64, max_num_seqs=16, cpu_kernels=cpu_kernels)
    assert llm.engine.runner.backend.name == ("cpu" if cpu_kernels else "torch")
    return llm


@functools.lru_cache(maxsize=None)
def reference(path: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(path, list(prompt), NEW_TOKENS)


def test_greedy_batch_equals_transformers(llm, model_path):
    assert max(PROMPT_LENS) > 16 * 12   # far beyond the windows
    assert_greedy_batch_equals_transformers(llm, model_path, reference, NEW_TOKENS)


def test_last_position_logits_match(llm, model_path):
    assert_last_position_logits_match(llm, model_path)


def test_decode_with_cache_equals_recompute(llm, model_path):
    """Each decode step's logits (one token against the cache) equal a full forward without a cache,
    past the windows and Ministral 3's first query-scale period (64)."""
    assert_decode_equals_recompute(llm, model_path, prompt_len=60)


def test_prefix_cache_preemption_and_speculation_keep_outputs(model_path, cpu_kernels):
    assert_outputs_survive_cache_preemption_and_speculation(model_path, cpu_kernels, reference, NEW_TOKENS)


# ---------------------------------------------------------------- config.json, as transformers reads it

def config_of(arch: str, raw: dict) -> ModelConfig:
    return ModelConfig("/ckpt", arch, **CONFIG_FIELDS[arch](raw), torch_dtype=None, raw=raw)


def hf_windows(hf_config) -> list:
    """Each layer's window as transformers' eager/SDPA attention masks it (a family without
    layer_types, Ministral 3's: the config's one window, or none, everywhere)."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * hf_config.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=4)
# (architecture, transformers' config class, config.json without the keys transformers-5 derives)
CONFIGS = [
    ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16)),   # Qwen3's configs: no windows
    ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, use_sliding_window=False, sliding_window=4096)),
    ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, use_sliding_window=True, sliding_window=8,
                                             max_window_layers=2)),
    ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, use_sliding_window=True, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention"] * 2)),
    ("SmolLM3ForCausalLM", "SmolLM3Config", dict()),   # SmolLM3-3B's: NoPE every 4th layer, no windows
    ("SmolLM3ForCausalLM", "SmolLM3Config", dict(no_rope_layer_interval=2, use_sliding_window=True,
                                                 sliding_window=8)),
    ("SmolLM3ForCausalLM", "SmolLM3Config", dict(no_rope_layers=[0, 1, 1, 0], use_sliding_window=True,
                                                 sliding_window=8, layer_types=["full_attention"] * 4)),
    ("MinistralForCausalLM", "MinistralConfig", dict(head_dim=16)),   # the default window, every layer
    ("MinistralForCausalLM", "MinistralConfig", dict(head_dim=16, sliding_window=None)),
    ("MinistralForCausalLM", "MinistralConfig", dict(head_dim=16, sliding_window=8,
                                                     layer_types=["sliding_attention", "full_attention"] * 2)),
]


@pytest.mark.parametrize("arch, hf_class, fields", CONFIGS)
def test_windows_and_rope_layers_are_transformers(arch, hf_class, fields):
    """Each layer's window and RoPE from a config.json as the Hub ships it (transformers-4
    configs have no layer_types: each family derives them by its own rule) equal transformers'."""
    raw = dict(BASE, architectures=[arch], **fields)
    hf = getattr(transformers, hf_class)(**raw)
    v = ARCHITECTURES[arch].variant_of(config_of(arch, raw))
    assert list(v.windows) == hf_windows(hf)
    if arch == "SmolLM3ForCausalLM":
        assert list(v.rope_layers) == [bool(r) for r in hf.no_rope_layers]


def test_family_defaults_are_transformers():
    """Where config.json says nothing, each family's transformers default, not Llama's."""
    raw = dict(BASE, architectures=["Olmo2ForCausalLM"])
    assert ARCHITECTURES["Olmo2ForCausalLM"].variant_of(config_of("Olmo2ForCausalLM", raw)).eps == \
        transformers.Olmo2Config(**raw).rms_norm_eps == 1e-5
    raw = dict(BASE, architectures=["Qwen3ForCausalLM"])
    assert config_of("Qwen3ForCausalLM", raw).head_dim == transformers.Qwen3Config(**raw).head_dim == 128
    raw = dict(BASE, architectures=["SmolLM3ForCausalLM"])
    assert config_of("SmolLM3ForCausalLM", raw).tie_word_embeddings is True


def transformers4_copy(path: str, out: str) -> str:
    """The checkpoint with its config.json in transformers-4 spelling: rope_theta and rope_scaling,
    torch_dtype, and no layer_types for the family to derive."""
    shutil.copytree(path, out)
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    rope = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = rope.pop("rope_theta")
    if rope.pop("rope_type") != "default" or rope:
        raw["rope_scaling"] = {"rope_type": "default", **rope}
    raw["torch_dtype"] = raw.pop("dtype")
    raw.pop("layer_types", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
    return out


# the tiny checkpoints whose layer types the transformers-4 rules derive as they were saved
@pytest.mark.parametrize("name", ["qwen3", "olmo2", "granite", "ministral3"])
def test_transformers4_spelling_serves_the_same_model(make_tiny, tmp_path, name):
    arch, overrides = VARIANTS[name]
    path = make_tiny(arch, **overrides)
    old = transformers4_copy(path, str(tmp_path / "tf4"))
    llm = LLM(old, cpu_kernels=False)
    ours = llm.engine.runner.model
    assert [layer.self_attn.attn.sliding_window for layer in ours.model.layers] == \
        hf_windows(transformers.AutoConfig.from_pretrained(path))
    prompt = corpus_prompts(llm.tokenizer, lens=[120])[0]
    logits = chunked_logits(llm.engine, prompt, chunk=len(prompt))[-1]
    torch.testing.assert_close(logits, hf_logits(path, prompt)[-1], atol=1e-4, rtol=0)


# ---------------------------------------------------------------- the decoder stack's recipe

def spec_of(make_tiny, name):
    arch, overrides = VARIANTS[name]
    cfg = ModelConfig.from_dir(make_tiny(arch, **overrides))
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.architecture](cfg)
    return model, model.decoder_spec()


def test_decoder_specs_declare_each_familys_parts(make_tiny):
    """The recipe the decoder stack will run (models/decoder_spec.py), each name a module."""
    model, s = spec_of(make_tiny, "qwen3")
    assert (s.q_norm, s.k_norm) == ("self_attn.q_norm", "self_attn.k_norm")
    assert model.get_submodule(f"model.layers.0.{s.q_norm}").weight.shape == (32,)   # per head
    assert s.attn_norm == "input_layernorm" and s.post_attn_norm is None and s.layer_rotary is None
    model, s = spec_of(make_tiny, "olmo2")
    assert s.attn_norm is None and s.mlp_norm is None
    assert (s.post_attn_norm, s.post_mlp_norm) == ("post_attention_layernorm", "post_feedforward_layernorm")
    assert model.get_submodule(f"model.layers.0.{s.q_norm}").weight.shape == (4 * 16,)   # the whole projection
    assert model.get_submodule(f"model.layers.0.{s.k_norm}").weight.shape == (2 * 16,)
    model, s = spec_of(make_tiny, "granite")
    assert s.residual_multiplier == 0.7 and s.q_norm is None
    assert model.get_submodule(f"model.layers.0.{s.attention}").scale == 0.2
    model, s = spec_of(make_tiny, "smollm3")
    assert s.layer_rotary == ("model.rotary", None, "model.rotary", None) and s.rotary_of(1) is None
    model, s = spec_of(make_tiny, "ministral")
    assert [model.get_submodule(f"model.layers.{i}.{s.attention}").sliding_window for i in (0, 1)] == [16, None]
    _, s = spec_of(make_tiny, "ministral3")
    assert s is None   # the recipe has no part for its query scale: the modules run it


# ---------------------------------------------------------------- refused in one line

def refused(path: str) -> str:
    with pytest.raises(CheckpointError) as e:
        LLM(path, cpu_kernels=False)
    msg = str(e.value)
    assert "\n" not in msg and os.path.join(path, "config.json") in msg, msg
    return msg


def edited(make_tiny, tmp_path, name: str, edit, out: str | None = None) -> str:
    arch, overrides = VARIANTS[name]
    out = str(tmp_path / (out or name))
    shutil.copytree(make_tiny(arch, **overrides), out)
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    edit(raw)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
    return out


def test_configs_it_cannot_serve_exactly_are_refused(make_tiny, tmp_path):
    # SmolLM3 windowed layers without use_sliding_window: transformers' attentions disagree
    msg = refused(edited(make_tiny, tmp_path, "smollm3", lambda r: r.update(use_sliding_window=False)))
    assert "use_sliding_window" in msg
    # Ministral 3 without its query scale's parameters (transformers fails on it)
    msg = refused(edited(make_tiny, tmp_path, "ministral3", lambda r: r["rope_parameters"].pop("llama_4_scaling_beta")))
    assert "llama_4_scaling_beta" in msg
    # without RoPE parameters: transformers would take its yarn default
    msg = refused(edited(make_tiny, tmp_path, "ministral3", lambda r: r.pop("rope_parameters"), out="no-rope"))
    assert "rope_parameters" in msg
    # a Granite whose logits scaling would reverse the greedy argmax
    msg = refused(edited(make_tiny, tmp_path, "granite", lambda r: r.update(logits_scaling=-2.0)))
    assert "logits_scaling" in msg
    # an activation other than SwiGLU's
    msg = refused(edited(make_tiny, tmp_path, "olmo2", lambda r: r.update(hidden_act="gelu")))
    assert "hidden_act" in msg
    # a layer type pdserve has no attention for
    msg = refused(edited(make_tiny, tmp_path, "ministral", lambda r: r.update(
        layer_types=["chunked_attention", "full_attention"])))
    assert "chunked_attention" in msg
