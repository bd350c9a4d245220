"""The CPU kernels' versions of the torch layers, for a model that runs its modules layer by layer
(one the decoder stack cannot run). prepare_model swaps each module's class for its subclass
here: same state, a forward on the kernels where the input suits them (fp32 rows), the torch
layer's otherwise."""
import torch
from torch import nn

from pdserve.backends.cpu import hugepages
from pdserve.backends.cpu.kernels import cpu_ops
from pdserve.backends.cpu.quant_linear import round_to_nearest
from pdserve.layers import activation
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.attention import PagedAttention, get_attention_metadata
from pdserve.layers.layernorm import RMSNorm
from pdserve.layers.moe import FusedMoE
from pdserve.layers.quantized import GroupQuantized
from pdserve.layers.rotary import Rope, RotaryEmbedding


def _gated(x: torch.Tensor, kernel) -> torch.Tensor:
    y = kernel(x.reshape(-1, x.shape[-1]).contiguous())
    return y.view(*x.shape[:-1], y.shape[-1])


class CpuSiluAndMul(SiluAndMul):
    """One pass of kernels/activation_cpu.cpp."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if x.dtype != torch.float32 else _gated(x, cpu_ops().silu_and_mul)


# GeGLU (Gemma): its torch module is layers/activation.py's GeluTanhAndMul where that exists
GeluTanhAndMul = getattr(activation, "GeluTanhAndMul", None)
if GeluTanhAndMul is not None:
    class CpuGeluTanhAndMul(GeluTanhAndMul):
        """One pass of kernels/activation_cpu.cpp: gelu(gate, approximate="tanh") * up."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) if x.dtype != torch.float32 else _gated(x, cpu_ops().gelu_tanh_and_mul)


class CpuRMSNorm(RMSNorm):
    """kernels/norm_cpu.cpp: the residual add and the norm in one pass, in place. Alone, over rows
    of any shape (q or k heads: (T, H, D)), the same rounding as the decoder stack's."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dtype != torch.float32 or (residual is not None and x.dim() != 2):
            return super().forward(x, residual)
        if residual is None:
            return cpu_ops().rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.eps).view(x.shape)
        x = x.contiguous()
        cpu_ops().fused_add_rms_norm(x, residual, self.weight, self.eps)   # x is this step's scratch
        return x, residual


class CpuRotaryEmbedding(RotaryEmbedding):
    """Its fp32 Rope rotates q and k in place by kernels/rotary_cpu.cpp, which rotates whole heads:
    partial rotary (rotary_dim < head_dim) stays on torch's ops."""

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        rope = super().lookup(positions, dtype)
        if dtype != torch.float32 or self.rotary_dim < self.head_dim:
            return rope
        return rope._replace(rotate=cpu_ops().rotary_embedding)


class CpuPagedAttention(PagedAttention):
    """kernels/attention_cpu.cpp (decodes) and prefill_attention_cpu.cpp (prefill chunks) over the
    cache in place (soft cap and sinks included), where the step's metadata is the kernels' (an AttentionStep)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        if meta.step is None:
            return super().forward(q, k, v)
        self.k_cache.index_copy_(0, meta.slot_mapping, k)
        self.v_cache.index_copy_(0, meta.slot_mapping, v)
        return self._kernels(q, meta.step)

    def _kernels(self, q: torch.Tensor, s) -> torch.Tensor:
        """The kernels compute and write fp32: a bf16 model's output is converted once, at the end."""
        out = torch.empty(q.shape, dtype=torch.float32)
        qf = q.float().contiguous()
        B = s.decode_ctx.shape[0]
        sinks = None if self.sinks is None else self.sinks.detach().float().contiguous()
        if B:   # decodes: one query each, rows first_row.. (a slice) or decode_rows
            rows = s.decode_rows if s.decode_first_row < 0 else slice(s.decode_first_row, s.decode_first_row + B)
            out[rows] = cpu_ops().paged_decode_attention(qf[rows].contiguous(), self.k_cache, self.v_cache,
                                                         s.decode_tables, s.decode_ctx, s.block_size, self.scale,
                                                         self.sliding_window or 0, self.logit_softcap or 0.0, sinks)
        if s.prefill_q_lens.shape[0]:   # prefill chunks, written into out in place
            cpu_ops().paged_prefill_attention(qf, self.k_cache, self.v_cache, s.prefill_tables, s.prefill_starts,
                                              s.prefill_q_lens, s.prefill_ctx, out, s.block_size, self.scale,
                                              self.sliding_window or 0, self.logit_softcap or 0.0, sinks)
        return out.to(q.dtype).reshape(q.shape[0], -1)


GEMM_TOKENS_PER_EXPERT = 4   # (token, expert) pairs per selected expert from which a step takes the torch GEMMs


