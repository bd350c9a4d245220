"""compressed-tensors checkpoints written by the compressed-tensors package (ModelCompressor) from
known RTN codes: W4A16 group 32/128 sym and asym, W8A16 per channel (pack-quantized and
int-quantized), act-order group (served dense), FP8 W8A8 static and dynamic (served dense)."""
import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.loader import load_model
from tests.quantization.checks import assert_engine_matches_transformers, assert_loaded_exactly
from tools.quantize_hub import make_compressed, make_legacy_act_order

INT = dict(type="int")
FP8 = dict(num_bits=8, type="float", symmetric=True)
# name: weights, input activations, format (None: the package's choice)
CASES = {
    "w4a16-g32-sym": (dict(INT, num_bits=4, symmetric=True, strategy="group", group_size=32), None, None),
    "w4a16-g128-asym": (dict(INT, num_bits=4, symmetric=False, strategy="group", group_size=128), None, None),
    "w8a16-channel": (dict(INT, num_bits=8, symmetric=True, strategy="channel"), None, None),
    "w8a16-g32-asym-int-quantized": (dict(INT, num_bits=8, symmetric=False, strategy="group", group_size=32),
                                     None, "int-quantized"),
    "w4a16-g32-actorder-weight": (dict(INT, num_bits=4, symmetric=True, strategy="group", group_size=32,
                                       actorder="weight"), None, None),
    "fp8-static": (dict(FP8, strategy="tensor"), dict(FP8, strategy="tensor", dynamic=False), None),
    "fp8-dynamic": (dict(FP8, strategy="channel"), dict(FP8, strategy="token", dynamic=True), None),
}


@pytest.fixture(scope="module")
def base(make_tiny):
    return make_tiny("qwen2", hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def checkpoints(base, tmp_path_factory):
    out = {}
    for name, (w, a, fmt) in CASES.items():
        dst = str(tmp_path_factory.mktemp("ct") / name)
        out[name] = dst, make_compressed(base, dst, w, a, fmt)
    dst = str(tmp_path_factory.mktemp("ct") / "w4a16-g32-actorder-group")
    out["w4a16-g32-actorder-group"] = dst, make_legacy_act_order(base, dst)
    return out


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("fp8")])
def test_int_weights_are_the_dequantized_codes(checkpoints, name):
    path, codes = checkpoints[name]
    assert_loaded_exactly(path, codes)


def test_legacy_act_order_group_is_served_dense_exactly(checkpoints):
    path, codes = checkpoints["w4a16-g32-actorder-group"]
    assert_loaded_exactly(path, codes, dense=True)


@pytest.mark.parametrize("name", ["fp8-static", "fp8-dynamic"])
def test_fp8_weights_are_served_dense_exactly(checkpoints, name):
    path, codes = checkpoints[name]
    model = load_model(ModelConfig.from_dir(path), torch.float32, "cpu")
    o = model.get_submodule("model.layers.1.self_attn.o_proj")
    q, s = codes["model.layers.1.self_attn.o_proj"]
    assert q.dtype == torch.float8_e4m3fn and not hasattr(o, "quant")
    assert torch.equal(o.weight, q.float() * s)
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj").weight
    want = torch.cat([codes[f"model.layers.0.self_attn.{p}_proj"][0].float() * codes[f"model.layers.0.self_attn.{p}_proj"][1]
                      for p in "qkv"])
    assert torch.equal(qkv, want)


@pytest.mark.parametrize("name", ["w4a16-g32-sym", "w8a16-channel"])
def test_torch_path_matches_transformers_loading_the_compressed_checkpoint(checkpoints, name):
    """transformers (compressed-tensors' own decompression) runs the compressed checkpoint itself."""
    path, _ = checkpoints[name]
    assert_engine_matches_transformers(path, path, cpu_kernels=False)


@pytest.mark.parametrize("name", ["w4a16-g128-asym", "w8a16-g32-asym-int-quantized", "w4a16-g32-actorder-group",
                                  "fp8-static", "fp8-dynamic"])
def test_torch_path_matches_transformers_on_the_dequantized_weights(checkpoints, name):
    path, _ = checkpoints[name]
    assert_engine_matches_transformers(path, path + "-dq", cpu_kernels=False)


def test_fp8_reference_is_transformers_decompressed_path(checkpoints):
    """transformers' run_compressed=False load of the FP8 checkpoint (weights decompressed,
    activations unquantized) holds exactly the dense weights the -dq reference holds."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    path, _ = checkpoints["fp8-static"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(run_compressed=False))
    ref = AutoModelForCausalLM.from_pretrained(path + "-dq", dtype=torch.float32)
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ref(ids).logits)


def test_cpu_kernels_match_transformers(checkpoints, cpu_isa):
    for name in ("w4a16-g32-sym", "w4a16-g128-asym", "fp8-dynamic"):
        path, _ = checkpoints[name]
        assert_engine_matches_transformers(path, path + "-dq")
