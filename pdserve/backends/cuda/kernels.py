"""Triton kernels of the CUDA backend: the KV write and paged attention over one mixed batch.

paged_attention serves prefill chunks and decodes in one launch. A program takes one tile of a
sequence's queries (BLOCK_Q consecutive query tokens) for one KV head, with all the query heads
that share that KV head stacked as rows (GQA: BLOCK_Q x group rows), so each K/V tile read from the
cache serves every head of the group. It walks the sequence's keys in tiles of BLOCK_N positions,
each key's slot looked up in the block table (the cache is read in place, whatever the block
size), with an online softmax (flash attention's running max and sum). A query sees the keys at
positions <= its own (its cached prefix and its chunk's earlier tokens), within its layer's sliding
window. Which tile each program takes is a list the step's metadata builds (metadata.py), so the
grid is (tiles, KV heads, splits) with no search in the kernel. Splits (split-KV, flash-decoding)
are for a small batch of decodes, whose few programs would each walk a whole context while most
SMs idle: SPLITS programs share a tile's keys, each writing its running max, sum and unnormalized
output, and _combine_splits rescales them to one softmax.

Under Triton's interpreter (TRITON_INTERPRET=1, the CPU test suite) bf16 is held as its bit
pattern and arithmetic on it is wrong, so FP32_DOT widens the tiles to fp32 before the dots; on a
GPU bf16/fp16 tiles go to the tensor cores as they are, accumulating in fp32, and an fp32 model's
dots are IEEE fp32 (not TF32): fp32 is the precision exactness is checked in."""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
              stride_kt, stride_vt, stride_kc, stride_vc, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    """One token's K and V rows (Hkv x D, contiguous) into its cache slot; slot < 0 is padding."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        i = tl.arange(0, ROW_PAD)
        ok = i < ROW
        tl.store(k_cache_ptr + slot * stride_kc + i, tl.load(k_ptr + t * stride_kt + i, mask=ok), mask=ok)
        tl.store(v_cache_ptr + slot * stride_vc + i, tl.load(v_ptr + t * stride_vt + i, mask=ok), mask=ok)


@triton.jit
def _tile_rows(work_seq_ptr, work_q0_ptr, starts_ptr, q_lens_ptr, ctx_lens_ptr,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The rows of this program's tile: its sequence, query span, and each row's query and head."""
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(work_seq_ptr + w)
    q0 = tl.load(work_q0_ptr + w)           # the tile's first query, counted in its sequence's chunk
    start = tl.load(starts_ptr + seq)       # the chunk's first row in the flat batch
    q_len = tl.load(q_lens_ptr + seq)       # 0: a padding sequence of a captured batch
    ctx = tl.load(ctx_lens_ptr + seq)       # keys after this step: cached prefix + chunk
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = q0 + r // GROUP_PAD
    g = r % GROUP_PAD
    head = kvh * GROUP + g
    row_ok = (qi < q_len) & (g < GROUP)
    rows = (start + qi).to(tl.int64)
    return seq, q0, q_len, ctx, qi, g, head, row_ok, rows


@triton.jit
def _store_rows(out_ptr, x, rows, head, row_ok, stride_ot, stride_oh, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    d = tl.arange(0, D_PAD)
    tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             x.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])


