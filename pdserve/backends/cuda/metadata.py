"""One step's attention metadata for the CUDA backend's kernels: no mask, no padding of queries.

Every sequence of the step (prefill chunks and decodes alike) is one row of small tensors: where
its chunk starts in the flat batch, its query count, its key count after the step, its block table.
The kernel's programs are tiles of block_q queries of one sequence, listed here (work_seq, work_q0)
so that the grid needs no search. All the step's integers go to the device in one copy, as one
int64 buffer that the tensors are views of. A captured CUDA graph's batch (graphs.py) is padded to
its bucket: padding sequences have no queries and padding tokens the slot -1, which the KV write skips."""
from array import array
from dataclasses import dataclass

import torch

from pdserve.layers.attention import AttentionMetadata


@dataclass
class CudaAttentionMetadata(AttentionMetadata):
    seq_starts: torch.Tensor = None    # (B,) first flat row of each sequence's chunk
    q_lens: torch.Tensor = None        # (B,) queries of each sequence this step
    ctx_lens: torch.Tensor = None      # (B,) keys of each sequence after this step
    block_tables: torch.Tensor = None  # (B, width) cache blocks of each sequence (padding: 0)
    work_seq: torch.Tensor = None      # (W,) the sequence of each query tile
    work_q0: torch.Tensor = None       # (W,) the tile's first query within its sequence's chunk
    block_q: int = 1                   # queries per tile
    kv_splits: int = 1                 # programs sharing each tile's keys (kernels.kv_splits)
    block_size: int = 16
    graph_batch: int | None = None     # the captured batch size this step replays (None: eager)


def pack_step(flat: list[list[int]], groups: list[tuple], block_size: int, block_q: int,
              pad_to: int | None = None, table_width: int | None = None) -> tuple[list[int], list[int], int]:
    """The step's integers in one list, the sizes of its parts and the block tables' width.

    flat, groups: as layers/attention.py's build_metadata takes them (the last flat list is the slot
    mapping). pad_to: the sequence count to pad to, each padding sequence one token (a decode
    batch of a captured graph); table_width: the block tables' width (a graph's is fixed)."""
    q_lens, starts, ctx_lens, tables = [], [], [], []
    for g in groups:
        q_lens += g[0]
        starts += g[1]
        ctx_lens += g[2]
        tables += g[3]
    flat = [list(x) for x in flat]
    if pad_to is not None:
        extra = pad_to - len(q_lens)
        assert extra >= 0 and len(flat[-1]) == len(q_lens), "only a batch of decodes is padded"
        for x in flat[:-1]:
            x += [0] * extra     # token 0 at position 0: computed, never written, never read
        flat[-1] += [-1] * extra
        starts += range(len(q_lens), pad_to)
        q_lens += [0] * extra
        ctx_lens += [0] * extra
        tables += [[]] * extra
    width = table_width or max(1, max((-(-n // block_size) for n in ctx_lens), default=1))
    work_seq, work_q0 = [], []
    for i, n in enumerate(q_lens):
        for q0 in range(0, max(n, 1), block_q):   # a padding sequence has one tile, which stores nothing
            work_seq.append(i)
            work_q0.append(q0)
    ints = [t for x in flat for t in x] + starts + q_lens + ctx_lens + work_seq + work_q0
    for t in tables:
        row = t[:width]
        ints += row
        ints += [0] * (width - len(row))
    sizes = [len(x) for x in flat] + [len(starts)] * 3 + [len(work_seq)] * 2 + [len(tables) * width]
    return ints, sizes, width


def step_metadata(buffer: torch.Tensor, sizes: list[int], width: int, num_flat: int, block_size: int,
                  block_q: int) -> tuple[list[torch.Tensor], CudaAttentionMetadata]:
    """The flat tensors and the metadata as views of buffer, laid out by pack_step."""
    parts = list(buffer[:sum(sizes)].split(sizes))
    flat, (starts, q_lens, ctx_lens, work_seq, work_q0, tables) = parts[:num_flat], parts[num_flat:]
    meta = CudaAttentionMetadata(flat[-1], [], seq_starts=starts, q_lens=q_lens, ctx_lens=ctx_lens,
                                 block_tables=tables.view(-1, width), work_seq=work_seq, work_q0=work_q0,
                                 block_q=block_q, block_size=block_size)
    return flat, meta


def build_step_metadata(flat: list[list[int]], groups: list[tuple], block_size: int, device,
                        block_q: int) -> tuple[list[torch.Tensor], CudaAttentionMetadata]:
    """layers/attention.py's build_metadata (the same arguments, and the query tile) for the kernels."""
    ints, sizes, width = pack_step(flat, groups, block_size, block_q)
    host = torch.frombuffer(array("q", ints), dtype=torch.long)
    return step_metadata(host.to(device), sizes, width, len(flat), block_size, block_q)
