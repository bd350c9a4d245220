"""Every rope type, read from either config.json spelling, gives transformers' frequencies and
attention scaling; partial rotary rotates as transformers does; tiny Llama checkpoints with yarn,
linear and longrope scaling generate what transformers generates, on torch's ops and the CPU kernels."""
import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.layers.rotary import RotaryEmbedding, apply_rotary, get_rope, rope_inv_freq
from tests.conftest import KERNEL_ISAS
from tests.helpers import chunked_logits, corpus_prompts, hf_greedy, hf_logits

HEAD_DIM, MAX_POS, OLD_LEN = 16, 1024, 256
LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, max_position_embeddings=MAX_POS)
SHORT = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
LONG = [2.0 + 1.5 * i for i in range(HEAD_DIM // 2)]
# rope type -> variants of its keys (besides rope_type and rope_theta)
CASES = {
    "linear": [{"factor": 4.0}],
    "dynamic": [{"factor": 2.0}],
    "yarn": [{"factor": 4.0, "original_max_position_embeddings": OLD_LEN},
             {"factor": 4.0, "original_max_position_embeddings": OLD_LEN, "beta_fast": 16, "beta_slow": 2,
              "truncate": False},
             {"factor": 8.0, "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 1.0},
             {"factor": 4.0, "original_max_position_embeddings": OLD_LEN, "attention_factor": 1.5}],
    "longrope": [{"short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": OLD_LEN},
                 {"short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": OLD_LEN,
                  "factor": 2.0},
                 {"short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": OLD_LEN,
                  "attention_factor": 1.2}],
    "llama3": [{"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": OLD_LEN}],
}
PARAMS = [(kind, i) for kind, variants in CASES.items() for i in range(len(variants))]
THETA = 500000.0


def spelled(kind: str, keys: dict, spelling: str) -> dict:
    """config.json's rope fields: transformers-4 (rope_theta + rope_scaling with `type` or `rope_type`)
    or transformers-5 (rope_parameters holding everything)."""
    if spelling == "t5":
        return {"rope_parameters": {"rope_type": kind, "rope_theta": THETA, **keys}}
    type_key = "type" if spelling == "t4-type" else "rope_type"
    return {"rope_theta": THETA, "rope_scaling": {type_key: kind, **keys}}


def pdserve_config(tmp_path, raw: dict) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_dir(str(tmp_path))


def hf_config(raw: dict):
    return transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})


@pytest.mark.parametrize("spelling", ["t4-type", "t4-rope_type", "t5"])
@pytest.mark.parametrize("kind, variant", PARAMS)
def test_frequencies_and_scaling_equal_transformers(tmp_path, kind, variant, spelling):
    raw = {**LLAMA, **spelled(kind, CASES[kind][variant], spelling)}
    cfg, hf = pdserve_config(tmp_path, raw), hf_config(raw)
    # served within the original length (longrope: its short factors), and beyond it (the long ones)
    for served, hf_seq_len in ((OLD_LEN, None), (MAX_POS, OLD_LEN + 1)):
        cfg.max_model_len = served
        params = cfg.rope_parameters()
        assert params["rope_type"] == kind and params["rope_theta"] == THETA
        assert cfg.rope_scaling == params and cfg.rope_theta == THETA
        want_freq, want_scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=hf_seq_len if kind == "longrope" else None)
        freq, scale = rope_inv_freq(params, HEAD_DIM, MAX_POS)
        torch.testing.assert_close(freq, want_freq, rtol=0, atol=0)
        assert scale == pytest.approx(want_scale, rel=1e-12)


@pytest.mark.parametrize("kind, variant", PARAMS)
def test_tables_equal_transformers_rotary_embedding(tmp_path, kind, variant):
    """cos/sin, attention scaling included, at every position served, as LlamaRotaryEmbedding gives them
    (its per-forward dynamic/longrope update included)."""
    raw = {**LLAMA, **spelled(kind, CASES[kind][variant], "t5")}
    cfg, hf = pdserve_config(tmp_path, raw), hf_config(raw)
    cfg.max_model_len = OLD_LEN if kind == "longrope" else MAX_POS   # longrope: the exact (short) range
    rotary = get_rope(cfg)
    hf_rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf)
    positions = torch.arange(cfg.max_model_len)
    want_cos, want_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    rope = rotary.lookup(positions, torch.float32)
    torch.testing.assert_close(rope.cos[:, 0], want_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin[:, 0], want_sin[0], rtol=0, atol=1e-6)


