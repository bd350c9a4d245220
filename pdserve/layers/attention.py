"""Paged attention over one flattened batch of tokens.

The engine step puts prefill chunks and decode tokens of many sequences into one flat batch of T
tokens. Each layer writes the new K/V into their cache slots (an index write) and then lets every
query attend to its own sequence's cached K/V. Decodes (one query each) and prefill chunks (many
queries each) form two groups, each one call with no Python loop over sequences: here each group
is gathered, padded and masked for one batched scaled_dot_product_attention call (the CPU
backend's kernels read the cache in place instead: backends/cpu/layers.py).

The per-step metadata (slot mapping, gather indices, masks) is built once per step by the model
runner and made visible to every layer through `attention_context` for the duration of the forward.
"""
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionGroup:
    """Sequences whose queries are padded to the same length for one SDPA call (the torch path)."""
    token_idx: torch.Tensor   # (B, Q) index of each query in the flat batch (padding repeats a valid one)
    query_valid: torch.Tensor  # (B, Q) bool, False on padding
    block_tables: torch.Tensor  # (B, ceil(K / block_size)) the blocks holding each sequence's keys (padding: 0)
    num_keys: int             # K: the longest context in the group
    block_size: int
    ctx_lens: torch.Tensor    # (B,) int64: keys of each sequence, this step's included
    mask: torch.Tensor        # (B, 1, Q, K) bool: causal within the sequence, False on padding
    q_pos: torch.Tensor       # (B, Q) each query's position in its sequence: a layer's window is cut from it
    windowed: dict = field(default_factory=dict)   # sliding window -> its mask, made by the first layer that asks

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask of a layer with this sliding window (None: full attention): each window's
        once per step, shared by the layers that have it."""
        if window is None:
            return self.mask
        if window not in self.windowed:
            k_pos = torch.arange(self.num_keys, device=self.q_pos.device)
            self.windowed[window] = self.mask & (k_pos[None, None, :] > self.q_pos[:, :, None] - window)[:, None]
        return self.windowed[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor       # (T,) cache slot each new token's K/V is written to
    groups: list[AttentionGroup]     # the torch path's masked groups (none on the CPU kernels' path)
    # The CPU kernels' path: a C++ AttentionStep (backends/cpu/kernels/decoder.h), every tensor a
    # view of the step's one int64 buffer; the decoder stack takes it as it is.
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


def build_metadata(flat: list[list[int]], groups: list[tuple], block_size: int,
                   device) -> tuple[list[torch.Tensor], AttentionMetadata]:
    """One step's attention metadata for the masked SDPA path, and its per-token integer lists as
    tensors.

    flat: per-token lists of the step (the runner's input ids, positions, slots), the last being
    the slot mapping. groups: (q_lens, starts, ctx_lens, block_tables) of each group, whose sequences
    have q_lens queries starting at flat index starts and a cached context of ctx_lens tokens after
    this step; a group of one-query sequences is the decodes. A sliding window is each layer's own
    (PagedAttention.sliding_window), cut from the causal mask there. (The CPU backend's kernels
    need no mask and no padding: backends/cpu/metadata.py builds theirs.)"""
    ints, sizes = [], []
    for x in flat:
        ints += x
        sizes.append(len(x))
    tensors = torch.frombuffer(array("q", ints), dtype=torch.long).to(device).split(sizes)
    built = [_masked_group(*g, block_size, device) for g in groups]
    return list(tensors), AttentionMetadata(tensors[-1], built)


def _add_tables(ints: list[int], tables: list[list[int]], num_keys: int, block_size: int) -> int:
    """Append the block tables, each cut or padded with block 0 to the blocks of num_keys keys; returns that count."""
    nb = (num_keys + block_size - 1) // block_size
    for t in tables:
        ints += t[:nb]
        if len(t) < nb:
            ints += [0] * (nb - len(t))
    return nb


def _masked_group(q_lens: list[int], starts: list[int], ctx_lens: list[int], block_tables: list[list[int]],
                  block_size: int, device) -> AttentionGroup:
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
    return AttentionGroup(token_idx.to(device), query_valid.to(device), tables.to(device), K, block_size, ctx_t.to(device),
                          mask[:, None].to(device), q_pos.to(device))


class PagedAttention(nn.Module):
    """sliding_window: this layer's (None: full attention; models with interleaved local and global
    layers give each its own). logit_softcap: scores become cap * tanh(scores / cap) before the
    softmax (Gemma 2), None: none. sinks: a learned logit per head (`sinks`, gpt-oss) that joins
    each query's softmax denominator and has no value: the weights of the real keys sum below one."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None, sinks: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        # Set by the model runner once the cache is allocated: (num_slots, Hkv, D) views.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, Hkv, D). Returns (T, H * D)."""
        meta = get_attention_metadata()
        # The KV write is an index write into the flat slot view of the paged cache.
        self.k_cache.index_copy_(0, meta.slot_mapping, k)
        self.v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for g in meta.groups:
            qg = q[g.token_idx].transpose(1, 2)                 # (B, H, Q, D)
            kg = self._gather(self.k_cache, g)                  # (B, Hkv, K, D)
            vg = self._gather(self.v_cache, g)
            mask = g.mask_for(self.sliding_window)
            if self.logit_softcap is None and self.sinks is None:
                og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=self.scale,
                                                    enable_gqa=self.num_heads != self.num_kv_heads)
            else:
                og = self._explicit(qg, kg, vg, mask)
            og = og.transpose(1, 2)                               # (B, Q, H, D)
            out[g.token_idx[g.query_valid]] = og[g.query_valid]
        return out.reshape(q.shape[0], -1)

    def _explicit(self, q, k, v, mask):
        """SDPA with capped scores or sinks (SDPA itself has neither). q: (B, H, Q, D), k, v: (B, Hkv, K, D)."""
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        if self.logit_softcap is not None:
            scores = self.logit_softcap * torch.tanh(scores / self.logit_softcap)
        scores = scores.masked_fill(~mask, float("-inf")).float()
        if self.sinks is not None:   # one more logit per head in the softmax, dropped after it
            B, H, Q, _ = scores.shape
            scores = torch.cat([scores, self.sinks.float().view(1, H, 1, 1).expand(B, H, Q, 1)], dim=-1)
        # a padded query row has no valid key: its output is dropped, only keep it finite
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        if self.sinks is not None:
            probs = probs[..., :-1]
        return probs.to(v.dtype) @ v

    @staticmethod
    def _gather(cache: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """The group's keys (or values) as (B, Hkv, K, D): whole blocks are copied, one row of
        block_size * Hkv * D elements each, rather than one index per key position."""
        B, nb = g.block_tables.shape
        blocks = cache.view(-1, g.block_size * cache.shape[1] * cache.shape[2]).index_select(0, g.block_tables.view(-1))
        return blocks.view(B, nb * g.block_size, *cache.shape[1:])[:, :g.num_keys].transpose(1, 2)
