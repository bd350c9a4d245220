"""`python -m tools.quantize_hub`: each format's checkpoint loads in pdserve with the weights of
its -dq reference, bit for bit."""
import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.loader import load_model
from tools.quantize_hub import main


@pytest.mark.parametrize("args, described", [
    (["--format", "gptq", "--bits", "8", "--group", "32", "--asym", "--gptq-v2"], "gptq (int8 group 32 asym)"),
    (["--format", "awq", "--group", "64"], "awq (int4 group 64 asym)"),
    (["--format", "ct", "--bits", "4", "--group", "32", "--asym"], "compressed-tensors (int4 group 32 asym)"),
    (["--format", "ct", "--fp8", "static"], "compressed-tensors (fp8 (served dense))"),
])
def test_each_format_loads_as_its_reference(tiny_llama, tmp_path, args, described):
    dst = str(tmp_path / "q")
    main([tiny_llama, dst, *args])
    cfg = ModelConfig.from_dir(dst)
    assert cfg.quantization.describe() == described
    ours = load_model(cfg, torch.float32, "cpu").state_dict()
    ref = load_model(ModelConfig.from_dir(dst + "-dq"), torch.float32, "cpu").state_dict()
    assert ours.keys() == ref.keys()
    for k in ours:
        assert torch.equal(ours[k], ref[k]), k
    full = load_model(ModelConfig.from_dir(tiny_llama), torch.float32, "cpu").state_dict()
    assert not torch.equal(ours["model.layers.0.mlp.down_proj.weight"], full["model.layers.0.mlp.down_proj.weight"])
