"""quantization_config read at config time as vLLM reads it: what is served, and what is refused in
one line naming the method, before any weight is read (these checkpoints have no weights)."""
import json
import os
import shutil

import pytest

from pdserve import LLM
from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError, ConfigError

CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": 128}}}}


def ct(weights=None, acts=None, fmt="pack-quantized", **extra):
    g = {"targets": ["Linear"], "weights": dict(CT_W4A16["config_groups"]["group_0"]["weights"], **(weights or {})),
         "input_activations": acts}
    return dict(CT_W4A16, format=fmt, config_groups={"group_0": g}, **extra)


@pytest.fixture(scope="module")
def config_only(tiny_qwen2, tmp_path_factory):
    """config_only(quantization_config) -> a checkpoint directory with config.json and tokenizer, no weights."""
    def make(qc):
        d = str(tmp_path_factory.mktemp("qc"))
        for f in os.listdir(tiny_qwen2):
            if not f.endswith(".safetensors"):
                shutil.copy(os.path.join(tiny_qwen2, f), d)
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = qc
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        return d
    return make


@pytest.mark.parametrize("qc, described", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM"},
     "awq (int4 group 128 asym)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}, "gptq (int4 group 128 sym)"),
    ({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False, "desc_act": True},
     "gptq (int8 per channel asym act-order (served dense))"),
    (CT_W4A16, "compressed-tensors (int4 group 128 sym)"),
    (ct({"num_bits": 8, "strategy": "channel", "group_size": None}), "compressed-tensors (int8 per channel sym)"),
    (ct({"num_bits": 8, "type": "float", "strategy": "tensor", "group_size": None},
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}, fmt="float-quantized"),
     "compressed-tensors (fp8 (served dense))"),
])
def test_served_methods_are_detected(config_only, qc, described):
    assert ModelConfig.from_dir(config_only(qc)).quantization.describe() == described


@pytest.mark.parametrize("qc, message", [
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "'bitsandbytes' is not supported"),
    ({"quant_method": "hqq", "nbits": 4}, "'hqq' is not supported"),
    ({"quant_method": "exl2", "bits": 4.5}, "'exl2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "'fp8' is not supported"),
    ({"quant_method": "something-new"}, "'something-new' is not supported (unknown to pdserve)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "AWQ without zero points"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*down": {}}}, "per-module `dynamic`"),
    (ct(acts={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
     "integer weights with quantized activations"),
    (ct({"num_bits": 2}), "2-bit integer weights"),
    (ct({"strategy": "tensor", "group_size": None}), "strategy 'tensor'"),
    (ct(fmt="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    (ct(quantization_status="frozen"), "quantization_status 'frozen'"),
    (ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}), "quantized KV cache"),
    (ct({"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}, fmt="float-quantized"),
     "8-bit float weights with strategy group"),
])
def test_unservable_configs_are_refused_in_one_line(config_only, qc, message):
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_dir(config_only(qc))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "quantization_config quant_method" in str(e.value)


def test_quantization_flag_on_a_quantized_checkpoint_is_refused(config_only):
    path = config_only(CT_W4A16)
    with pytest.raises(ConfigError, match=r"--quantization int8: .* is already quantized \(compressed-tensors"):
        LLM(path, quantization="int8")


def test_compressed_tensors_config_groups_pick_each_linears_scheme(config_only):
    """Mixed precision: the first group whose targets match (a regex, "Linear", or a name) applies."""
    w8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    w4 = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}
    qc = dict(CT_W4A16, config_groups={"attn": {"targets": ["re:.*self_attn.*"], "weights": w8},
                                       "rest": {"targets": ["Linear"], "weights": w4}})
    quant = ModelConfig.from_dir(config_only(qc)).quantization
    assert quant.describe() == "compressed-tensors (int4 group 32 asym, int8 per channel sym)"
    assert quant.scheme_for("model.layers.0.self_attn.o_proj").bits == 8
    assert quant.scheme_for("model.layers.0.mlp.down_proj").bits == 4
