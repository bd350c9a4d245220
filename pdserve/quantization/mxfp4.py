"""MXFP4 (OCP microscaling FP4), as gpt-oss ships its experts (quantization_config quant_method
"mxfp4"): each run of 32 weights along the input dimension is one block of 16 bytes, two FP4 e2m1
values a byte (the even weight in the low nibble), and one e8m0 scale byte s: weight = fp4 * 2^(s - 127).

The checkpoint's `<proj>_blocks` are uint8 (E, out, in / 32, 16) and `<proj>_scales` uint8
(E, out, in / 32). FP4 values are a fixed table of 16 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives), not affine integer codes, so they do not fit the group form of layers/quantized.py:
pdserve keeps the blocks and scales as they are and decodes an expert's rows where it multiplies
them (the torch path: the selected experts of a step; the CPU kernel: a row at a time, moe_cpu.cpp).

quantize() writes that layout from dense weights (the rounding of the gpt-oss conversion and of
triton_kernels' downcast_to_mxfp_torch: the block's scale is its largest magnitude / 6 rounded up
to a power of two, each value then rounded to the nearest FP4 value, ties away from zero); tools use it to
make test checkpoints, pdserve serves only what the checkpoint holds."""
import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32           # weights per scale
E8M0_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., rows, n / 32, 16) uint8 blocks and (..., rows, n / 32) uint8 scales -> (..., rows, n) weights."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = table[(blocks & 15).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)              # (..., n / 32, 32)
    # scale * value is exact in fp32 (a power of two times a 2-bit mantissa), as in bf16
    values = torch.ldexp(values, scales.long()[..., None] - E8M0_BIAS)
    return values.flatten(-2).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense weights (..., n), n a multiple of 32, -> (blocks, scales) as the checkpoint stores them."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"the input size {w.shape[-1]} is no multiple of {BLOCK}")
    x = w.float().reshape(*w.shape[:-1], -1, BLOCK)
    # the scale: max |w| / 6 rounded up to a power of two (on the fp32 bits: carry any mantissa into
    # the exponent), so that every value of the block fits in FP4's range
    bits = (x.abs().amax(-1, keepdim=True) / 6.0).view(torch.int32)
    exponent = ((bits + 0x7FFFFF) & 0x7F800000) >> 23                # biased, 0..255
    scale = (exponent << 23).view(torch.float32)
    q = torch.where(scale == 0, torch.zeros_like(x), x / torch.where(scale == 0, torch.ones_like(scale), scale))
    # the nearest FP4 magnitude, a tie to the larger one, past 6 saturated: the code counts the
    # midpoints between neighbouring values that |q| reaches
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    code = (q.abs()[..., None] >= midpoints).sum(-1)
    code = code | (torch.signbit(q).long() << 3)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), exponent.squeeze(-1).to(torch.uint8).contiguous()
