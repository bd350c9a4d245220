"""Linear layers whose weights are re-laid-out once at load for the CPU decode kernel.

nn.Linear stores W as (N, K) and torch multiplies small batches at well under memory bandwidth
on CPUs (docs/PERFORMANCE.md). PackedLinear stores W as panels of 16 output channels, (N/16, K, 16),
which kernels/linear_cpu.cpp streams once per step for any number of rows, in fp32, bf16
or int8 (weight-only: one fp32 scale per output channel, symmetric). Activations stay fp32 inside
the kernel; the result is cast back to the model's dtype. Where the CPU has AVX512-BF16 a bf16
model's weights are packed in k-pairs instead ("bf16x2": (N/16, K/2, 32)) and multiplied by bf16
dot products, twice the multiply-adds per instruction of fp32 FMAs; where it also has AMX-BF16, batches
of 8 rows and more run on AMX tiles, which read that same layout (kernels/amx_tiles.h)."""
import torch
from torch import nn

from pdserve.backends.cpu import hugepages
from pdserve.backends.cpu.kernels import cpu_ops, cpu_supports_bf16_dot
from pdserve.backends.cpu.quant_linear import INT4_GROUP, QuantLinear, round_to_nearest
from pdserve.layers.quantized import GroupQuantized

PANEL, TILE = 16, 64   # channels per panel; the kernel works on 4 panels at a time
_NO_COUNTS = torch.empty(0, dtype=torch.long)   # the screened argmax's per-row candidate counts: not wanted


CHUNK = 4096   # rows packed at a time (a multiple of TILE): the conversion's scratch is one chunk, not a copy of W
FORMATS = {"fp32": torch.float32, "int8": torch.int8, "bf16": torch.bfloat16, "bf16x2": torch.bfloat16}


