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

from pdserve.backends.cpu.kernels import cpu_ops


@dataclass
class AttentionGroup:
    """Sequences whose queries are padded to the same length for one SDPA call (the torch path)."""
    token_idx: torch.Tensor   # (B, Q) index of each query in the flat batch (padding repeats a valid one)
    query_valid: torch.Tensor  # (B, Q) bool, False on padding
    block_tables: torch.Tensor  # (B, ceil(K / block_size)) the blocks holding each sequence's keys (padding: 0)
    num_keys: int             # K: the longest context in the group
    block_size: int
    ctx_lens: torch.Tensor    # (B,) int64: keys of each sequence, this step's included
    sliding_window: int | None
    mask: torch.Tensor        # (B, 1, Q, K) bool: causal within the sequence, False on padding


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor       # (T,) cache slot each new token's K/V is written to
    groups: list[AttentionGroup]     # the torch path's masked groups (none on the CPU kernels' path)
    # The CPU kernels' path: a C++ AttentionStep (kernels/decoder.h), every tensor a view of the
    # step's one int64 buffer; the decoder stacks take it as it is, PagedAttention reads its fields.
    step: object = None


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


def build_metadata(flat: list[list[int]], groups: list[tuple], block_size: int, sliding_window: int | None,
                   device, with_mask: bool = True) -> tuple[list[torch.Tensor], AttentionMetadata]:
    """One step's attention metadata, and its per-token integer lists as tensors.

    flat: per-token lists of the step (the runner's input ids, positions, slots), the last being
    the slot mapping. groups: (q_lens, starts, ctx_lens, block_tables) of each group, whose sequences
    have q_lens queries starting at flat index starts and a cached context of ctx_lens tokens after
    this step; a group of one-query sequences is the decodes. The CPU kernels need no mask and no
    padding (with_mask=False): the step's integers then go into one list, which one C++ call copies
    with the block tables (cut or padded there) into an int64 buffer and views as the flat tensors
    and an AttentionStep. Between two forwards each torch call runs cold: array(), frombuffer and
    a split into views cost ~60 us at batch 32 there."""
    if with_mask:
        ints, sizes = [], []
        for x in flat:
            ints += x
            sizes.append(len(x))
        tensors = torch.frombuffer(array("q", ints), dtype=torch.long).to(device).split(sizes)
        built = [_masked_group(*g, block_size, sliding_window, device) for g in groups]
        return list(tensors), AttentionMetadata(tensors[-1], built)
    T = len(flat[-1])
    ints = []
    for x in flat:   # the runner's three lists are all T long
        assert len(x) == T
        ints += x
    dec = pre = None
    for g in groups:
        if max(g[0]) == 1:
            dec = g
        else:
            pre = g
    dec_tables, pre_tables, nb_dec, nb_pre, first_row = [], [], 0, 0, -1
    if dec is not None:
        _, starts, ctx_lens, dec_tables = dec
        ints += ctx_lens
        nb_dec = (max(ctx_lens) + block_size - 1) // block_size
        if starts[-1] - starts[0] == len(starts) - 1:   # rows first_row..: a slice, not an index op
            first_row = starts[0]
        else:
            ints += starts
    if pre is not None:
        q_lens, starts, ctx_lens, pre_tables = pre
        ints += starts + q_lens + ctx_lens
        nb_pre = (max(ctx_lens) + block_size - 1) // block_size
    tensors, step = cpu_ops().AttentionStep.from_ints(ints, dec_tables, pre_tables, len(flat), T, len(dec_tables),
                                                      nb_dec, first_row, len(pre_tables), nb_pre, block_size,
                                                      sliding_window or 0)
    slots = step.slot_mapping
    return tensors + [slots], AttentionMetadata(slots, [], step)


def _add_tables(ints: list[int], tables: list[list[int]], num_keys: int, block_size: int) -> int:
    """Append the block tables, each cut or padded with block 0 to the blocks of num_keys keys; returns that count."""
    nb = (num_keys + block_size - 1) // block_size
    for t in tables:
        ints += t[:nb]
        if len(t) < nb:
            ints += [0] * (nb - len(t))
    return nb


def _masked_group(q_lens: list[int], starts: list[int], ctx_lens: list[int], block_tables: list[list[int]],
                  block_size: int, sliding_window: int | None, device) -> AttentionGroup:
    """Gather indices, padding and the causal mask, for one batched SDPA call."""
    K = max(ctx_lens)
    ints = q_lens + starts + ctx_lens
    nb = _add_tables(ints, block_tables, K, block_size)
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
        if meta.step is not None:
            return self._kernels(q, meta.step)
        out = torch.empty_like(q)
        for g in meta.groups:
            qg = q[g.token_idx].transpose(1, 2)                 # (B, H, Q, D)
            kg = self._gather(self.k_cache, g)                  # (B, Hkv, K, D)
            vg = self._gather(self.v_cache, g)
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scale,
                                                enable_gqa=self.num_heads != self.num_kv_heads)
            og = og.transpose(1, 2)                               # (B, Q, H, D)
            out[g.token_idx[g.query_valid]] = og[g.query_valid]
        return out.reshape(q.shape[0], -1)

    def _kernels(self, q: torch.Tensor, s) -> torch.Tensor:
        """The CPU kernels over the cache in place (s: the step's AttentionStep). They compute and
        write fp32: a bf16 model's output is converted once, at the end."""
        out = torch.empty(q.shape, dtype=torch.float32)
        qf = q.float().contiguous()
        B = s.decode_ctx.shape[0]
        if B:   # decodes: one query each, rows first_row.. (a slice) or decode_rows
            rows = s.decode_rows if s.decode_first_row < 0 else slice(s.decode_first_row, s.decode_first_row + B)
            out[rows] = cpu_ops().paged_decode_attention(qf[rows].contiguous(), self.k_cache, self.v_cache,
                                                         s.decode_tables, s.decode_ctx, s.block_size, self.scale,
                                                         s.sliding_window)
        if s.prefill_q_lens.shape[0]:   # prefill chunks, written into out in place
            cpu_ops().paged_prefill_attention(qf, self.k_cache, self.v_cache, s.prefill_tables, s.prefill_starts,
                                              s.prefill_q_lens, s.prefill_ctx, out, s.block_size, self.scale,
                                              s.sliding_window)
        return out.to(q.dtype).reshape(q.shape[0], -1)

    @staticmethod
    def _gather(cache: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """The group's keys (or values) as (B, Hkv, K, D): whole blocks are copied, one row of
        block_size * Hkv * D elements each, rather than one index per key position."""
        B, nb = g.block_tables.shape
        blocks = cache.view(-1, g.block_size * cache.shape[1] * cache.shape[2]).index_select(0, g.block_tables.view(-1))
        return blocks.view(B, nb * g.block_size, *cache.shape[1:])[:, :g.num_keys].transpose(1, 2)
