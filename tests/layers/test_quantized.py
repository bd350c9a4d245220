"""The group form of quantized weights (layers/quantized.py) and how the loader takes it: the
dense weight is the dequantized codes, and each linear (a merged one: its shards in order) keeps
its codes for the backends."""
import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.layers.quantized import GroupQuantized, QuantFormatError, concat, quantized_linears
from pdserve.loader import load_model, safetensors_tensors


def rtn(w: torch.Tensor, bits: int, group: int) -> GroupQuantized:
    """Round-to-nearest codes of w: asymmetric 4-bit or symmetric 8-bit, per group."""
    N, K = w.shape
    g = w.float().view(N, K // group, group)
    if bits == 4:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        return GroupQuantized(q.view(N, K), scale, lo, group, 4)
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-8)
    q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return GroupQuantized(q.view(N, K), scale, None, group, 8)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_is_codes_times_scale_plus_offset(bits):
    w = torch.randn(6, 64)
    gq = rtn(w, bits, 32)
    want = torch.empty(6, 64)
    for n in range(6):
        for k in range(64):
            g = k // 32
            want[n, k] = gq.q[n, k].float() * gq.scale[n, g] + (0 if gq.offset is None else gq.offset[n, g])
    assert torch.allclose(gq.dequantize(), want, atol=1e-6)
    assert (gq.dequantize() - w).abs().max() <= gq.scale.max() * 0.51 + 1e-6


def test_bad_forms_are_refused():
    q4 = torch.zeros(4, 64, dtype=torch.uint8)
    s = torch.ones(4, 2)
    with pytest.raises(QuantFormatError, match="need an offset"):
        GroupQuantized(q4, s, None, 32, 4)
    with pytest.raises(QuantFormatError, match="does not divide"):
        GroupQuantized(q4, torch.ones(4, 2), torch.zeros(4, 2), 48, 4)
    with pytest.raises(QuantFormatError, match="must be torch.int8"):
        GroupQuantized(q4, s, None, 32, 8)
    with pytest.raises(QuantFormatError, match="scale must be fp32"):
        GroupQuantized(q4, torch.ones(4, 3), torch.zeros(4, 2), 32, 4)
    with pytest.raises(QuantFormatError, match="disagree"):
        concat([rtn(torch.randn(4, 64), 4, 32), rtn(torch.randn(4, 64), 4, 16)])


def _quantized_source(path, bits, group, skip=()):
    for file, name, t in safetensors_tensors(path):
        quantize = name.endswith("_proj.weight") and not any(s in name for s in skip)
        yield file, name, rtn(t, bits, group) if quantize else t


@pytest.mark.parametrize("bits", [4, 8])
def test_loader_fills_dequantized_weights_and_keeps_codes(tiny_qwen2, bits):
    cfg = ModelConfig.from_dir(str(tiny_qwen2))
    model = load_model(cfg, torch.float32, "cpu", _quantized_source(str(tiny_qwen2), bits, 16))
    quant = quantized_linears(model)
    attn = model.get_submodule("model.layers.0.self_attn")
    assert set(quant) >= {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj",
                          "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"}
    assert "lm_head" not in quant
    # q, k, v in their rows, in order; the dense weight is what the codes stand for
    assert attn.qkv_proj.quant.shape == tuple(attn.qkv_proj.weight.shape)
    assert torch.equal(attn.qkv_proj.weight, attn.qkv_proj.quant.dequantize())
    full = load_model(cfg, torch.float32, "cpu")
    err = (attn.qkv_proj.weight - full.get_submodule("model.layers.0.self_attn").qkv_proj.weight).abs().max()
    assert 0 < err <= attn.qkv_proj.quant.scale.max() * 0.51


def test_a_merged_linear_partly_quantized_is_refused(tiny_qwen2):
    cfg = ModelConfig.from_dir(str(tiny_qwen2))
    with pytest.raises(CheckpointError, match="qkv_proj mixes quantized and full-precision shards"):
        load_model(cfg, torch.float32, "cpu", _quantized_source(str(tiny_qwen2), 8, 16, skip=("k_proj",)))
