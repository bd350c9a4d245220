"""The packed weights and the KV cache are marked for huge pages (pdserve/backends/cpu/hugepages.py)."""
import ctypes
import mmap
import sys

import pytest
import torch
from torch import nn

from pdserve.backends.cpu import hugepages
from pdserve.backends.cpu.packed_linear import pack_weight


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "none"
    return text.split("[")[1].split("]")[0]


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in ("never", "none"),
                                reason="no transparent huge pages here")


def _eligible(addr: int) -> bool:
    """THPeligible of the mapping holding addr, from /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {addr:#x}")


def _middle(t: torch.Tensor) -> int:
    return t.data_ptr() + t.numel() * t.element_size() // 2


def test_empty_is_marked_and_a_plain_mapping_is_not():
    t = hugepages.empty(16 << 20, dtype=torch.uint8)
    assert _eligible(_middle(t))
    if _thp_mode() == "madvise":   # in "always" mode every mapping is eligible
        # The control is a fresh anonymous mapping, not torch.empty: once glibc serves big blocks
        # from the heap, the heap may already hold (or grow from) a range advised earlier in the
        # process, and then a plain torch.empty is eligible too.
        plain = mmap.mmap(-1, 16 << 20)
        view = ctypes.c_char.from_buffer(plain)
        try:
            assert not _eligible(ctypes.addressof(view) + (8 << 20))
        finally:
            del view
            plain.close()


def test_tensor_smaller_than_a_huge_page_is_left_alone():
    assert not hugepages.advise_hugepages(torch.empty(1 << 20, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_packed_weights_are_marked(fmt):
    w = nn.Linear(2048, 4096, bias=False).weight.detach()
    packed, _ = pack_weight(w, fmt)
    assert _eligible(_middle(packed))


def test_kv_cache_is_marked_and_zeroed(tiny_llama):
    from pdserve.engine.llm_engine import LLMEngine
    cache = LLMEngine(tiny_llama, kv_cache_memory=32 << 20).runner.kv_cache
    assert _eligible(_middle(cache))
    assert not cache.any()


def test_arena_places_tensors_aligned_in_huge_page_chunks():
    arena = hugepages.Arena()
    a = arena.empty((3, 5), torch.float32)          # 60 bytes: the next one starts 64 bytes on
    b = arena.empty((1000,), torch.bfloat16)
    big = arena.empty((hugepages.Arena.CHUNK + 1,), torch.uint8)   # larger than a chunk: one of its own
    c = arena.empty((7,), torch.int8)
    assert a.data_ptr() % hugepages.HUGE == 0
    assert b.data_ptr() == a.data_ptr() + 64
    assert big.data_ptr() % hugepages.HUGE == 0 and big.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert c.data_ptr() == big.data_ptr() + -(-(hugepages.Arena.CHUNK + 1) // 64) * 64
    for t in (a, b, c):
        t.fill_(3)
        assert (t == 3).all() and t.is_contiguous()
    assert _eligible(a.data_ptr()) and _eligible(b.data_ptr()) and _eligible(c.data_ptr())
    assert (a == 3).all()   # c's writes went to the big chunk, not over a


@pytest.mark.usefixtures("cpu_isa")   # packed weights come with the kernels
def test_small_packed_weights_are_on_huge_pages(tiny_llama):
    # Each of this model's packed weights is smaller than a huge page: allocated alone, none would
    # be marked. pack_model puts them in one arena.
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.backends.cpu.packed_linear import PackedLinear
    model = LLMEngine(tiny_llama, kv_cache_memory=8 << 20).runner.model
    packed = [m.packed for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(p.numel() * p.element_size() < hugepages.HUGE for p in packed)
    assert all(_eligible(p.data_ptr()) for p in packed)


_PACK_RSS = """
import sys, torch
from torch import nn
from pdserve.backends.cpu.packed_linear import pack_model

def rss():
    return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith("VmRSS"))

big = torch.ones(32 << 20, dtype=torch.uint8); del big   # glibc now serves 4 MB blocks from its heap
before = rss()
model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(48)])   # 192 MiB of weights
with torch.no_grad():
    pack_model(model, "fp32", None)
print((rss() - before) / (192 << 20))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_packing_leaves_no_freed_originals_resident():
    # pack_model frees each original weight; the packed copies live in an arena, so unless the heap
    # is trimmed the originals' memory stays resident next to them (twice the model).
    import subprocess
    out = subprocess.run([sys.executable, "-c", _PACK_RSS], capture_output=True, text=True, check=True).stdout
    assert float(out) < 1.4, f"resident after packing: {out.strip()} x the weights"
