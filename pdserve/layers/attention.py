"""Paged attention over one flattened batch of tokens.

The engine step puts prefill chunks and decode tokens of many sequences into one flat batch of T
tokens. Each layer writes the new K/V into their cache slots (an index write) and then lets every
query attend to its own sequence's cached K/V. Decodes (one query each) and prefill chunks (many
queries each) form two groups, each one call with no Python loop over sequences: on CPU with the
compiled kernels, kernels/attention_cpu.cpp (decode) and kernels/prefill_attention_cpu.cpp (prefill)
read the cache in place; elsewhere each group is gathered, padded and masked for one batched
scaled_dot_product_attention call.

The per-step metadata (slot mapping, gather indices, masks) is built once per step by the model
runner and made visible to every layer through `attention_context` for the duration of the forward.
"""
from array import array
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_ops


@dataclass
class AttentionGroup:
    """Sequences whose queries are padded to the same length for one SDPA call."""
    token_idx: torch.Tensor   # (B, Q) index of each query in the flat batch (padding repeats a valid one)
    query_valid: torch.Tensor | None  # (B, Q) bool, False on padding; None in a group for the CPU kernels
    block_tables: torch.Tensor  # (B, ceil(K / block_size)) the blocks holding each sequence's keys (padding: 0)
    num_keys: int             # K: the longest context in the group
    block_size: int
    ctx_lens: torch.Tensor    # (B,) int64: keys of each sequence, this step's included
    sliding_window: int | None
    # (B, 1, Q, K) bool: causal within the sequence, False on padding. None: a group for the CPU
    # kernels, which read the cache in place and need no mask (token_idx is then (B, 1): each
    # sequence's first query).
    mask: torch.Tensor | None
    q_lens: torch.Tensor | None = None   # (B,) int64 queries per sequence, for the prefill kernel
    # decodes at flat rows first_row .. first_row + B - 1 (the runner puts them first): slices, not
    # index ops (a batch-1 step is 24 layers of tiny ops, each costing microseconds)
    first_row: int | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor       # (T,) cache slot each new token's K/V is written to
    groups: list[AttentionGroup]


_CONTEXT: AttentionMetadata | None = None


@contextmanager
def attention_context(meta: AttentionMetadata):
    """Make `meta` visible to the attention layers for one forward; always cleared after."""
    global _CONTEXT
    _CONTEXT = meta
    try:
        yield
    finally:
        _CONTEXT = None


def get_attention_metadata() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside attention_context")
    return _CONTEXT


_NONE, _NONE_2D = torch.empty(0, dtype=torch.long), torch.empty(0, 0, dtype=torch.long)   # a group's absence


def kernel_step(meta: AttentionMetadata):
    """A forward's metadata (CPU kernel groups) as one C++ AttentionStep, for the decoder stacks
    of kernels/decoder_cpu.cpp: decodes first (rows first_row.., or their indices), prefill chunks.
    Each torch op here runs on the caches the last forward flushed (~10 us): the empty tensors are
    made once, and decode rows that are one slice (first_row) need no index tensor."""
    dec = pre = None
    for g in meta.groups:
        if g.q_lens is None:
            dec = g
        else:
            pre = g
    if dec is None:
        first_row, decode = -1, (_NONE, _NONE_2D, _NONE)
    elif dec.first_row is not None:
        first_row, decode = dec.first_row, (_NONE, dec.block_tables, dec.ctx_lens)
    else:
        first_row, decode = -1, (dec.token_idx[:, 0], dec.block_tables, dec.ctx_lens)
    prefill = ((_NONE, _NONE, _NONE_2D, _NONE) if pre is None else
               (pre.token_idx[:, 0], pre.q_lens, pre.block_tables, pre.ctx_lens))
    g = meta.groups[0]
    return cpu_ops().AttentionStep(meta.slot_mapping, first_row, *decode, *prefill, g.block_size, g.sliding_window or 0)


def build_metadata(flat: list[list[int]], groups: list[tuple], block_size: int, sliding_window: int | None,
                   device, with_mask: bool = True) -> tuple[list[torch.Tensor], AttentionMetadata]:
    """One step's attention metadata, and its per-token integer lists as tensors.

    flat: per-token lists of the step (the runner's input ids, positions, slots), the last being
    the slot mapping. groups: (q_lens, starts, ctx_lens, block_tables) of each group, whose sequences
    have q_lens queries starting at flat index starts and a cached context of ctx_lens tokens after
    this step. The CPU kernels need no mask and no padding (with_mask=False): then every integer of
    the step goes into one int64 buffer, one tensor split into views. torch.tensor() on lists costs
    ~60 ns an element (a decode batch's nested tables: ~20 us), array() ~15, and between two
    forwards each torch call runs cold (several us; ~20 the first time a kind of op runs)."""
    ints, sizes = [], []
    for x in flat:
        ints += x
        sizes.append(len(x))
    shapes = []   # (K, nb) of each kernel group
    for g in ([] if with_mask else groups):
        shapes.append(_add_group_ints(ints, *g, block_size))
        B = len(g[0])
        sizes += [B, B, B, B * shapes[-1][1]]
    buf = torch.frombuffer(array("q", ints), dtype=torch.long)
    parts = (buf.to(device) if with_mask else buf).split(sizes)   # the kernels' path is CPU only
    tensors, it = parts[:len(flat)], iter(parts[len(flat):])
    if with_mask:
        built = [_masked_group(*g, block_size, sliding_window, device) for g in groups]
    else:
        built = []
        for (q_lens, starts, _, _), (K, nb) in zip(groups, shapes):
            q_lens_t, starts_t, ctx_t, tables = next(it), next(it), next(it), next(it)
            B, Q = len(q_lens), max(q_lens)
            consecutive = Q == 1 and starts[-1] - starts[0] == B - 1
            built.append(AttentionGroup(starts_t.view(B, 1), None, tables.view(B, nb), K, block_size, ctx_t,
                                        sliding_window, None, q_lens_t if Q > 1 else None,
                                        starts[0] if consecutive else None))
    return list(tensors), AttentionMetadata(slot_mapping=tensors[-1], groups=built)


