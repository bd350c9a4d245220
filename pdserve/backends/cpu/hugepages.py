"""Huge pages for the big CPU buffers: the packed weights and the KV cache.

Decode streams every weight once per step. On 4 KiB pages that is a TLB miss every 4 KiB
(480k page walks per step for a 2 GB model), and the KV cache's blocks are scattered pages of
their own. Linux backs a range with 2 MiB pages when it is marked MADV_HUGEPAGE before it is first
touched (transparent huge pages in "madvise" mode, the common default; "always" needs no mark,
"never" ignores it). torch's allocator does not mark its memory unless THP_MEM_ALLOC_ENABLE is set
before torch starts, so we mark our own: on the 0.5B model a batch-1 decode step is 1.12x as fast
on 2 MiB pages (docs/PERFORMANCE.md).

Only the whole 2 MiB pages inside a range can be huge: a tensor allocated alone starts and ends
mid-page, and a 3-4 MB matrix then sits largely on 4 KiB pages (the 0.5B model's o_proj 30% huge,
qkv_proj 51%). Arena places the packed weights one after another in 2 MiB-aligned chunks."""
import ctypes
import sys

import torch

MADV_HUGEPAGE = 14
HUGE = 2 << 20


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    except OSError:
        return None


_LIBC = _libc()


def advise_hugepages(t: torch.Tensor) -> bool:
    """Mark the 2 MiB-aligned pages inside `t`'s memory MADV_HUGEPAGE; True if marked. Call it
    before the memory is first written: pages already present stay small."""
    if _LIBC is None or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // HUGE) * HUGE, end // HUGE * HUGE
    if hi <= lo:
        return False   # smaller than one aligned huge page
    return _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE) == 0


def _aligned_chunk(nbytes: int) -> torch.Tensor:
    """nbytes (a multiple of HUGE) of uint8 starting on a 2 MiB boundary, marked for huge pages. The
    slack before the boundary is never touched, so it costs address space, not memory."""
    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE
    chunk = raw[start:start + nbytes]
    advise_hugepages(chunk)
    return chunk


class Arena:
    """Tensors placed one after another (64-byte aligned) in 2 MiB-aligned chunks on huge pages, so
    that every weight but the last chunk's end is on 2 MiB pages. A chunk lives as long as a tensor
    in it does. Pages of a chunk never written (its unused end) are never backed by memory."""

    ALIGN = 64
    CHUNK = 256 << 20

    def __init__(self):
        self.chunk, self.used = None, 0

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        off = -(-self.used // self.ALIGN) * self.ALIGN
        if self.chunk is None or off + nbytes > self.chunk.numel():
            self.chunk, off = _aligned_chunk(max(self.CHUNK, -(-nbytes // HUGE) * HUGE)), 0
        self.used = off + nbytes
        return self.chunk[off:off + nbytes].view(dtype).view(shape)


def trim_heap() -> bool:
    """Give the heap's free pages back to the OS (glibc's malloc_trim); True if it ran. Packing frees
    each original weight, and an arena does not reuse that memory as per-tensor copies did: left
    in the heap it stayed resident (+330 MB on the 0.5B model)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


def empty(*shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """torch.empty, on huge pages where the platform gives them (CPU, Linux)."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    advise_hugepages(t)
    return t
