"""GPTQ checkpoints (AutoGPTQ / GPTQModel layout) made here by RTN and GPTQ's published packing:
4/8-bit, group sizes incl. per channel, sym and asym, v1 (z - 1) and v2 zeros, act-order."""
import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.loader import load_model
from tools import quantize_hub as formats
from tests.quantization.checks import assert_engine_matches_transformers, assert_loaded_exactly

# name: bits, group, sym, checkpoint format, act-order
CASES = {
    "int4-g32-sym": (4, 32, True, "gptq", False),
    "int4-g128-asym": (4, 128, False, "gptq", False),
    "int4-g32-asym-v2": (4, 32, False, "gptq_v2", False),
    "int8-channel-sym": (8, -1, True, "gptq", False),
    "int8-g32-asym": (8, 32, False, "gptq", False),
    "int4-g32-actorder": (4, 32, False, "gptq", True),
}


@pytest.fixture(scope="module")
def base(make_tiny):
    return make_tiny("qwen2", hidden_size=128, intermediate_size=256)


def make_gptq(base: str, dst: str, bits, group, sym, fmt, act_order, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
          "checkpoint_format": fmt, "damp_percent": 0.01, "true_sequential": True}

    def quantize(module, w):
        perm = torch.randperm(w.shape[1], generator=gen) if act_order else None
        # v1 stores z - 1: a zero of 0 would wrap (see test_v1_zero_of_zero_reads_as_vllm_does)
        return formats.rtn(w, bits, group, sym, perm, min_zero=1 if fmt == "gptq" else 0)

    return formats.quantize_checkpoint(base, dst, qc, quantize, lambda c: formats.gptq_tensors(c, fmt == "gptq"))


@pytest.fixture(scope="module")
def checkpoints(base, tmp_path_factory):
    out = {}
    for name, case in CASES.items():
        dst = str(tmp_path_factory.mktemp("gptq") / name)
        out[name] = dst, make_gptq(base, dst, *case)
    return out


@pytest.mark.parametrize("name", CASES)
def test_weights_are_the_dequantized_codes(checkpoints, name):
    path, codes = checkpoints[name]
    assert_loaded_exactly(path, codes, dense=CASES[name][4])


def test_codes_really_differ_from_the_full_precision_weights(base, checkpoints):
    path, codes = checkpoints["int4-g32-sym"]
    full = load_model(ModelConfig.from_dir(base), torch.float32, "cpu")
    w = full.get_submodule("model.layers.0.self_attn.o_proj").weight
    dq = codes["model.layers.0.self_attn.o_proj"].w_dq
    assert 0 < (w - dq).abs().max() < 0.5 * codes["model.layers.0.self_attn.o_proj"].s.max() + 1e-6


@pytest.mark.parametrize("name", ["int4-g32-sym", "int4-g128-asym", "int8-channel-sym", "int4-g32-actorder"])
def test_torch_path_matches_transformers_on_the_dequantized_weights(checkpoints, name):
    path, _ = checkpoints[name]
    assert_engine_matches_transformers(path, path + "-dq", cpu_kernels=False)


def test_cpu_kernels_match_transformers(checkpoints, cpu_isa):
    for name in ("int4-g32-asym-v2", "int8-g32-asym"):
        path, _ = checkpoints[name]
        assert_engine_matches_transformers(path, path + "-dq")


def test_v1_zero_of_zero_reads_as_vllm_does(base, tmp_path):
    """v1 stores z - 1 in `bits` bits: a quantizer's z = 0 is stored as 15, which vLLM's and the
    exllama kernels' +1 reads as 16; pdserve reads the same number."""
    def quantize(module, w):
        c = formats.rtn(w, 4, 32, False, min_zero=1)
        c.z[:, 0] = 0                    # as a quantizer writes a group whose minimum is >= 0
        return c

    def pack(c):
        t = formats.gptq_tensors(c, v1=True)
        c.z[:, 0] = 16                   # what the stored 15 stands for
        return t

    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False}
    dst = str(tmp_path / "z0")
    codes = formats.quantize_checkpoint(base, dst, qc, quantize, pack)
    assert_loaded_exactly(dst, codes)


def test_a_g_idx_that_reorders_without_desc_act_is_refused(base, tmp_path):
    dst = str(tmp_path / "bad")
    make_gptq(base, dst, 4, 32, False, "gptq", True)
    import json
    with open(f"{dst}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"]["desc_act"] = False
    with open(f"{dst}/config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match="g_idx reorders the groups but desc_act is false"):
        load_model(ModelConfig.from_dir(dst), torch.float32, "cpu")


def test_a_missing_part_is_named(base, tmp_path):
    dst = str(tmp_path / "missing")
    make_gptq(base, dst, 4, 32, True, "gptq", False)
    tensors = formats.read_tensors(dst)
    del tensors["model.layers.1.mlp.down_proj.scales"]
    import os
    for f in os.listdir(dst):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(dst, f))
    formats.write_sharded(dst, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.down_proj.scales'"):
        load_model(ModelConfig.from_dir(dst), torch.float32, "cpu")


@pytest.mark.parametrize("value", [0.0, 0.5])
def test_extra_zero_biases_are_skipped_as_vllm_does(make_tiny, tmp_path, value):
    """AutoGPTQ writes a bias for every quantized linear, zeros where the model has none (Llama):
    those are skipped; a non-zero one is a bias the model cannot hold, refused."""
    base = make_tiny("llama")
    dst = str(tmp_path / "biased")
    codes = make_gptq(base, dst, 4, 32, True, "gptq", False)
    tensors = formats.read_tensors(dst)
    for module, c in codes.items():
        tensors[f"{module}.bias"] = torch.full((c.u.shape[0],), value, dtype=torch.float16)
    formats.write_sharded(dst, tensors)
    if value:
        with pytest.raises(CheckpointError, match="unexpected tensor .*_proj.bias"):
            load_model(ModelConfig.from_dir(dst), torch.float32, "cpu")
    else:
        assert_loaded_exactly(dst, codes)


def test_bf16_serving_rounds_the_dequantized_weights_once(checkpoints):
    """--dtype bfloat16: the linears hold W_dq rounded to bf16 once (the codes stay exact in .quant)."""
    path, codes = checkpoints["int4-g128-asym"]
    model = load_model(ModelConfig.from_dir(path), torch.bfloat16, "cpu")
    o = model.get_submodule("model.layers.0.self_attn.o_proj")
    c = codes["model.layers.0.self_attn.o_proj"]
    assert o.weight.dtype == torch.bfloat16 and torch.equal(o.weight, c.w_dq.bfloat16())
    assert torch.equal(o.quant.dequantize(), c.w_dq)