def _add_group_ints(ints: list[int], q_lens: list[int], starts: list[int], ctx_lens: list[int],
                    tables: list[list[int]], block_size: int) -> tuple[int, int]:
    """Append a group's q_lens, starts, ctx_lens and block tables, each table cut or padded with
    block 0 to nb blocks; returns (K, nb): the longest context and its blocks."""
    K = max(ctx_lens)
    nb = (K + block_size - 1) // block_size
    ints += q_lens + starts + ctx_lens
    for t in tables:
        ints += t[:nb]
        if len(t) < nb:
            ints += [0] * (nb - len(t))
    return K, nb


def _masked_group(q_lens: list[int], starts: list[int], ctx_lens: list[int], block_tables: list[list[int]],
                  block_size: int, sliding_window: int | None, device) -> AttentionGroup:
    """Gather indices, padding and the causal mask, for one batched SDPA call."""
    ints = []
    K, nb = _add_group_ints(ints, q_lens, starts, ctx_lens, block_tables, block_size)
    B, Q = len(q_lens), max(q_lens)
    q_lens_t, starts_t, ctx_t, tables = torch.frombuffer(array("q", ints), dtype=torch.long).split([B, B, B, B * nb])
    tables = tables.view(B, nb)
    q_off = torch.arange(Q)
    query_valid = q_off[None, :] < q_lens_t[:, None]
    token_idx = starts_t[:, None] + torch.minimum(q_off[None, :], q_lens_t[:, None] - 1)
    # absolute position of each query and key in its own sequence
    q_pos = (ctx_t - q_lens_t)[:, None] + torch.minimum(q_off[None, :], q_lens_t[:, None] - 1)
    k_pos = torch.arange(K)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx_t[:, None, None])
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return AttentionGroup(token_idx.to(device), query_valid.to(device), tables.to(device), K, block_size, ctx_t.to(device),
                          sliding_window, mask[:, None].to(device))


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Set by the model runner once the cache is allocated: (num_slots, Hkv, D) views.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, Hkv, D). Returns (T, H * D)."""
        meta = get_attention_metadata()
        # The KV write is an index write into the flat slot view of the paged cache.
        self.k_cache.index_copy_(0, meta.slot_mapping, k)
        self.v_cache.index_copy_(0, meta.slot_mapping, v)
        # The CPU kernels compute and write fp32: a bf16 model's output is converted once, at the end.
        kernels = any(g.mask is None for g in meta.groups)
        out = torch.empty_like(q, dtype=torch.float32 if kernels else q.dtype)
        qf = q.float().contiguous() if kernels else None
        for g in meta.groups:
            window = g.sliding_window or 0
            if g.mask is None and g.q_lens is None:   # decodes: one query each
                B = g.token_idx.shape[0]
                rows = g.token_idx[:, 0] if g.first_row is None else slice(g.first_row, g.first_row + B)
                out[rows] = cpu_ops().paged_decode_attention(qf[rows].contiguous(), self.k_cache, self.v_cache,
                                                             g.block_tables, g.ctx_lens, g.block_size, self.scale, window)
            elif g.mask is None:                      # prefill chunks, written into out in place
                cpu_ops().paged_prefill_attention(qf, self.k_cache, self.v_cache, g.block_tables, g.token_idx[:, 0],
                                                  g.q_lens, g.ctx_lens, out, g.block_size, self.scale, window)
            else:
                qg = q[g.token_idx].transpose(1, 2)                 # (B, H, Q, D)
                kg = self._gather(self.k_cache, g)                  # (B, Hkv, K, D)
                vg = self._gather(self.v_cache, g)
                og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scale,
                                                    enable_gqa=self.num_heads != self.num_kv_heads)
                og = og.transpose(1, 2)                               # (B, Q, H, D)
                out[g.token_idx[g.query_valid]] = og[g.query_valid].to(out.dtype)
        return out.to(q.dtype).reshape(q.shape[0], -1)

    @staticmethod
    def _gather(cache: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """The group's keys (or values) as (B, Hkv, K, D): whole blocks are copied, one row of
        block_size * Hkv * D elements each, rather than one index per key position."""
        B, nb = g.block_tables.shape
        blocks = cache.view(-1, g.block_size * cache.shape[1] * cache.shape[2]).index_select(0, g.block_tables.view(-1))
        return blocks.view(B, nb * g.block_size, *cache.shape[1:])[:, :g.num_keys].transpose(1, 2)