def test_longrope_beyond_the_original_length_uses_the_long_factors_everywhere(tmp_path):
    """vLLM's static choice: a served length past original_max_position_embeddings rotates every position
    with the long factors, which transformers uses once a sequence is that long."""
    raw = {**LLAMA, **spelled("longrope", CASES["longrope"][0], "t5")}
    cfg, hf = pdserve_config(tmp_path, raw), hf_config(raw)
    rotary = get_rope(cfg)   # max_model_len unset: max_position_embeddings
    hf_rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf)
    positions = torch.arange(MAX_POS)
    want_cos, _ = hf_rotary(torch.zeros(1), positions[None])   # a sequence of MAX_POS tokens: long factors
    torch.testing.assert_close(rotary.lookup(positions, torch.float32).cos[:, 0], want_cos[0], rtol=0, atol=1e-6)


def test_per_layer_type_parameters_as_gemma3(tmp_path):
    """transformers-5's per-layer-type rope_parameters, and transformers-4 Gemma 3's rope_theta +
    rope_local_base_freq + rope_scaling (the global layers' only), as Gemma3TextConfig reads them."""
    base = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, head_dim=16, max_position_embeddings=MAX_POS)
    t4 = {**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    hf = transformers.Gemma3TextConfig(**t4)
    t5 = {**base, "rope_parameters": hf.rope_parameters}
    for raw in (t4, t5):
        cfg = ModelConfig(str(tmp_path), "Gemma3ForCausalLM", 128, 64, 2, 4, 2, 16, 128, MAX_POS, True, None, raw)
        for layer_type in ("full_attention", "sliding_attention"):
            ours, theirs = cfg.rope_parameters(layer_type), hf.rope_parameters[layer_type]
            assert {k: ours.get(k) for k in theirs} == theirs
        assert cfg.rope_parameters("sliding_attention")["rope_theta"] == 1e4
        assert get_rope(cfg, "full_attention").scaling["factor"] == 8.0
    with pytest.raises(CheckpointError, match="per layer type"):
        ModelConfig(str(tmp_path), "LlamaForCausalLM", 128, 64, 2, 4, 2, 16, 128, MAX_POS, True, None,
                    t5).rope_theta


@pytest.mark.parametrize("kind", ["default", "longrope"])
def test_partial_rotary_equals_transformers(kind):
    """Phi-3 / Phi-4-mini style: partial_rotary_factor rotates the first dims of each head (rotate-half
    within them), the rest pass through; the frequencies use the rotary dim."""
    keys = dict(rope_parameters={"rope_type": "longrope", "short_factor": SHORT[:6], "long_factor": LONG[:6],
                                 "original_max_position_embeddings": OLD_LEN}) if kind == "longrope" else {}
    hf = transformers.Phi3Config(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=1, max_position_embeddings=MAX_POS,
                                 original_max_position_embeddings=OLD_LEN, partial_rotary_factor=0.75, **keys)
    raw = {"architectures": ["Phi3ForCausalLM"], **hf.to_dict()}
    cfg = ModelConfig("/x", "Phi3ForCausalLM", 128, 64, 1, 4, 2, 16, 128, MAX_POS, False, None, raw, max_model_len=200)
    rotary = get_rope(cfg)
    assert rotary.rotary_dim == 12
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb
    torch.manual_seed(0)
    T = 200
    q, k = torch.randn(1, 4, T, HEAD_DIM), torch.randn(1, 2, T, HEAD_DIM)
    positions = torch.randperm(T)
    cos, sin = Phi3RotaryEmbedding(hf)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = apply_rotary(rotary.lookup(positions, torch.float32), q[0].transpose(0, 1), k[0].transpose(0, 1))
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=0, atol=1e-6)
    assert torch.equal(got_q[..., 12:], q[0].transpose(0, 1)[..., 12:])   # the rest untouched


