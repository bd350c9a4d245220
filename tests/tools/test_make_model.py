"""`python -m tools.make_model`: real HF checkpoints that transformers loads, with peaked random logits."""
import json
import os
import statistics

import pytest
import torch
import transformers
from safetensors import safe_open

from pdserve.errors import CheckpointError
from pdserve.tokenizer import Tokenizer
from tools.make_model import build_config, corpus_texts, make_model
from tools.make_model import main as make_model_main

OPT_350M_STYLE = dict(do_layer_norm_before=False, word_embed_proj_dim=32)
LLAMA3_ROPE_TIED = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                        tie_word_embeddings=True)
VARIANTS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "mistral": ("mistral", {}), "opt": ("opt", {}),
            "opt-350m-style": ("opt", OPT_350M_STYLE), "llama3-rope-tied": ("llama", LLAMA3_ROPE_TIED)}
VARIANTS.update({arch: (arch, {}) for arch in ("qwen3", "olmo2", "granite", "smollm3", "ministral", "ministral3")})
VARIANTS.update({arch: (arch, {}) for arch in ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")})
VARIANTS.update({"gpt_oss": ("gpt_oss", {}), "gpt_oss-mxfp4": ("gpt_oss", {"mxfp4": True})})


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tensor_names(path):
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return set(f.keys())


def config_of(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, make_tiny):
    arch, overrides = VARIANTS[request.param]
    return request.param, make_tiny(arch, **overrides)


def test_files_and_family_shapes(variant):
    name, path = variant
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(path, f)), f
    cfg, names = config_of(path), tensor_names(path)
    tok = Tokenizer.from_dir(path)
    assert 1000 <= tok.vocab_size <= 2000 and tok.vocab_size <= cfg["vocab_size"] < tok.vocab_size + 64
    assert cfg["dtype"] == "float32" and cfg["max_position_embeddings"] == 1024 and cfg["hidden_size"] == 64
    if name == "opt":
        assert cfg["do_layer_norm_before"] and cfg["activation_function"] == "relu"
        assert cfg["word_embed_proj_dim"] == 64 and not any("project_in" in n for n in names)
    elif name == "opt-350m-style":
        assert not cfg["do_layer_norm_before"]
        assert {"model.decoder.project_in.weight", "model.decoder.project_out.weight"} <= names
    elif name == "deepseek_v3":   # latent attention: the heads share the latent, no K/V head count of its own
        assert cfg["num_attention_heads"] == cfg["num_key_value_heads"] == 4
    else:
        assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    if name in ("llama", "mistral"):
        assert not cfg["tie_word_embeddings"] and "lm_head.weight" in names
    if name == "mistral":
        assert cfg["sliding_window"] is None
    if name == "qwen2":
        assert cfg["tie_word_embeddings"] and "lm_head.weight" not in names
        assert "model.layers.0.self_attn.q_proj.bias" in names
    if name == "qwen3":   # an explicit head_dim unlike hidden / heads, per-head q/k norms, layer 1 windowed
        assert cfg["head_dim"] == 32 and cfg["layer_types"] == ["full_attention", "sliding_attention"]
        assert "model.layers.0.self_attn.q_norm.weight" in names
    if name == "olmo2":
        assert {"model.layers.0.post_feedforward_layernorm.weight", "model.layers.0.self_attn.k_norm.weight"} <= names
        assert not any("input_layernorm" in n for n in names)
    if name == "granite":
        assert all(cfg[k] != 1.0 for k in ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                                           "logits_scaling"))
    if name == "smollm3":
        assert cfg["no_rope_layers"] == [1, 0, 1, 0] and cfg["use_sliding_window"] and cfg["sliding_window"] == 16
    if name == "ministral":
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 16
    if name == "ministral3":
        assert cfg["rope_parameters"]["llama_4_scaling_beta"] == 0.1
    if name in ("qwen2_moe", "qwen3_moe", "mixtral"):   # 8 experts, top 2, per-expert tensors as the Hub has them
        assert cfg["num_experts_per_tok"] == 2 and cfg.get("num_experts", cfg.get("num_local_experts")) == 8
        expert = {"mixtral": "block_sparse_moe.experts.7.w2"}.get(name, "mlp.experts.7.down_proj")
        assert f"model.layers.0.{expert}.weight" in names and cfg["sliding_window"] == (16 if name == "qwen2_moe" else 48)
    if name == "qwen2_moe":   # layer 1 dense, a gated shared expert, layer 0 windowed
        assert cfg["mlp_only_layers"] == [1] and "model.layers.1.mlp.gate_proj.weight" in names
        assert "model.layers.0.mlp.shared_expert_gate.weight" in names
        assert cfg["layer_types"] == ["sliding_attention", "full_attention", "full_attention"]
    if name == "qwen3_moe":
        assert cfg["head_dim"] == 32 and cfg["norm_topk_prob"] and "model.layers.0.self_attn.q_norm.weight" in names
    if name == "deepseek_v3":   # layer 0 dense, then routed and shared experts; MLA with q through its latent
        assert cfg["first_k_dense_replace"] == 1 and "model.layers.0.mlp.gate_proj.weight" in names
        assert {"model.layers.2.mlp.experts.7.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
                "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.0.self_attn.q_a_proj.weight",
                "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.kv_b_proj.weight"} <= names
    if name.startswith("gpt_oss"):   # stacked experts as the Hub ships them, dense or MXFP4; sinks; alternating windows
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 32
        assert "model.layers.0.self_attn.sinks" in names and "model.layers.0.mlp.router.bias" in names
        parts = ["_blocks", "_scales"] if name.endswith("mxfp4") else [""]
        assert {f"model.layers.1.mlp.experts.down_proj{p}" for p in parts} <= names
        assert ("quantization_config" in cfg) == name.endswith("mxfp4")
    if name == "llama3-rope-tied":
        assert cfg["rope_parameters"]["rope_type"] == "llama3" and cfg["rope_parameters"]["factor"] == 8.0
        assert "lm_head.weight" not in names


