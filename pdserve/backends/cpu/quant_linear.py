"""Linears whose weights stay group-quantized in memory (layers/quantized.py's form: w = q * scale +
offset per group of input columns), on kernels/quant_linear_cpu.cpp.

The codes are re-laid-out once at load into the dense kernel's 16-channel panels: 8-bit as
(Npad/16, K, 16) int8, 4-bit two to a byte as (Npad/16, K/2, 16) uint8 (low nibble: the even input,
high nibble: the odd one), the scales and offsets as (Npad/16, groups, 16) fp32. The kernel widens
the codes to fp32 in registers, sums x * q over a group, then adds scale * that sum and offset *
sum(x over the group): no full-precision copy of the weights exists after packing.

Where the codes come from: a quantized checkpoint (the linear's `quant`, whatever --quantization
says), or round-to-nearest at load for --quantization int4 (asymmetric 4-bit, groups of 32
inputs, llama.cpp's Q4_1 grouping) and int8 (symmetric 8-bit, one group per output channel)."""
import torch
from torch import nn

from pdserve.backends.cpu import hugepages
from pdserve.backends.cpu.kernels import cpu_ops
from pdserve.layers.quantized import GroupQuantized

PANEL, TILE = 16, 64
INT4_GROUP = 32   # --quantization int4's group size


def round_to_nearest(weight: torch.Tensor, bits: int, group: int) -> GroupQuantized:
    """(N, K) weight -> codes by round-to-nearest: 4-bit asymmetric (codes 0..15, offset = the
    group's min), 8-bit symmetric (codes -127..127, no offset); group K: one per output channel."""
    N, K = weight.shape
    g = weight.float().view(N, K // group, group)
    if bits == 4:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
        return GroupQuantized(q.view(N, K), scale, lo.contiguous(), group, 4)
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-12)
    q = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return GroupQuantized(q.view(N, K), scale, None, group, 8)


def _panels(t: torch.Tensor, n_pad: int) -> torch.Tensor:
    """(N, C) rows -> (n_pad/16, C, 16): zero rows up to n_pad, then 16-row panels transposed."""
    N, C = t.shape
    padded = torch.zeros(n_pad, C, dtype=t.dtype)
    padded[:N] = t
    return padded.view(n_pad // PANEL, PANEL, C).transpose(1, 2).contiguous()


def pack_quantized(gq: GroupQuantized, arena: hugepages.Arena | None = None):
    """GroupQuantized -> (codes, scale, offset or empty) in the kernel's layout (module docstring);
    the codes in `arena` if given, else on huge pages of their own."""
    N, K = gq.shape
    if gq.bits == 4 and gq.group_size % 2:
        raise ValueError(f"4-bit codes in groups of {gq.group_size}: the kernel takes even group sizes")
    n_pad = -(-N // TILE) * TILE
    q = gq.q
    if gq.bits == 4:
        q = q.view(N, K // 2, 2)
        q = q[..., 0] | (q[..., 1] << 4)
    src = _panels(q, n_pad)
    codes = arena.empty(src.shape, src.dtype) if arena is not None else hugepages.empty(src.shape, dtype=src.dtype)
    codes.copy_(src)
    offset = torch.empty(0) if gq.offset is None else _panels(gq.offset.float(), n_pad)
    return codes, _panels(gq.scale.float(), n_pad), offset


class QuantLinear(nn.Module):
    """A linear on group-quantized codes: fmt names it, e.g. "w4 g32" (4-bit codes, groups of 32)."""

    def __init__(self, linear: nn.Linear, gq: GroupQuantized, arena: hugepages.Arena | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if gq.shape != (self.out_features, self.in_features):
            raise ValueError(f"codes of shape {gq.shape} for a linear of {self.out_features}x{self.in_features}")
        self.bits, self.group_size = gq.bits, gq.group_size
        group = "per-channel" if gq.group_size == self.in_features else f"g{gq.group_size}"
        self.fmt = f"w{gq.bits} {group}"
        codes, scale, offset = pack_quantized(gq, arena)
        self.register_buffer("packed", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_ops().quant_linear(x.reshape(-1, self.in_features).float().contiguous(), self.packed, self.scale,
                                   self.offset)
        if y.shape[1] != self.out_features:
            y = y[:, :self.out_features].contiguous()
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows W[ids] (K each, fp32), dequantized from the packed codes: a tied input embedding."""
        flat = ids.reshape(-1).long()
        p, c = flat // PANEL, flat % PANEL
        q = self.packed[p, :, c]   # (n, K) int8 or (n, K/2) packed nibbles
        if self.bits == 4:
            q = torch.stack([q & 15, q >> 4], dim=-1).view(len(flat), self.in_features)
        g = q.float().view(len(flat), -1, self.group_size) * self.scale[p, :, c][..., None]
        if self.offset.numel():
            g += self.offset[p, :, c][..., None]
        return g.view(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"