def test_cpu_backend_rotates_a_partial_head_on_torch_ops(cpu_isa):
    """The CPU rotary kernel rotates whole heads: a partial table's Rope carries no kernel, and the
    CPU layer's result is the torch layer's."""
    from pdserve.backends.cpu.kernels import cpu_ops
    from pdserve.backends.cpu.layers import CpuRotaryEmbedding
    positions = torch.arange(20)
    partial, full = CpuRotaryEmbedding(HEAD_DIM, 64, 1e4, rotary_dim=8), CpuRotaryEmbedding(HEAD_DIM, 64, 1e4)
    assert partial.lookup(positions, torch.float32).rotate is None
    assert full.lookup(positions, torch.float32).rotate is cpu_ops().rotary_embedding
    q, k = torch.randn(20, 4, HEAD_DIM), torch.randn(20, 2, HEAD_DIM)
    want = apply_rotary(RotaryEmbedding(HEAD_DIM, 64, 1e4, rotary_dim=8).lookup(positions, torch.float32), q, k)
    got = apply_rotary(partial.lookup(positions, torch.float32), q.clone(), k.clone())
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_constructor_as_before():
    """RotaryEmbedding(head_dim, max_position, theta, scaling) as model files call it; rotary_dim checked."""
    plain = RotaryEmbedding(HEAD_DIM, 64, 10000.0)
    assert plain.cos.shape == (64, HEAD_DIM) and plain.attention_scaling == 1.0
    yarn = RotaryEmbedding(HEAD_DIM, 64, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 16})
    assert yarn.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert torch.allclose(yarn.cos[0], torch.full((HEAD_DIM,), yarn.attention_scaling))
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(HEAD_DIM, 64, 10000.0, rotary_dim=HEAD_DIM + 2)


@pytest.mark.parametrize("rope, expected", [
    ({"rope_type": "mrope", "mrope_section": [2, 2, 4]}, "'mrope' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs 'low_freq_factor'"),
    ({"rope_type": "linear", "factor": "4"}, "factor must be a number"),
    ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG[:3]}, "long_factor must be 8"),
    ({"rope_type": "default", "partial_rotary_factor": 0.2}, "must be even"),
])
def test_unservable_rope_is_refused_in_one_line(tmp_path, rope, expected):
    with pytest.raises(CheckpointError) as e:
        pdserve_config(tmp_path, {**LLAMA, "rope_parameters": rope})
    assert expected in str(e.value) and "config.json" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------- end to end
E2E = {
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, None),
    "linear": ({"rope_type": "linear", "factor": 4.0}, None),
    # longrope within its original length: exact (the short factors), as --max-model-len makes it
    "longrope": ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                  "original_max_position_embeddings": 256}, 256),
}
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=["torch", *KERNEL_ISAS])
def backend(request):
    """torch's ops (--no-cpu-kernels), then each kernel build this CPU runs."""
    from pdserve.backends.cpu import kernels
    kernels.use_isa(None if request.param == "torch" else request.param)
    yield request.param
    kernels.use_isa(None)


@pytest.mark.parametrize("name", list(E2E))
def test_scaled_rope_checkpoint_generates_as_transformers(make_tiny, backend, name):
    rope, max_model_len = E2E[name]
    path = make_tiny("llama", rope_scaling=rope)
    llm = LLM(path, max_num_batched_tokens=64, max_model_len=max_model_len,
              cpu_kernels=False if backend == "torch" else None)
    prompts = corpus_prompts(llm.tokenizer, lens=[1, 17, 120, 200])
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    prompt = prompts[-1] + outs[-1].token_ids
    ref = hf_logits(path, prompt)
    # every position's logits, whole and in chunks: within tests/engine/test_exact.py's CHUNK_ATOL
    for chunk in (len(prompt), 16):
        torch.testing.assert_close(chunked_logits(llm.engine, prompt, chunk=chunk), ref, atol=3e-4, rtol=0)
