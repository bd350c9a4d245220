"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the paged cache holds a compressed latent.

Each token's K and V come from one latent c = norm(kv_a(x))[:kv_lora_rank] through kv_b (per head:
a K part W_UK of qk_nope_head_dim rows and a V part W_UV of v_head_dim rows), plus one key part
k_pe of qk_rope_head_dim values that RoPE rotates and every head shares. The cache keeps only
[c, k_pe] per token and layer: kv_lora_rank + qk_rope_head_dim values (576 for DeepSeek-V3, where
full K/V would be 128 heads x (192 + 128)); the model's kv_spec says so to the model runner.

Scores are q_nope . (W_UK c) + q_pe . k_pe. Prefill chunks expand K/V per head from the gathered
latents (as transformers computes them). Decodes take the absorbed form: q_nope through W_UK
gives a query in latent space, attention runs over the latents themselves (one shared "head" of
kv_lora_rank + qk_rope_head_dim values), and the latent output goes through W_UV: the per-head K/V
of the context are never made. The step's masked groups are those of layers/attention.py."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.attention import AttentionGroup, AttentionMetadata, _masked_group, get_attention_metadata
from pdserve.layers.layernorm import RMSNorm
from pdserve.layers.rotary import Rope, rotate

LATENT_NORM_EPS = 1e-6   # transformers' q_a_layernorm and kv_a_layernorm take their default, not rms_norm_eps


