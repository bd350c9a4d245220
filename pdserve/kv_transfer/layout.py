"""Where a sequence's K/V bytes lie in a worker's paged cache, by token position.

ModelRunner.kv_cache is [planes, num_layers, slots, heads, dim] (engine/kv_spec.py): one token's K
(or V) of one layer is a contiguous row of heads * dim values, and a block's rows are consecutive
slots; an MLA model's cache has one plane, its latent rows. The two workers' block tables differ,
so both sides turn the same token positions into runs of consecutive slots of their own table; a
layer's payload is then K of every run, then V of every run (each plane in turn), in position
order, on either side."""
import ctypes

import torch


def slot_runs(block_table: list[int], block_size: int, start: int, end: int) -> list[tuple[int, int]]:
    """Positions [start, end) of a sequence as (first slot, count) runs of consecutive slots."""
    runs: list[list[int]] = []
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        count = min(block_size - offset, end - pos)
        slot = block_table[block] * block_size + offset
        if runs and runs[-1][0] + runs[-1][1] == slot:   # the next block follows this one in memory
            runs[-1][1] += count
        else:
            runs.append([slot, count])
        pos += count
    return [(s, c) for s, c in runs]


class KVLayout:
    """Reads and writes one layer's K/V of some slot runs, as bytes (CPU: views of the cache
    itself, no copy; a GPU cache goes through host memory)."""

    def __init__(self, kv_cache: torch.Tensor):
        self.kv_cache = kv_cache
        self.planes, self.num_layers, self.num_slots, heads, dim = kv_cache.shape
        self.row_bytes = heads * dim * kv_cache.element_size()
        self.on_cpu = kv_cache.device.type == "cpu"
        if self.on_cpu:
            assert kv_cache.is_contiguous()
            raw = (ctypes.c_char * (kv_cache.numel() * kv_cache.element_size())).from_address(kv_cache.data_ptr())
            self.raw = memoryview(raw).cast("B")

    @classmethod
    def of_buffer(cls, buf: memoryview, planes: int, num_layers: int, num_slots: int, row_bytes: int) -> "KVLayout":
        """A read-only layout over raw cache bytes (another worker's cache, mapped)."""
        layout = cls.__new__(cls)
        layout.kv_cache, layout.num_layers, layout.num_slots, layout.row_bytes = None, num_layers, num_slots, row_bytes
        layout.planes = planes
        layout.on_cpu, layout.raw = True, buf.cast("B") if buf.format != "B" else buf
        return layout

    def layer_bytes(self, runs) -> int:
        return self.planes * sum(c for _, c in runs) * self.row_bytes

    def _offset(self, kv: int, layer: int, slot: int) -> int:
        return ((kv * self.num_layers + layer) * self.num_slots + slot) * self.row_bytes

    def read_layer(self, layer: int, runs) -> list:
        """The layer's payload as a list of buffers (K of each run, then V of each run)."""
        if self.on_cpu:
            rb = self.row_bytes
            return [self.raw[self._offset(kv, layer, s):self._offset(kv, layer, s) + c * rb]
                    for kv in range(self.planes) for s, c in runs]
        slots = self._slots(runs)
        return [memoryview(self.kv_cache[:, layer, slots].contiguous().cpu().view(torch.uint8).numpy()).cast("B")]

    def write_views(self, layer: int, runs) -> list | None:
        """Buffers of this layer's runs that a payload can be received into directly, in payload
        order (CPU; None on a GPU: receive into host memory, then write_layer)."""
        return self.read_layer(layer, runs) if self.on_cpu else None

    def write_layer(self, layer: int, runs, payload: memoryview) -> None:
        """Store a payload read_layer made (on either worker) into these runs."""
        assert len(payload) == self.layer_bytes(runs)
        if self.on_cpu:
            rb, at = self.row_bytes, 0
            for kv in range(self.planes):
                for s, c in runs:
                    o = self._offset(kv, layer, s)
                    self.raw[o:o + c * rb] = payload[at:at + c * rb]
                    at += c * rb
            return
        slots = self._slots(runs)
        _, _, _, heads, dim = self.kv_cache.shape
        src = torch.frombuffer(payload, dtype=torch.uint8).view(self.kv_cache.dtype).view(self.planes, len(slots), heads, dim)
        self.kv_cache[:, layer].index_copy_(1, slots, src.to(self.kv_cache.device))

    def _slots(self, runs) -> torch.Tensor:
        idx = [s + i for s, c in runs for i in range(c)]
        return torch.tensor(idx, dtype=torch.long, device=self.kv_cache.device)