class CpuFusedMoE(FusedMoE):
    """kernels/moe_cpu.cpp: the experts in one call, each selected expert's weights read once per
    step (fp32, bf16, int8 codes (quantize_int8) or MXFP4 experts, decoded in the kernel; biases and
    gpt-oss's clamped SwiGLU; the activations fp32, the result cast to the model's dtype)."""

    int8 = False   # quantize_int8 has run: gate_up_proj_q/_scale and down_proj_q/_scale hold the experts

    def quantize_int8(self, group_size: int | None = None) -> None:
        """The stacked experts as int8 codes, round-to-nearest and symmetric (quant_linear.py's
        round_to_nearest, the form of layers/quantized.py), a scale per `group_size` inputs (None:
        per output channel, as --quantization int8 quantizes the linears); the dense weights freed.
        One expert at a time, so that the fp32 copy is never more than one expert's."""
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(self, name).detach()
            E, N, K = w.shape
            parts = [round_to_nearest(w[e], 8, group_size or K) for e in range(E)]
            delattr(self, name)
            # the codes (E, N, K) int8, the scales (E, N, K / group) fp32: the kernel's arguments
            self.register_buffer(f"{name}_q", torch.stack([p.q for p in parts]))
            self.register_buffer(f"{name}_scale", torch.stack([p.scale for p in parts]))
            del parts, w
        self.int8 = True

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.int8:
            return super().expert(e, dtype)
        return tuple(GroupQuantized(q[e], s[e], None, K // s.shape[-1], 8).dequantize().to(dtype)
                     for q, s, K in ((self.gate_up_proj_q, self.gate_up_proj_scale, self.hidden_size),
                                     (self.down_proj_q, self.down_proj_scale, self.intermediate_size)))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.mxfp4:
            w13, w2 = self.gate_up_proj_blocks, self.down_proj_blocks
            scales = dict(s13=self.gate_up_proj_scales.detach(), s2=self.down_proj_scales.detach())
        elif self.int8:
            w13, w2 = self.gate_up_proj_q, self.down_proj_q
            scales = dict(s13=self.gate_up_proj_scale, s2=self.down_proj_scale)
        else:
            w13, w2, scales = self.gate_up_proj, self.down_proj, {}
            if w13.dtype not in (torch.float32, torch.bfloat16):
                return super().forward(x, weights, ids)
            # Many tokens a selected expert (a prefill chunk): per-expert GEMMs (oneDNN's AMX for bf16,
            # MKL's for fp32) outrun the kernel's dot products, which are for the few tokens a decode
            # step gives each expert (bf16 Qwen3-30B-A3B layer: 1.2x at 64 tokens, 1.8x at 128, 4.4x at 512)
            if ids.numel() >= GEMM_TOKENS_PER_EXPERT * int(torch.bincount(ids.reshape(-1)).count_nonzero()):
                return super().forward(x, weights, ids)
        if not (w13.is_contiguous() and w2.is_contiguous()):
            return super().forward(x, weights, ids)
        bias = {}
        if self.gate_up_proj_bias is not None:
            bias = dict(b13=self.gate_up_proj_bias.detach().float().contiguous(),
                        b2=self.down_proj_bias.detach().float().contiguous())
        alpha, limit = self.swiglu or (1.0, 0.0)
        y = cpu_ops().fused_moe(x.float().contiguous(), weights.float().contiguous(), ids.long().contiguous(),
                                w13.detach(), w2.detach(), swiglu_alpha=alpha, swiglu_limit=limit, **bias, **scales)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", int8" if self.int8 else "")


def experts_on_hugepages(model: nn.Module) -> int:
    """Every MoE layer's stacked experts (dense, int8 codes, MXFP4 blocks; their scales) moved onto
    2 MiB pages (hugepages.py): a step streams each selected expert's megabytes, and on 4 KiB pages
    the prefetcher stops at every page (bf16 Qwen3-30B-A3B experts at 8 tokens: 28.7 -> 22.5 ms a
    layer). One tensor at a time, so the copy costs one layer's stack at most; returns the count."""
    moved = 0
    for m in model.modules():
        if isinstance(m, CpuFusedMoE):
            for t in m.held_weights():
                huge = hugepages.empty(t.shape, dtype=t.dtype)
                huge.copy_(t.detach())
                t.data = huge
                moved += 1
    hugepages.trim_heap()
    return moved


def quantize_experts(model: nn.Module) -> int:
    """--quantization int8 on a mixture of experts: every dense expert stack (not MXFP4's, which keep
    the checkpoint's own codes) as int8 codes per output channel; returns how many layers."""
    moes = [m for m in model.modules() if isinstance(m, CpuFusedMoE) and not (m.mxfp4 or m.int8)]
    for m in moes:
        m.quantize_int8()
    return len(moes)


KERNEL_LAYERS = {SiluAndMul: CpuSiluAndMul, RMSNorm: CpuRMSNorm, RotaryEmbedding: CpuRotaryEmbedding,
                 FusedMoE: CpuFusedMoE}
if GeluTanhAndMul is not None:
    KERNEL_LAYERS[GeluTanhAndMul] = CpuGeluTanhAndMul


def use_kernel_layers(model: nn.Module, attention: bool) -> None:
    """Swap the class of each layer that has a kernel version (its state is unchanged); the paged
    attention too where the attention kernels take the model's head size."""
    swaps = {**KERNEL_LAYERS, **({PagedAttention: CpuPagedAttention} if attention else {})}
    for m in model.modules():
        if type(m) in swaps:
            m.__class__ = swaps[type(m)]