@triton.jit
def _paged_attention(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr, part_acc_ptr, part_ml_ptr,
                     tables_ptr, starts_ptr, q_lens_ptr, ctx_lens_ptr, work_seq_ptr, work_q0_ptr,
                     scale, softcap, window, block_size,
                     stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                     stride_ot, stride_oh, stride_table,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                     HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr,
                     FP32_DOT: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr):
    kvh = tl.program_id(1)
    split = tl.program_id(2)                # of SPLITS programs sharing the tile's keys (split-KV)
    seq, q0, q_len, ctx, qi, g, head, row_ok, rows = _tile_rows(
        work_seq_ptr, work_q0_ptr, starts_ptr, q_lens_ptr, ctx_lens_ptr, GROUP, GROUP_PAD, BLOCK_Q)
    M: tl.constexpr = BLOCK_Q * GROUP_PAD
    q_pos = ctx - q_len + qi                # each row's position in its sequence
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    m = tl.full([M], -1e30, tl.float32)       # finite: a row with no key yet keeps exp(m - m_new) = 1
    l = tl.zeros([M], tl.float32)
    if HAS_SINKS:   # a sink joins the softmax as one more logit with no value: the first split's sum starts from it
        sink = tl.load(sinks_ptr + head, mask=g < GROUP, other=0.0).to(tl.float32)
        m = tl.where(split == 0, sink, m)
        l = tl.where(split == 0, 1.0, l)
    acc = tl.zeros([M, D_PAD], tl.float32)

    last = tl.minimum(q0 + BLOCK_Q, q_len) - 1
    hi = ctx - q_len + last + 1             # keys past the tile's last query are never seen
    lo = 0
    if WINDOWED:                            # nor keys before the first query's window
        lo = tl.maximum(ctx - q_len + q0 - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    for n0 in range(lo + split * BLOCK_N, hi, BLOCK_N * SPLITS):   # split s: key tiles s, s + SPLITS, ...
        k_pos = n0 + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        block = tl.load(tables_ptr + seq * stride_table + k_pos // block_size, mask=k_ok, other=0)
        slot = block.to(tl.int64) * block_size + k_pos % block_size
        kt = tl.load(k_cache_ptr + slot[None, :] * stride_ks + kvh * stride_kh + d[:, None],
                     mask=k_ok[None, :] & d_ok[:, None], other=0.0)          # (D_PAD, BLOCK_N)
        vt = tl.load(v_cache_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                     mask=k_ok[:, None] & d_ok[None, :], other=0.0)          # (BLOCK_N, D_PAD)
        if FP32_DOT:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        if IEEE:   # fp32 models are for exactness: not TF32's 10-bit mantissas
            s = tl.dot(q, kt, input_precision="ieee") * scale
        else:
            s = tl.dot(q, kt) * scale
        if SOFTCAP:   # cap * tanh(s / cap), tanh(x) = 2 sigmoid(2x) - 1
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        seen = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if WINDOWED:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m = m_new

    if SPLITS == 1:
        l = tl.where(l == 0.0, 1.0, l)      # a padding row saw no key: keep it finite
        _store_rows(out_ptr, acc / l[:, None], rows, head, row_ok, stride_ot, stride_oh, HEAD_DIM, D_PAD)
    else:   # this split's running max, sum and unnormalized output, for _combine_splits
        part = ((tl.program_id(0) * tl.num_programs(1) + kvh) * SPLITS + split) * M + tl.arange(0, M)
        tl.store(part_ml_ptr + 2 * part, m)
        tl.store(part_ml_ptr + 2 * part + 1, l)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc)


@triton.jit
def _combine_splits(part_acc_ptr, part_ml_ptr, out_ptr, starts_ptr, q_lens_ptr, ctx_lens_ptr, work_seq_ptr,
                    work_q0_ptr, stride_ot, stride_oh,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr):
    """The splits' softmaxes as one: each split's sum and output rescaled to the largest max."""
    _, _, _, _, _, _, head, row_ok, rows = _tile_rows(
        work_seq_ptr, work_q0_ptr, starts_ptr, q_lens_ptr, ctx_lens_ptr, GROUP, GROUP_PAD, BLOCK_Q)
    M: tl.constexpr = BLOCK_Q * GROUP_PAD
    first = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * SPLITS * M + tl.arange(0, M)
    d = tl.arange(0, D_PAD)
    m = tl.full([M], -1e30, tl.float32)
    for s in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(part_ml_ptr + 2 * (first + s * M)))
    l = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D_PAD], tl.float32)
    for s in tl.static_range(SPLITS):
        part = first + s * M
        w = tl.exp(tl.load(part_ml_ptr + 2 * part) - m)
        l += w * tl.load(part_ml_ptr + 2 * part + 1)
        acc += w[:, None] * tl.load(part_acc_ptr + part[:, None] * D_PAD + d[None, :])
    l = tl.where(l == 0.0, 1.0, l)
    _store_rows(out_ptr, acc / l[:, None], rows, head, row_ok, stride_ot, stride_oh, HEAD_DIM, D_PAD)


