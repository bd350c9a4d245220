"""Quantized GGUF files: every type's codes, scales and offsets stand for exactly the weights
`gguf.quants.dequantize` gives, the linears keep them (module.quant), and the model's logits equal
transformers loading the same file (which dequantizes) within fp32 tolerance, greedy tokens equal.
Q8_0 is made by llama.cpp's converter, the rest by its llama-quantize."""
import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.gguf.quants import DECODERS, FORMS
from pdserve.gguf.reader import GGUFFile
from pdserve.gguf.tensors import LINEARS, hf_name
from pdserve.layers.quantized import quantized_linears
from pdserve.loader import load_model
from tests.gguf.conftest import WIDE
from tests.helpers import chunked_logits, corpus_prompts

# llama-quantize's file type -> the type its linears are mostly in (K_M files mix in Q6_K)
FILE_TYPES = {"Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K, "Q6_K": T.Q6_K}
# The 256-wide models' fp32 sums (512 products) run in another order than transformers': measured up
# to 1.03e-4 on logits of magnitude ~2-8 with dense weights, where the 64-wide F32 tests hold 1e-4.
# The CPU kernels' group codes sum x*q per group, then scale and add offset * sum(x): another
# order again, measured up to 3.4e-4 on the same logits, so a relative term on top. A wrong scale,
# offset or code would move logits by 1e-2 and more.
ATOL, RTOL = 3e-4, 1e-4


@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda t: t.name)
def test_decoders_equal_gguf_dequantize_on_random_blocks(qtype):
    """Every bit pattern of codes and scales (random bytes; finite f16 d/m), not only what a quantizer makes."""
    rng = np.random.default_rng(int(qtype))
    rows, cols = 6, 512
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    halves = (rng.standard_normal((rows, cols // block, 2)) * 0.02).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        raw[..., 208:210] = halves[..., :2]
    else:
        n = 4 if qtype in (T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K) else 2   # bytes of f16 d (and m / dmin)
        raw[..., :n] = halves[..., :n]
    raw = raw.reshape(rows, -1)
    gq = DECODERS[qtype][0](raw, rows, cols)
    assert (gq.bits, gq.group_size, gq.offset is not None) == FORMS[qtype]
    assert np.array_equal(gq.dequantize().numpy(), dequantize(raw, qtype))


def check_file(model_dir: str, gguf: str, main_type: T, arch: str) -> None:
    f = GGUFFile(gguf)
    linear_types = set()
    for name, t in f.tensors.items():
        _, key = hf_name(name, f.architecture)
        if key in LINEARS and t.tensor_type in DECODERS:
            linear_types.add(t.tensor_type)
            shape = tuple(int(x) for x in reversed(t.shape))
            gq = DECODERS[t.tensor_type][0](np.asarray(t.data), *shape)
            assert (gq.bits, gq.group_size, gq.offset is not None) == FORMS[t.tensor_type]
            assert np.array_equal(gq.dequantize().numpy(), dequantize(np.asarray(t.data), t.tensor_type)), name
    assert main_type in linear_types, f"{gguf}: linears in {sorted(x.name for x in linear_types)}"

    cfg = ModelConfig.from_dir(gguf)
    model = load_model(cfg, torch.float32, "cpu")
    quant = quantized_linears(model)
    # qkv, o, gate_up, down in every layer: all kept quantized (a merged linear whose shards' types
    # differ, as Q4_K_M's q/k Q4_K and v Q6_K, in the widest of their forms)
    assert len(quant) == 4 * cfg.num_layers
    for module_name, gq in quant.items():   # the dense weight the torch path multiplies is the codes'
        assert torch.equal(model.get_submodule(module_name).weight, gq.dequantize())

    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                               dtype=torch.float32).eval()
    llm = LLM(gguf, dtype="float32", block_size=16)
    with torch.no_grad():
        for prompt in corpus_prompts(llm.tokenizer, lens=[1, 17, 120]):
            ours = chunked_logits(llm.engine, prompt, chunk=len(prompt))
            torch.testing.assert_close(ours, ref(torch.tensor([prompt]), use_cache=False).logits[0], atol=ATOL, rtol=RTOL)
        prompts = corpus_prompts(llm.tokenizer, lens=[5, 40], offset=500)
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt])
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
            assert out.token_ids == want


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q8_0_from_the_converter(make_gguf, arch):
    model_dir, gguf = make_gguf(arch, "q8_0", **WIDE)
    check_file(model_dir, gguf, T.Q8_0, arch)


def test_q8_0_phi3_fused_linears(make_tiny, tmp_path_factory):
    # Phi-3's q/k/v and gate/up are one tensor each in its GGUF, kept quantized whole
    from tests.gguf.test_gguf_model import phi4_style
    model_dir, gguf = phi4_style(make_tiny("phi3", **WIDE), tmp_path_factory, "q8_0")
    check_file(model_dir, gguf, T.Q8_0, "phi3")


@pytest.mark.parametrize("file_type", list(FILE_TYPES))
def test_llama_quantize_types(make_quantized, file_type):
    # llama: its q/k rows were permuted by the converter, and must come back whole with their scales
    model_dir, _, gguf = make_quantized("llama", file_type)
    check_file(model_dir, gguf, FILE_TYPES[file_type], "llama")


def test_q4_k_m_qwen2(make_quantized):
    model_dir, _, gguf = make_quantized("qwen2", "Q4_K_M")
    check_file(model_dir, gguf, T.Q4_K, "qwen2")


def test_a_merged_linear_with_a_dense_shard_loads_dense(make_gguf, tmp_path):
    """Layer 0's v in F32 among Q8_0 q/k (as a hand-made file may have): that layer's qkv is dense,
    the rest stay quantized, and the logits still equal transformers on the same file."""
    from tests.gguf.test_gguf_errors import rewrite
    _, q8 = make_gguf("qwen2", "q8_0", **WIDE)
    gguf = rewrite(q8, str(tmp_path / "mixed.gguf"), retype={"blk.0.attn_v.weight": T.F32})
    model = load_model(ModelConfig.from_dir(gguf), torch.float32, "cpu")
    quant = quantized_linears(model)
    assert "model.layers.0.self_attn.qkv_proj" not in quant and "model.layers.1.self_attn.qkv_proj" in quant
    assert "model.layers.0.mlp.gate_up_proj" in quant
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="mixed.gguf", dtype=torch.float32).eval()
    llm = LLM(gguf, dtype="float32", block_size=16)
    prompt = corpus_prompts(llm.tokenizer, lens=[60])[0]
    with torch.no_grad():
        torch.testing.assert_close(chunked_logits(llm.engine, prompt, chunk=len(prompt)),
                                   ref(torch.tensor([prompt]), use_cache=False).logits[0], atol=ATOL, rtol=RTOL)