@dataclass(frozen=True)
class MLAShape:
    num_heads: int
    q_lora_rank: int | None      # None: q straight from x (q_proj)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values one token leaves in one layer's cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class KVUpProjection(nn.Module):
    """kv_b: latent -> per-head [k_nope, v], weight (H * (nope + v), kv_lora_rank). Not an nn.Linear,
    so the CPU backend leaves its weight as it is: decode reads it as W_UK and W_UV."""

    def __init__(self, s: MLAShape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return F.linear(c, self.weight)


class MultiHeadLatentAttention(nn.Module):
    """A layer's attention. scale: the softmax's (transformers': qk_head_dim ** -0.5, times yarn's
    mscale(mscale_all_dim) squared). interleaved: rope_interleave, the rotated dims paired (x0, x1),
    (x2, x3), ...; transformers' output puts the evens first, the odds after (the cache keeps k_pe so)."""

    def __init__(self, hidden_size: int, s: MLAShape, scale: float, bias: bool = False, interleaved: bool = True,
                 norm=RMSNorm):
        super().__init__()
        self.shape, self.scale, self.interleaved = s, scale, interleaved
        H = s.num_heads
        if s.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, H * s.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, s.q_lora_rank, bias=bias)
            self.q_a_layernorm = norm(s.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(s.q_lora_rank, H * s.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, s.latent_dim, bias=bias)
        self.kv_a_layernorm = norm(s.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = KVUpProjection(s)
        self.o_proj = nn.Linear(H * s.v_head_dim, hidden_size, bias=bias)
        # (num_slots, 1, kv_lora_rank + qk_rope_head_dim): set by the model runner (bind_kv_cache)
        self.latent_cache: torch.Tensor | None = None

    def bind_kv_cache(self, planes: torch.Tensor) -> None:
        """This layer's part of the paged cache, (1, num_slots, 1, latent_dim) (kv_spec: one plane)."""
        self.latent_cache = planes[0]

    def forward(self, rope: Rope, x: torch.Tensor, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        s, T = self.shape, x.shape[0]
        q = self.q_proj(x) if s.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, s.num_heads, s.qk_head_dim).split([s.qk_nope_head_dim, s.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], -1)
        c = self.kv_a_layernorm(c.contiguous())
        q_pe, k_pe = self._rotate(rope, q_pe), self._rotate(rope, k_pe.reshape(T, 1, s.qk_rope_head_dim))
        meta = get_attention_metadata()
        self.latent_cache.index_copy_(0, meta.slot_mapping, torch.cat([c[:, None], k_pe], -1))
        w = self.kv_b_proj.weight.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        out = q.new_empty(T, s.num_heads, s.v_head_dim)
        for g in masked_groups(meta):
            latents = self._gather(g)                                 # (B, K, latent_dim)
            qn, qp = q_nope[g.token_idx], q_pe[g.token_idx]           # (B, Q, H, nope | rope)
            if qn.shape[1] == 1:   # the decodes
                og = self._absorbed(qn, qp, latents, w, g.mask)
            else:
                og = self._expanded(qn, qp, latents, g.mask)
            out[g.token_idx[g.query_valid]] = og[g.query_valid]
        return self.o_proj(out.reshape(T, -1))

    def _rotate(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        """RoPE on the rope dims (torch's ops: they are a slice of q, which the CPU kernel does not take)."""
        if self.interleaved:   # pairs (x0, x1), ... -> evens then odds, then rotate-half (transformers' result)
            x = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
        return rotate(x, rope.cos, rope.sin)

    def _expanded(self, qn, qp, latents, mask) -> torch.Tensor:
        """Prefill: per-head K/V from the latents, then attention as transformers computes it."""
        s = self.shape
        c, k_pe = latents.split([s.kv_lora_rank, s.qk_rope_head_dim], -1)
        B, K = c.shape[:2]
        kv = self.kv_b_proj(c).view(B, K, s.num_heads, s.qk_nope_head_dim + s.v_head_dim)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], -1)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(B, K, s.num_heads, s.qk_rope_head_dim)], -1)
        q = torch.cat([qn, qp], -1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=self.scale)
        return o.transpose(1, 2)                                     # (B, Q, H, v)

    def _absorbed(self, qn, qp, latents, w, mask) -> torch.Tensor:
        """Decode: q_nope through W_UK into latent space, attention over the latents (all heads share
        them: one key/value head), the latent output through W_UV."""
        s = self.shape
        w_uk, w_uv = w.split([s.qk_nope_head_dim, s.v_head_dim], 1)   # (H, nope, r), (H, v, r)
        q_lat = torch.einsum("bqhn,hnr->bhqr", qn, w_uk)
        q = torch.cat([q_lat, qp.transpose(1, 2)], -1)               # (B, H, Q, r + rope)
        kv = latents[:, None]                                       # (B, 1, K, r + rope)
        o = F.scaled_dot_product_attention(q, kv, kv[..., :s.kv_lora_rank], attn_mask=mask, scale=self.scale,
                                           enable_gqa=True)         # (B, H, Q, r)
        return torch.einsum("bhqr,hvr->bqhv", o, w_uv)

    def _gather(self, g: AttentionGroup) -> torch.Tensor:
        """The group's cached latents, (B, K, latent_dim): whole blocks at a time."""
        B, nb = g.block_tables.shape
        cache = self.latent_cache
        blocks = cache.view(-1, g.block_size * cache.shape[-1]).index_select(0, g.block_tables.view(-1))
        return blocks.view(B, nb * g.block_size, cache.shape[-1])[:, :g.num_keys]


def masked_groups(meta: AttentionMetadata) -> list[AttentionGroup]:
    """The step's masked groups: the torch path's own, or, where the step's metadata is the CPU
    attention kernels' (an AttentionStep: those kernels have no MLA), made from it once per step
    and kept on the metadata for the other layers."""
    if meta.step is None or meta.groups:
        return meta.groups
    st, bs = meta.step, meta.step.block_size
    groups = []
    B = st.decode_ctx.shape[0]
    if B:
        first = st.decode_first_row
        rows = st.decode_rows.tolist() if first < 0 else list(range(first, first + B))
        groups.append(_masked_group([1] * B, rows, st.decode_ctx.tolist(), st.decode_tables.tolist(), bs, "cpu"))
    if st.prefill_q_lens.shape[0]:
        groups.append(_masked_group(st.prefill_q_lens.tolist(), st.prefill_starts.tolist(), st.prefill_ctx.tolist(),
                                    st.prefill_tables.tolist(), bs, "cpu"))
    meta.groups = groups
    return groups