KEY_TILE = 64   # key positions per step of a program's loop (a tensor-core tile needs >= 16)


def interpreted() -> bool:
    """These kernels were made by Triton's interpreter (TRITON_INTERPRET=1 when this module was imported)."""
    return not isinstance(_paged_attention, triton.runtime.JITFunction)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D) with each token's heads one contiguous row, as the kernels index it."""
    ok = x.stride(2) == 1 and x.stride(1) == x.shape[2]
    return x if ok else x.contiguous()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: (T, Hkv, D) into the (slots, Hkv, D) caches at slot_mapping (T,); slots < 0 skipped."""
    k, v = _rows(k), _rows(v)
    row = k.shape[1] * k.shape[2]
    _store_kv[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                             k_cache.stride(0), v_cache.stride(0), ROW=row, ROW_PAD=triton.next_power_of_2(row))


def tile_config(d_pad: int, element_size: int, rows: int) -> tuple[int, int]:
    """(key tile, warps) of a launch. Wide rows (fp32, or a head of 256) take half the key tile, so
    that the tiles fit in shared memory; tiles of more than 4096 elements (the accumulator's rows or
    the key tile, times the head) take 8 warps, so that they fit in registers (ptxas for sm_90,
    Llama-3-8B's bf16 head of 128: 4 warps spill 1.7 kB a thread at 64 rows, 0.7 kB at 16; 8 warps
    about none)."""
    block_n = max(16, KEY_TILE // 2) if d_pad * element_size > 256 else KEY_TILE
    return block_n, 8 if max(rows, block_n) * d_pad > 4096 else 4


def kv_splits(num_tiles: int, num_kv_heads: int, num_sms: int | None) -> int:
    """How many programs share a tile's keys (split-KV, flash-decoding): enough for two programs an
    SM when the step has few (a small batch of decodes has num_tiles x KV heads programs, each over
    its whole context), at most MAX_SPLITS. 1 where the SM count is unknown (not a GPU)."""
    if not num_sms:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * num_sms // (num_tiles * num_kv_heads))))


MAX_SPLITS = 16


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, meta,
                    scale: float, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> None:
    """q, out: (T, H, D); the caches (slots, Hkv, D). meta: the step's metadata.CudaAttentionMetadata."""
    T, H, D = q.shape
    Hkv = k_cache.shape[1]
    group = H // Hkv
    group_pad = triton.next_power_of_2(group)
    q = _rows(q)
    tiles, splits = meta.work_seq.shape[0], meta.kv_splits
    d_pad = max(16, triton.next_power_of_2(D))
    block_n, warps = tile_config(d_pad, q.element_size(), meta.block_q * group_pad)
    shape = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=meta.block_q, HEAD_DIM=D, D_PAD=d_pad)
    part_acc = part_ml = out   # unused with one split
    if splits > 1:
        rows = tiles * Hkv * splits * meta.block_q * group_pad
        part_acc = torch.empty(rows * d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows * 2, dtype=torch.float32, device=q.device)
    _paged_attention[(tiles, Hkv, splits)](
        q, k_cache, v_cache, out, sinks if sinks is not None else q, part_acc, part_ml,
        meta.block_tables, meta.seq_starts, meta.q_lens, meta.ctx_lens, meta.work_seq, meta.work_q0,
        scale, softcap or 0.0, window or 0, meta.block_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), meta.block_tables.stride(0), BLOCK_N=block_n,
        HAS_SINKS=sinks is not None, SOFTCAP=softcap is not None, WINDOWED=window is not None,
        FP32_DOT=interpreted() and q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32, SPLITS=splits,
        num_warps=warps, num_stages=2, **shape)
    if splits > 1:
        _combine_splits[(tiles, Hkv)](part_acc, part_ml, out, meta.seq_starts, meta.q_lens, meta.ctx_lens,
                                      meta.work_seq, meta.work_q0, out.stride(0), out.stride(1), SPLITS=splits,
                                      num_warps=warps, **shape)
