"""CUDA graphs of decode steps: the model's forward over a batch of decodes, captured at start
for a few batch sizes (buckets) and replayed, so a decode step costs one graph launch instead of
a few hundred kernel launches from Python.

A step of B decodes replays the smallest captured size >= B, its batch padded to that size
(metadata.pack_step: padding tokens write no KV, padding sequences attend to nothing). The captured
graphs read their inputs from one static int64 buffer on the device (the step's token ids,
positions, slots and attention metadata, laid out as pack_step lays them, the block tables at a
fixed width: max_model_len's blocks), which each step fills with two copies before the replay."""
import bisect
import logging
from array import array

import torch

from pdserve.backends.cuda.metadata import pack_step, step_metadata

log = logging.getLogger("pdserve")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs, which is always one (vLLM's schedule):
    a batch pads to at most 7 more sequences, and about max_num_seqs / 8 graphs are captured."""
    sizes = {s for s in (1, 2, 4) if s < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs}
    return sorted(sizes)


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    """The captured size a batch of `batch` decodes replays (the smallest >= batch); None: larger than all."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def decode_only(groups: list[tuple]) -> bool:
    """Every sequence of the step has one query (the runner's groups: q_lens first)."""
    return all(max(g[0]) == 1 for g in groups)


class DecodeGraphs:
    """forward(input_ids, positions, meta) -> hidden, captured for each of sizes."""

    def __init__(self, sizes: list[int], table_width: int, block_size: int, block_q: int, device: torch.device,
                 kv_splits=lambda size: 1):
        self.sizes, self.width, self.block_size, self.block_q = sizes, table_width, block_size, block_q
        self.device, self.kv_splits = device, kv_splits   # kv_splits(size): split-KV programs of a size's graph
        ints, _, _ = self._pack(sizes[-1])
        self.buffer = torch.zeros(len(ints), dtype=torch.long, device=device)
        self.graphs: dict[int, tuple] = {}   # size -> (graph, its output, its flat views, its metadata)

    def _pack(self, size: int, flat=None, groups=None):
        if flat is None:   # a dummy batch of `size` decodes at position 0 of block 0, writing no KV
            flat = [[0] * size, [0] * size, [-1] * size]
            groups = [([1] * size, list(range(size)), [1] * size, [[0]] * size)]
        return pack_step(flat, groups, self.block_size, self.block_q, pad_to=size, table_width=self.width)

    def _views(self, size: int, sizes: list[int]):
        flat, meta = step_metadata(self.buffer, sizes, self.width, 3, self.block_size, self.block_q)
        meta.graph_batch, meta.kv_splits = size, self.kv_splits(size)
        return flat, meta

    def capture(self, forward) -> None:
        """Each size's graph, the largest first, all in one memory pool. forward runs once eagerly
        first (Triton compiles its kernels, the allocator sees the shapes) on a side stream, as
        torch.cuda.graph asks."""
        pool = None
        for size in reversed(self.sizes):
            ints, sizes, _ = self._pack(size)
            self.buffer[:len(ints)].copy_(torch.tensor(ints, dtype=torch.long))
            flat, meta = self._views(size, sizes)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                forward(flat[0], flat[1], meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(flat[0], flat[1], meta)
            pool = graph.pool()
            self.graphs[size] = (graph, out, flat, meta)
        torch.cuda.synchronize(self.device)

    def prepare(self, flat: list[list[int]], groups: list[tuple]):
        """The step's flat tensors and metadata in the static buffer, for a batch of decodes a graph
        was captured for; None otherwise (the step runs eagerly)."""
        if not self.graphs or not decode_only(groups):
            return None
        size = bucket_for(len(flat[-1]), self.sizes)
        if size is None or max(n for g in groups for n in g[2]) > self.width * self.block_size:
            return None
        # the block tables at this step's width, not the graph's (max_model_len's blocks a row):
        # a row's entries past its context are never read, so they may keep an earlier step's
        ints, sizes, width = pack_step(flat, groups, self.block_size, self.block_q, pad_to=size)
        host = torch.frombuffer(array("q", ints), dtype=torch.long)
        n = sum(sizes[:-1])
        _, _, views, meta = self.graphs[size]
        self.buffer[:n].copy_(host[:n])
        meta.block_tables[:, :width].copy_(host[n:].view(size, width))
        B = len(flat[-1])
        return [v[:B] for v in views], meta

    def replay(self, meta, batch: int) -> torch.Tensor:
        graph, out, _, _ = self.graphs[meta.graph_batch]
        graph.replay()
        return out[:batch]