def pack_weight(weight: torch.Tensor, fmt: str,
                arena: hugepages.Arena | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weight -> (packed (Npad/16, K, 16), scale (Npad,) or empty) in format fp32|bf16|int8;
    packed in `arena` if given, else in a huge-page allocation of its own. Converted CHUNK rows at a
    time: a 151936-row lm_head's fp32 copy alone would be as big as the packed result."""
    N, K = weight.shape
    n_pad = -(-N // TILE) * TILE
    P = n_pad // PANEL
    # (panel, k pair, channel, 2) for bf16x2: one 64-byte line holds 16 channels x 2 k
    shape = (P, K // 2, 2 * PANEL) if fmt == "bf16x2" else (P, K, PANEL)
    # streamed once per decode step: on huge pages (hugepages.py)
    packed = arena.empty(shape, FORMATS[fmt]) if arena is not None else hugepages.empty(shape, dtype=FORMATS[fmt])
    scale = torch.empty(n_pad) if fmt == "int8" else torch.empty(0)
    for r0 in range(0, n_pad, CHUNK):
        r1 = min(r0 + CHUNK, n_pad)
        w = torch.zeros(r1 - r0, K, dtype=torch.float32)
        if r0 < N:
            w[:min(r1, N) - r0] = weight[r0:r1].float()
        if fmt == "int8":
            s = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)   # symmetric, per output channel
            scale[r0:r1] = s
            w = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
        elif fmt in ("bf16", "bf16x2"):
            w = w.to(torch.bfloat16)
        p = (r1 - r0) // PANEL
        if fmt == "bf16x2":
            src = w.view(p, PANEL, K // 2, 2).permute(0, 2, 1, 3).reshape(p, K // 2, 2 * PANEL)
        else:
            src = w.view(p, PANEL, K).transpose(1, 2)
        packed[r0 // PANEL:r1 // PANEL].copy_(src)
    return packed, scale


def column_norms(weight: torch.Tensor, n_pad: int) -> torch.Tensor:
    """(n_pad,) fp32 bounds on each row's L2 norm of an (N, K) weight: rounded up, 0 on padding."""
    norms = torch.zeros(n_pad, dtype=torch.float64)
    N = weight.shape[0]
    for r0 in range(0, N, CHUNK):   # in fp64, a chunk at a time (a whole copy is twice W)
        r1 = min(r0 + CHUNK, N)
        norms[r0:r1] = torch.linalg.vector_norm(weight[r0:r1].double(), dim=1) * (1 + 1e-6)
    return norms.float()   # the fp32 rounding moves a value by less than the 1e-6 above


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, fmt: str, screen: bool = False, arena: hugepages.Arena | None = None):
        super().__init__()
        if fmt == "bf16" and linear.in_features % 2 == 0 and cpu_supports_bf16_dot():
            fmt = "bf16x2"
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        packed, scale = pack_weight(linear.weight.detach(), fmt, arena)
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        # argmax screened on a bf16 copy (kernels/argmax_cpu.cpp: packed_linear_argmax_screened): the
        # lm_head of an fp32 model, where greedy steps then read half its bytes for the same tokens
        self.screen, self.col_norm, self.col_norm_max = None, None, 0.0
        if screen and fmt == "fp32" and linear.bias is None and linear.in_features % 2 == 0 and cpu_supports_bf16_dot():
            norms = column_norms(linear.weight.detach(), packed.shape[0] * PANEL)
            # finite norms: a finite weight (torch.isfinite on the whole matrix made 6x its size in scratch)
            if bool(torch.isfinite(norms).all()):
                self.screen = pack_weight(linear.weight.detach(), "bf16x2", arena)[0]
                self.col_norm, self.col_norm_max = norms, float(norms.max())
        self.use_screen = self.screen is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "bf16x2":
            y = cpu_ops().packed_linear_bf16_pairs(x.reshape(-1, self.in_features).bfloat16().contiguous(), self.packed)
        elif self.fmt == "int8":
            y = self._int8_codes(x.reshape(-1, self.in_features).float().contiguous())
        else:
            y = cpu_ops().packed_linear(x.reshape(-1, self.in_features).float().contiguous(), self.packed, self.scale)
        if y.shape[1] != self.out_features:
            y = y[:, :self.out_features].contiguous()
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of forward(x) (greedy sampling's token, torch.argmax's rule) with the
        kernel's fused reduction: the (rows, out_features) logits are never written. x: fp32 rows."""
        x = x.reshape(-1, self.in_features)
        if x.dtype != torch.float32:
            raise ValueError(f"argmax takes fp32 rows (logits of {x.dtype} rows are rounded), got {x.dtype}")
        if self.use_screen:
            return cpu_ops().packed_linear_argmax_screened(x.contiguous(), self.packed, self.screen, self.col_norm,
                                                           self.col_norm_max, self.out_features, _NO_COUNTS)
        if self.fmt == "int8" and x.shape[0] > 1:
            return self.forward(x).argmax(dim=-1)
        bias = torch.empty(0) if self.bias is None else self.bias.detach().float()
        return cpu_ops().packed_linear_argmax(x.contiguous(), self.packed, self.scale, bias, self.out_features)

    def _int8_codes(self, x: torch.Tensor) -> torch.Tensor:
        """int8 weights on the group-code kernel (quant_linear_cpu.cpp) as 8-bit codes in one group per
        channel: the same bytes and layout, the scale (Npad,) already (Npad/16, 1, 16). From 2 rows it
        loads or dequantizes each code once for all rows where the dense int8 tile widened them per
        row tile: a 151936 x 896 lm_head at 32 rows took 24 ms instead of 63 (docs/PERFORMANCE.md);
        that gain outweighs the fused argmax's (logits not written), so argmax of 2+ rows uses this."""
        return cpu_ops().quant_linear(x, self.packed, self.scale.view(-1, 1, PANEL), torch.empty(0))

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows W[ids] (K each, fp32) read back from the packed layout: the tied input embedding."""
        return cpu_ops().packed_rows(self.packed, self.scale, ids.reshape(-1).long().contiguous()).view(
            *ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class TiedPackedEmbedding(nn.Module):
    """The input embedding of a tied model, reading the packed lm_head: one copy of the matrix."""

    def __init__(self, lm_head: "PackedLinear | QuantLinear", dtype: torch.dtype):
        super().__init__()
        self.lm_head, self.dtype = [lm_head], dtype   # a list: not a submodule, no second registration

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head[0].weight_rows(ids).to(self.dtype)


def pack_model(model: nn.Module, fmt: str, embed_name: str | None) -> nn.Module:
    """Replace every nn.Linear by a packed one. A linear whose checkpoint was quantized (its `quant`):
    a QuantLinear on its own codes, whatever fmt says (the other linears of such a checkpoint keep
    the model's dtype). fmt "int4": the layers' linears as 4-bit codes made at load, groups of 32;
    "int8": 8-bit codes, one scale per output channel; both on the group kernel (quant_linear.py),
    the lm_head a PackedLinear int8 (its fused argmax for one row, the group kernel from two;
    llama.cpp's Q4_K_M keeps its output matrix at 6 bits too). Else a PackedLinear in fmt (the lm_head with its argmax screen, where it can have
    one). A tied embedding `embed_name` then reads the packed lm_head. Frees each original weight as
    it goes, so peak memory grows by one matrix only. The packed weights share one arena: all on
    huge pages, not only each one's aligned middle (hugepages.py)."""
    tied = embed_name is not None
    dtype = next(model.parameters()).dtype
    arena = hugepages.Arena()
    # names, not modules: holding every nn.Linear in a list would keep all original weights alive
    # until the loop ends (peak memory: the whole model twice)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if any(isinstance(getattr(model.get_submodule(n), "quant", None), GroupQuantized) for n in names):
        fmt = "bf16" if dtype == torch.bfloat16 else "fp32"   # a quantized checkpoint: its own codes
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        linear = getattr(owner, attr)
        codes = getattr(linear, "quant", None)
        if codes is None and name != "lm_head":
            if fmt == "int4" and linear.in_features % INT4_GROUP == 0:
                codes = round_to_nearest(linear.weight.detach(), 4, INT4_GROUP)
            elif fmt == "int8":   # per output channel: one group of K
                codes = round_to_nearest(linear.weight.detach(), 8, linear.in_features)
        if codes is not None:
            packed = QuantLinear(linear, codes, arena)
        else:
            packed = PackedLinear(linear, "int8" if fmt == "int4" else fmt, screen=name == "lm_head", arena=arena)
        del linear, codes
        setattr(owner, attr, packed)
    if tied:
        parent, _, attr = embed_name.rpartition(".")
        setattr(model.get_submodule(parent), attr, TiedPackedEmbedding(model.lm_head, dtype))
    hugepages.trim_heap()   # the originals' freed memory
    return model