def test_biases_and_norms_are_not_trivial(variant):
    # Random biases and norm weights: an engine that drops one gets different tokens.
    _, path = variant
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for n in f.keys():
            t = f.get_tensor(n)
            if t.dim() == 1 and not n.endswith("sinks"):   # gpt-oss's sink logits: N(0, 1), tested in its tests
                assert t.std() > 0.05 and (t - t.mean()).abs().max() < 1.0, n


def corpus_prompts(tok, n=8, length=128):
    stories = corpus_texts(max_story_chars=20_000)[:n]  # the stories come first
    return [tok.encode(s)[:length] for s in stories]


@torch.no_grad()
def test_logits_are_peaked_and_attention_matters(variant):
    _, path = variant
    model, tok = load(path), Tokenizer.from_dir(path)
    margins, changed, total = [], 0, 0
    for ids in corpus_prompts(tok):
        logits = model(torch.tensor([ids])).logits[0]
        assert torch.isfinite(logits).all() and logits.abs().max() < 100
        top2 = logits.topk(2, dim=-1).values
        margins += (top2[:, 0] - top2[:, 1]).tolist()
        # Changing one early token must change many later predictions.
        edited = list(ids)
        edited[1] = (edited[1] + 7) % tok.vocab_size
        changed += (model(torch.tensor([edited])).logits[0, 8:].argmax(-1) != logits[8:].argmax(-1)).sum().item()
        total += len(ids) - 8
    assert statistics.median(margins) > 0.5
    assert sum(m < 0.01 for m in margins) / len(margins) < 0.01
    assert changed / total > 0.2


@torch.no_grad()
def test_transformers_generates_varied_text(variant):
    _, path = variant
    model, tok = load(path), Tokenizer.from_dir(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    outs, distinct = [], []
    for ids in corpus_prompts(tok, n=6, length=20):
        assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids)
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                             pad_token_id=0)[0, len(ids):].tolist()
        outs.append(tuple(out))
        distinct.append(len(set(out)))
    assert statistics.median(distinct) >= 4  # not collapsed to a repeated token
    assert len(set(outs)) >= 5  # different prompts, different continuations


def test_seed_decides_weights(make_tiny, tmp_path):
    a, b = make_tiny("qwen2"), make_model(str(tmp_path / "seed1"), "qwen2", seed=1)
    with safe_open(os.path.join(a, "model.safetensors"), "pt") as fa, \
            safe_open(os.path.join(b, "model.safetensors"), "pt") as fb:
        name = "model.embed_tokens.weight"
        assert not torch.equal(fa.get_tensor(name), fb.get_tensor(name))
    with open(os.path.join(a, "tokenizer.json")) as fa, open(os.path.join(b, "tokenizer.json")) as fb:
        assert fa.read() == fb.read()  # the tokenizer is trained deterministically


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        make_model(str(out), "llama")
    with pytest.raises(CheckpointError, match="unknown --arch"):
        make_model(str(tmp_path / "x"), "gpt9")
    with pytest.raises(CheckpointError, match="override"):
        make_model(str(tmp_path / "y"), "llama", num_key_value_heads=3)  # does not divide 4 heads
    assert make_model_main([str(out), "--arch", "opt"]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and err.count("\n") == 1


def test_cli_writes_checkpoint(tmp_path, capsys):
    out = tmp_path / "m"
    assert make_model_main([str(out), "--arch", "mistral", "--seed", "3",
                     "--set", "num_hidden_layers=3", "--set", "sliding_window=null"]) == 0
    assert config_of(out)["num_hidden_layers"] == 3 and config_of(out)["sliding_window"] is None
    assert make_model_main([str(out), "--arch", "llama", "--force"]) == 0
    assert config_of(out)["model_type"] == "llama"
    with pytest.raises(SystemExit):
        make_model_main([str(out), "--arch", "gpt9"])


def test_bfloat16_checkpoint(tmp_path):
    # --dtype bfloat16 writes the weights as the Hub ships the large families (half the memory to build)
    path = make_model(str(tmp_path / "bf16"), "qwen3_moe", dtype="bfloat16")
    assert config_of(path)["dtype"] == "bfloat16"
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert {f.get_tensor(n).dtype for n in f.keys()} == {torch.bfloat16}
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.bfloat16
    assert torch.isfinite(model(torch.tensor([[3, 4, 5]])).logits).all()
    with pytest.raises(CheckpointError, match="unknown --dtype"):
        make_model(str(tmp_path / "x"), "llama", dtype="float16")


def test_half_billion_shape_without_building_it():
    # The real 0.5b run writes ~2 GB; here only its config and parameter count are checked.
    cfg = build_config("qwen2", "0.5b", 151936, {"bos": None, "eos": 0, "pad": 0}, {})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.tie_word_embeddings) == (896, 24, 14, 2, 4864, True)
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(cfg)
    assert 490e6 < sum(p.numel() for p in model.parameters()) < 500e6


