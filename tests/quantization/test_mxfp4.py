"""MXFP4 (gpt-oss's experts): pdserve's decode equals transformers' own dequantization bit for bit
(every byte, every scale), quantize() rounds as the published conversion does (scale rounded up to
a power of two, ties away from zero, saturation at 6), and a checkpoint's config is read as mxfp4
for gpt-oss only."""
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pdserve.errors import CheckpointError
from pdserve.quantization.config import read_quantization
from pdserve.quantization.mxfp4 import dequantize, quantize


def test_decode_equals_transformers_bit_for_bit():
    torch.manual_seed(0)
    E, rows, n = 3, 40, 64
    blocks = torch.randint(0, 256, (E, rows, n // 32, 16), dtype=torch.uint8)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)        # every byte
    scales = torch.randint(100, 150, (E, rows, n // 32), dtype=torch.uint8)
    scales.view(-1)[:6] = torch.tensor([0, 1, 126, 127, 128, 254])      # scales at both ends
    for dtype in (torch.float32, torch.bfloat16):
        # transformers returns the (E, in, out) transpose of the (E, out, in) weights
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        got = dequantize(blocks, scales, dtype)
        assert got.dtype == dtype and got.shape == (E, rows, n)
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.contiguous().view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_quantize_rounds_as_the_published_conversion():
    # a block whose largest magnitude is 6: scale 2^0; values at and beside each midpoint
    values = torch.tensor([6.0, 0.25, 0.24, 0.75, 0.74, 1.25, 1.75, 2.5, 3.5, 5.0, 4.9, -0.25, -0.1, -6.0, 0.0, 1.0]
                          + [0.0] * 16)
    blocks, scales = quantize(values[None])
    assert scales.tolist() == [[127]]
    got = dequantize(blocks, scales)[0]
    want = [6.0, 0.5, 0.0, 1.0, 0.5, 1.5, 2.0, 3.0, 4.0, 6.0, 4.0, -0.5, -0.0, -6.0, 0.0, 1.0] + [0.0] * 16
    assert got.tolist() == want
    assert torch.signbit(got[12])   # -0.1 keeps its sign: code 8
    # the scale: max / 6 rounded up to a power of two; values past 6 x scale cannot occur, zeros stay zero
    w = torch.randn(5, 4, 96) * torch.tensor([1e-3, 1.0, 7.0, 300.0])[None, :, None]
    blocks, scales = quantize(w)
    assert blocks.shape == (5, 4, 3, 16) and scales.shape == (5, 4, 3)
    amax = w.view(5, 4, 3, 32).abs().amax(-1)
    scale = torch.ldexp(torch.ones(scales.shape), scales.long() - 127)
    assert (amax <= 6 * scale).all() and (amax > 3 * scale).all()
    assert (dequantize(blocks, scales) - w).abs().view(5, 4, 3, 32).amax(-1).le(scale).all()
    assert torch.equal(dequantize(*quantize(torch.zeros(2, 32))), torch.zeros(2, 32))


def test_config_is_read_for_gpt_oss_only():
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    q = read_quantization({"architectures": ["GptOssForCausalLM"], "quantization_config": qc}, "config.json")
    assert q.method == "mxfp4" and "mxfp4" in q.describe()
    with pytest.raises(CheckpointError, match="GptOssForCausalLM"):
        read_quantization({"architectures": ["LlamaForCausalLM"], "quantization_config": qc}, "config.json")
