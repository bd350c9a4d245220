"""GGUF's block formats decoded into pdserve's group form (layers/quantized.py), with numpy vector ops.

Each decoder takes a tensor's raw blocks as llama.cpp stores them (one uint8 row of blocks per
output row, ggml-common.h's layouts) and returns its codes, per-group scales and offsets such that
q * scale + offset is, bit for bit, what `gguf.quants.dequantize` computes (tests/gguf/ check every
type): the scale of a K-quant sub-block is the product d * sc that llama.cpp forms, and an offset
is the negated d * m (or Q4_0's -8 d), so the one multiply-add reproduces its arithmetic.

    Q8_0  34-byte blocks of 32: f16 d, 32 int8         w = d q            8-bit, group 32
    Q4_0  18-byte blocks of 32: f16 d, 16 nibble pairs w = d (q - 8)      4-bit, group 32, offset -8 d
    Q4_1  20-byte blocks of 32: f16 d, f16 m, nibbles  w = d q + m        4-bit, group 32, offset m
    Q5_0  22-byte blocks of 32: f16 d, 32 fifth bits, nibbles  w = d (q - 16)   8-bit codes -16..15, group 32
    Q5_1  24-byte blocks of 32: f16 d, f16 m, fifth bits, nibbles  w = d q + m  8-bit codes 0..31, offset m
    Q4_K  144-byte super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for
          8 sub-blocks of 32, 128 bytes of nibbles    w = d sc q - dmin m 4-bit, group 32
          (llama-quantize's K_M files fall back to Q5_0/Q5_1 for rows not a multiple of 256)
    Q5_K  176 bytes: Q4_K's plus 32 bytes of fifth bits   codes 0..31     8-bit, group 32
    Q6_K  210 bytes: 128 low-nibble, 64 two-bit bytes, 16 int8 scales, f16 d
          w = d sc (q - 32)                                codes -32..31  8-bit, group 16
"""
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import Q4_K as _Q4K

from pdserve.layers.quantized import GroupQuantized

QK_K = 256


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...,) fp32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """Bytes in runs of `span`: each run's low nibbles are `span` elements, then its high nibbles."""
    runs = qs.reshape(*qs.shape[:-1], -1, 1, span)
    out = (runs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & np.uint8(0x0F)
    return out.reshape(*qs.shape[:-1], -1)


def _blocks(raw: np.ndarray, qtype: T, rows: int, cols: int) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    return raw.reshape(rows, cols // block, size)


def _group(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, rows: int, cols: int,
           group: int, bits: int) -> GroupQuantized:
    groups = cols // group
    return GroupQuantized(torch.from_numpy(np.ascontiguousarray(q.reshape(rows, cols))),
                          torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, groups), dtype=np.float32)),
                          None if offset is None else
                          torch.from_numpy(np.ascontiguousarray(offset.reshape(rows, groups), dtype=np.float32)),
                          group, bits)


def q8_0(raw, rows, cols):
    b = _blocks(raw, T.Q8_0, rows, cols)
    return _group(b[..., 2:].view(np.int8), _f16(b[..., :2]), None, rows, cols, 32, 8)


def q4_0(raw, rows, cols):
    b = _blocks(raw, T.Q4_0, rows, cols)
    d = _f16(b[..., :2])
    return _group(_nibbles(b[..., 2:], 16), d, -8 * d, rows, cols, 32, 4)


def q4_1(raw, rows, cols):
    b = _blocks(raw, T.Q4_1, rows, cols)
    return _group(_nibbles(b[..., 4:], 16), _f16(b[..., :2]), _f16(b[..., 2:4]), rows, cols, 32, 4)


def _fifth_bits(b: np.ndarray, at: int) -> np.ndarray:
    """Q5_0/Q5_1: the block's 32 fifth bits, a little-endian uint32 at byte `at` (bit j: element j)."""
    qh = np.ascontiguousarray(b[..., at:at + 4]).view("<u4")
    return ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)


def q5_0(raw, rows, cols):
    b = _blocks(raw, T.Q5_0, rows, cols)
    q = (_nibbles(b[..., 6:], 16) | (_fifth_bits(b, 2) << np.uint8(4))).astype(np.int8) - np.int8(16)
    return _group(q, _f16(b[..., :2]), None, rows, cols, 32, 8)


def q5_1(raw, rows, cols):
    b = _blocks(raw, T.Q5_1, rows, cols)
    q = (_nibbles(b[..., 8:], 16) | (_fifth_bits(b, 4) << np.uint8(4))).view(np.int8)
    return _group(q, _f16(b[..., :2]), _f16(b[..., 2:4]), rows, cols, 32, 8)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks (n, sb, bytes) -> per-sub-block scale d*sc and offset -(dmin*m), (n, sb, 8)."""
    n, sb = b.shape[:2]
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, m = _Q4K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(n * sb, 12))
    return d * sc.reshape(n, sb, 8).astype(np.float32), -(dmin * m.reshape(n, sb, 8).astype(np.float32))


def q4_k(raw, rows, cols):
    b = _blocks(raw, T.Q4_K, rows, cols)
    scale, offset = _k_scales(b)
    return _group(_nibbles(b[..., 16:], 32), scale, offset, rows, cols, 32, 4)


def q5_k(raw, rows, cols):
    b = _blocks(raw, T.Q5_K, rows, cols)
    scale, offset = _k_scales(b)
    low = _nibbles(b[..., 48:], 32).reshape(*b.shape[:2], 8, 32)
    # bit j of qh's 32 bytes is the fifth bit of sub-block j
    qh = (b[..., None, 16:48] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & np.uint8(1)
    return _group((low | (qh << np.uint8(4))).view(np.int8), scale, offset, rows, cols, 32, 8)


def q6_k(raw, rows, cols):
    b = _blocks(raw, T.Q6_K, rows, cols)
    n, sb = b.shape[:2]
    # two halves of 128 elements: ql 64 bytes each (low nibbles, then high), qh 32 bytes each
    # (bit pairs 0-1, 2-3, 4-5, 6-7 for the half's four runs of 32)
    low = _nibbles(b[..., :128].reshape(n, sb, 2, 64), 64).reshape(n, sb, 2, 4, 32)
    qh = b[..., 128:192].reshape(n, sb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    q = (low | ((qh & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    scale = _f16(b[..., 208:210])[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)
    return _group(q, scale, None, rows, cols, 16, 8)


# GGUF type -> (decoder, what it becomes, for the load summary)
DECODERS = {
    T.Q8_0: (q8_0, "int8 group 32"),
    T.Q4_0: (q4_0, "int4 group 32 + offset"),
    T.Q4_1: (q4_1, "int4 group 32 + offset"),
    T.Q5_0: (q5_0, "8-bit codes -16..15 group 32"),
    T.Q5_1: (q5_1, "8-bit codes 0..31 group 32 + offset"),
    T.Q4_K: (q4_k, "int4 group 32 + offset"),
    T.Q5_K: (q5_k, "8-bit codes 0..31 group 32 + offset"),
    T.Q6_K: (q6_k, "int8 group 16"),
}
DENSE = (T.F32, T.F16, T.BF16)
# type -> (bits, group size, has an offset) of its group form
FORMS = {T.Q8_0: (8, 32, False), T.Q4_0: (4, 32, True), T.Q4_1: (4, 32, True), T.Q5_0: (8, 32, False),
         T.Q5_1: (8, 32, True), T.Q4_K: (4, 32, True), T.Q5_K: (8, 32, True), T.Q6_K: (8, 16, False)}