def test_llama3_8b_shape_without_building_it(tmp_path):
    # `--size 8b` (the GPU roofline's checkpoint, drawn on the GPU): Llama-3-8B's 8.03B parameters
    cfg = build_config("llama", "8b", 128256, {"bos": 1, "eos": 2, "pad": None}, {})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (4096, 32, 32, 8, 14336, 128256, False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert 8.02e9 < sum(p.numel() for p in model.parameters()) < 8.04e9
    with pytest.raises(CheckpointError, match="unknown --device"):
        make_model(str(tmp_path / "x"), "llama", device="tpu")


def test_8b_path_at_a_small_width_draws_every_weight(tmp_path):
    # the 8b size's path (meta, to_empty on --device, init_weights there), shrunk by overrides as the
    # device check's dry run shrinks it: a bf16 checkpoint with the 8b vocabulary padding rule
    path = make_model(str(tmp_path / "m"), "llama", size="8b", dtype="bfloat16", hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=4096)
    cfg = config_of(path)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"], cfg["tie_word_embeddings"]) == (4096, 8192, False)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            assert t.dtype == torch.bfloat16 and torch.isfinite(t).all() and t.float().std() > 0, name


@pytest.mark.parametrize("arch, vocab, total, non_embedding", [
    ("qwen3", 151936, 596e6, 440e6), ("gemma3", 151936, 1000e6, 698e6),
    ("qwen3_moe", 151936, 30.53e9, 29.92e9), ("gpt_oss", 201088, 20.91e9, 19.75e9)])
def test_hub_shapes_without_building_them(arch, vocab, total, non_embedding):
    # `--size hub`: the published shapes (Qwen3-0.6B: 0.6B with 0.44B non-embedding; Gemma-3-1B; Qwen3-30B-A3B;
    # gpt-oss-20b); non-embedding counts neither the embedding nor an untied lm_head
    from tools.make_model import HUB_SHAPES, MODEL_CLASSES
    cfg = build_config(arch, "hub", vocab, {"bos": 2, "eos": 1, "pad": 0}, HUB_SHAPES[arch])
    with torch.device("meta"):
        model = getattr(transformers, MODEL_CLASSES[arch])(cfg)
    n = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel() * (1 if cfg.tie_word_embeddings else 2)
    assert abs(n - total) / total < 0.01 and abs(n - emb - non_embedding) / non_embedding < 0.01
    with pytest.raises(CheckpointError, match="no --size hub shape"):
        make_model("/nonexistent-dir-for-test", "opt", size="hub")


# ---------------------------------------------------------------- the bundled default model

def test_default_model_is_small_and_loads():
    from pdserve.data import DEFAULT_MODEL_DIR

    files = os.listdir(DEFAULT_MODEL_DIR)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    assert sum(os.path.getsize(os.path.join(DEFAULT_MODEL_DIR, f)) for f in files) < 30 * 2**20
    assert config_of(DEFAULT_MODEL_DIR)["architectures"] == ["LlamaForCausalLM"]
    tok, hf_tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR), transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    for text in ("Once upon a time, there was a cat.", "Héllo 🙂 你好", "What is 3 plus 4?"):
        assert tok.encode(text) == hf_tok(text).input_ids
    assert tok.chat_template and tok.token_to_id("<|im_end|>") in tok.eos_token_ids


@torch.no_grad()
def test_default_model_writes_readable_english():
    from pdserve.data import DEFAULT_MODEL_DIR
    from tools import CORPUS_DIR

    model, tok = load(DEFAULT_MODEL_DIR), Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    with open(os.path.join(CORPUS_DIR, "stories.txt")) as f:
        known = set(f.read().replace('"', " ").replace(".", " ").replace(",", " ").replace("!", " ")
                    .replace("?", " ").split())
    for prompt in ("Once upon a time", "One day, Tom found a"):
        ids = torch.tensor([tok.encode(prompt)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:].tolist())
        words = text.replace('"', " ").replace(".", " ").replace(",", " ").replace("!", " ").replace("?", " ").split()
        # A random model emits byte soup; a trained one emits the corpus' English words.
        assert len(words) >= 15 and sum(w in known for w in words) / len(words) > 0.9, text
