"""From a format's codes, zero points and scales to the group form (layers/quantized.py), or to the
exact dense weight where the groups are not contiguous (act-order g_idx)."""
import torch

from pdserve.layers.quantized import GroupQuantized


def group_form(u: torch.Tensor, zero: torch.Tensor | None, scale: torch.Tensor, bits: int) -> GroupQuantized:
    """w[n, k] = (u[n, k] - zero[n, g]) * scale[n, g] with u the unsigned codes (N, K) in
    0..2^bits-1 and zero/scale (N, G), groups contiguous (G divides K); zero None: symmetric
    (zero = 2^(bits-1)). 4-bit codes stay unsigned with offset = -zero * scale; 8-bit ones are
    recentred to int8 (u - 128) with offset (128 - zero) * scale, none where every zero is 128."""
    N, K = u.shape
    mid = 1 << (bits - 1)
    scale = scale.float()
    zero = torch.full_like(scale, mid) if zero is None else zero.float()
    if bits == 4:
        return GroupQuantized(u.to(torch.uint8), scale, -zero * scale, K // scale.shape[1], 4)
    offset = None if bool((zero == mid).all()) else (mid - zero) * scale
    return GroupQuantized((u.to(torch.int16) - mid).to(torch.int8), scale, offset, K // scale.shape[1], 8)


def act_order_dense(u: torch.Tensor, zero: torch.Tensor | None, scale: torch.Tensor, bits: int,
                    g_idx: torch.Tensor) -> torch.Tensor:
    """The (N, K) fp32 weight of codes whose group is g_idx[k] (act-order), computed as the group
    form computes it (codes * scale + offset, in fp32), so it is exact for the stored values."""
    gq = group_form(u, zero, scale, bits)
    cols = g_idx.long()
    w = gq.q.float() * gq.scale[:, cols]
    if gq.offset is not None:
        w += gq.offset[:, cols]
    return w


def trivial_g_idx(g_idx: torch.Tensor, K: int, group: int) -> bool:
    return tuple(g_idx.shape) == (K,) and torch.equal(g_idx.long(), torch.arange(K) // group)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes packed into int32 words, lowest bits first, consecutive along `dim` (GPTQ's layout:
    dim 0 for qweight, 1 for qzeros): (R, C) int32 -> int32 codes with that dim multiplied by 32 / bits."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:
        vals = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return vals.reshape(packed.shape[0] * per, packed.shape[1])
    vals = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0], packed.shape[1] * per)
