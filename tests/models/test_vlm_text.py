"""Vision-language checkpoints (Gemma3ForConditionalGeneration, Mistral3ForConditionalGeneration, written
by transformers' own classes with a tiny vision tower) serve their text part exactly: greedy tokens and
logits equal to transformers' text-only forward, on torch's ops and on each kernel build; the vision
tensors are never read; the text config is read as transformers reads it (sparse text_config, the
composite's tie); an image in a request is a 400 naming it (pdserve/vlm_text.py)."""
import functools
import json
import os
import shutil

import httpx
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.vlm_text import TEXT_DEFAULTS
from tests.helpers import (assert_decode_equals_recompute, assert_last_position_logits_match,
                           assert_outputs_survive_cache_preemption_and_speculation, corpus_prompts, hf_greedy)
from tests.models.test_families_a import YARN

NEW_TOKENS = 12
VARIANTS = {
    "gemma3": ("gemma3_vlm", {}),                           # Gemma 3 4B+: tied, local/global layers, window 16
    "mistral3": ("mistral3_vlm", {"sliding_window": 16}),   # Mistral Small 3.1: its own lm_head
    "ministral3": ("ministral3_vlm", {"rope_parameters": YARN}),   # Ministral 3: yarn, the query scale
}


def tiny(make_tiny, name: str) -> str:
    arch, overrides = VARIANTS[name]
    return make_tiny(arch, **overrides)


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_path(request, make_tiny):
    return tiny(make_tiny, request.param)


@pytest.fixture(scope="module")
def llm(model_path, cpu_kernels):
    llm = LLM(model_path, max_num_batched_tokens=64, max_num_seqs=16, cpu_kernels=cpu_kernels)
    assert llm.engine.runner.backend.name == ("cpu" if cpu_kernels else "torch")
    return llm


@functools.lru_cache(maxsize=None)
def reference(path: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(path, list(prompt), NEW_TOKENS)


def test_greedy_batch_equals_transformers_text_only(llm, model_path):
    cfg = llm.engine.model_config
    assert cfg.text_of in ("Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration")
    prompts = corpus_prompts(llm.tokenizer)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model_path, tuple(prompt)), f"prompt of {len(prompt)} tokens"
    llm.engine.block_manager.check_all_free()


def test_last_position_logits_match(llm, model_path):
    assert_last_position_logits_match(llm, model_path)


def test_decode_with_cache_equals_recompute(llm, model_path):
    assert_decode_equals_recompute(llm, model_path, prompt_len=60)


def test_prefix_cache_preemption_and_speculation_keep_outputs(model_path, cpu_kernels):
    assert_outputs_survive_cache_preemption_and_speculation(model_path, cpu_kernels, reference, NEW_TOKENS)


# ---------------------------------------------------------------- the vision tower is never read

def test_the_vision_tensors_are_never_read(make_tiny, monkeypatch):
    import pdserve.loader as loader
    read = []
    real = loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    path = tiny(make_tiny, "gemma3")
    LLM(path, cpu_kernels=False, num_kv_blocks=8)
    names = set(load_file(os.path.join(path, "model.safetensors")))
    vision = {n for n in names if n.startswith(("vision_tower.", "multi_modal_projector."))}
    assert vision and read and not vision & set(read)
    assert set(read) == names - vision   # every text tensor, each once
    assert len(read) == len(set(read))


# ---------------------------------------------------------------- config.json, as transformers reads it

def test_text_defaults_are_transformers_defaults():
    classes = {"gemma3_text": transformers.Gemma3TextConfig, "mistral": transformers.MistralConfig,
               "ministral3": transformers.Ministral3Config}
    for kind, defaults in TEXT_DEFAULTS.items():
        theirs = classes[kind]().to_dict()
        for key, value in defaults.items():
            if key == "rope_parameters":
                theirs[key] = {k: v for k, v in theirs[key].items() if k != "type"}
            assert theirs[key] == value, (kind, key)


# the Hub's gemma-3-4b-it text_config (six keys; transformers fills in the rest)
GEMMA3_4B_TEXT = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                  "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                  "sliding_window": 1024}
# the Hub's Mistral-Small-3.1-24B text_config: no model_type is Mistral's default
MISTRAL_SMALL_TEXT = {"head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768,
                      "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 40,
                      "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
                      "sliding_window": None, "vocab_size": 131072}


@pytest.mark.parametrize("arch, text", [("Gemma3ForConditionalGeneration", GEMMA3_4B_TEXT),
                                        ("Mistral3ForConditionalGeneration", MISTRAL_SMALL_TEXT)])
def test_a_sparse_hub_text_config_reads_as_transformers_reads_it(tmp_path, arch, text):
    raw = {"architectures": [arch], "model_type": "gemma3" if arch.startswith("Gemma") else "mistral3",
           "text_config": text, "vision_config": {},
           "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = ModelConfig.from_dir(str(tmp_path))
    theirs = transformers.AutoConfig.from_pretrained(str(tmp_path))
    t = theirs.text_config
    assert (ours.vocab_size, ours.hidden_size, ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim,
            ours.intermediate_size, ours.max_position_embeddings, ours.rms_norm_eps) == \
        (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
         t.intermediate_size, t.max_position_embeddings, t.rms_norm_eps)
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings and ours.torch_dtype == "bfloat16"
    with torch.device("meta"):
        from pdserve.models import ARCHITECTURES
        model = ARCHITECTURES[ours.architecture](ours)
    attns = [layer.self_attn.attn for layer in model.model.layers]
    types = t.layer_types if getattr(t, "layer_types", None) else ["sliding_attention"] * t.num_hidden_layers
    assert [a.sliding_window for a in attns] == [t.sliding_window if k == "sliding_attention" else None
                                                 for k in types]
    if arch.startswith("Gemma"):
        assert attns[0].scale == t.query_pre_attn_scalar ** -0.5
        assert model.model.rotary.scaling["factor"] == 8.0
        assert model.model.rotary_local.theta == t.rope_parameters["sliding_attention"]["rope_theta"]
    else:
        assert model.model.rotary.theta == t.rope_parameters["rope_theta"]


def rewritten(path: str, out: str, rename=None, config=None) -> str:
    """A copy of a checkpoint with its tensors renamed (rename(name) -> name) and config.json edited."""
    shutil.copytree(path, out)
    weights = os.path.join(out, "model.safetensors")
    if rename is not None:
        save_file({rename(n): t for n, t in load_file(weights).items()}, weights, metadata={"format": "pt"})
    if config is not None:
        with open(os.path.join(out, "config.json")) as f:
            raw = json.load(f)
        config(raw)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(raw, f)
    return out


def transformers4_name(name: str) -> str:
    """transformers 4.5x's save names: model.language_model.*, model.vision_tower.*, lm_head.*"""
    if name.startswith("language_model.model."):
        return "model.language_model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return "model." + name


@pytest.mark.parametrize("name", ["gemma3", "mistral3"])
def test_transformers4_weight_names_give_the_same_tokens(make_tiny, tmp_path, name):
    path = tiny(make_tiny, name)
    old = rewritten(path, str(tmp_path / "t4"), rename=transformers4_name)
    llm = LLM(old, cpu_kernels=False, max_num_batched_tokens=64)
    prompts = corpus_prompts(llm.tokenizer, lens=[17, 120])
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))):
        assert out.token_ids == reference(path, tuple(prompt))


def test_an_lm_head_in_the_checkpoint_is_kept_though_the_composite_ties(make_tiny, tmp_path):
    """Mistral3Config ties by default: a config.json without tie_word_embeddings whose checkpoint has
    its own lm_head (Mistral Small 3.1's) keeps it, as transformers does."""
    path = tiny(make_tiny, "mistral3")
    untold = rewritten(path, str(tmp_path / "untold"), config=lambda raw: raw.pop("tie_word_embeddings"))
    assert transformers.AutoConfig.from_pretrained(untold).tie_word_embeddings
    llm = LLM(untold, cpu_kernels=False, max_num_batched_tokens=64)
    assert not llm.engine.model_config.tie_word_embeddings
    prompts = corpus_prompts(llm.tokenizer, lens=[33])
    assert llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))[0].token_ids == \
        reference(path, tuple(prompts[0])) == hf_greedy(untold, prompts[0], NEW_TOKENS)


def refused(path: str) -> str:
    with pytest.raises(CheckpointError) as e:
        LLM(path, cpu_kernels=False)
    msg = str(e.value)
    assert "\n" not in msg and os.path.join(path, "config.json") in msg, msg
    return msg


def test_what_it_cannot_serve_is_refused_in_one_line(make_tiny, tmp_path):
    path = tiny(make_tiny, "mistral3")
    msg = refused(rewritten(path, str(tmp_path / "qwen"), config=lambda r: r["text_config"].update(model_type="qwen2")))
    assert "text_config of model_type 'qwen2' is not supported" in msg
    msg = refused(rewritten(path, str(tmp_path / "none"), config=lambda r: r.pop("text_config")))
    assert "needs its language model's config as text_config" in msg
    # no lm_head and no tie: transformers would leave it random
    no_head = rewritten(path, str(tmp_path / "nohead"), config=lambda r: r.update(tie_word_embeddings=False))
    weights = os.path.join(no_head, "model.safetensors")
    save_file({n: t for n, t in load_file(weights).items() if "lm_head" not in n}, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):
        LLM(no_head, cpu_kernels=False)


# ---------------------------------------------------------------- image inputs: a 400 naming them

def test_an_image_in_a_request_is_a_400_naming_it(make_tiny):
    from pdserve.engine.llm_engine import LLMEngine
    from tests.server.inprocess import serve
    engine = LLMEngine(tiny(make_tiny, "gemma3"), cpu_kernels=False, num_kv_blocks=16)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with serve(engine) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "image_url" in err["message"] and err["param"] == "messages"
        r = httpx.post(url + "/v1/responses", timeout=30, json={"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": "x"}]}]})
        assert r.status_code == 400 and "input_image" in r.json()["error"]["message"], r.text
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}], "max_tokens": 3})
        assert r.status_code == 200, r.text   # text parts are served
