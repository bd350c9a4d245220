"""The packed weights in one huge-page arena (pdserve/hugepages.py: Arena, what pack_model does now)
against each in an allocation of its own (as before: only each one's aligned middle on 2 MiB
pages), by turns in one process (../step_ab.py): every PackedLinear's packed weight (and the
lm_head's screen) is pointed at one copy or the other with set_, which the decoder stack sees.
Usage: arena_ab.py MODEL BATCH final|stream ROUNDS STEPS"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from step_ab import decoding_engine, run  # noqa: E402

from pdserve import hugepages  # noqa: E402
from pdserve.layers.packed_linear import PackedLinear  # noqa: E402

HUGE = hugepages.HUGE


def huge_fraction(ts) -> float:
    """Of these tensors' bytes, the share the kernel backs with 2 MiB pages: a 2 MiB page counts if
    its mapping's AnonHugePages (/proc/self/smaps) covers it, pro rata of the mapping's resident
    memory (an arena chunk's unwritten end is not resident)."""
    maps = []   # (lo, hi, share of the mapping's resident memory on huge pages)
    lo = hi = rss = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
        elif head == "Rss:":
            rss = int(line.split()[1])
        elif head == "AnonHugePages:":
            maps.append((lo, hi, int(line.split()[1]) / rss if rss else 0.0))
    total = huge = 0.0
    for t in ts:
        s, n = t.data_ptr(), t.numel() * t.element_size()
        total += n
        for lo, hi, share in maps:
            huge += max(0, min(hi, s + n) - max(lo, s)) * share
    return huge / total


model, batch, kind, rounds, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
engine = decoding_engine(model, batch, kind == "final", rounds, steps)
held = []   # (the tensor the model and stack hold, its arena view, a copy allocated alone)
for m in engine.runner.model.modules():
    if isinstance(m, PackedLinear):
        for t in (m.packed, m.screen):
            if t is not None:
                held.append((t, t.view(t.shape), hugepages.empty(t.shape, dtype=t.dtype).copy_(t)))
print(f"{len(held)} tensors, {sum(t.numel() * t.element_size() for t, _, _ in held) / 1e6:.0f} MB; "
      f"inside whole huge pages: arena {huge_fraction(a for _, a, _ in held):.3f}, "
      f"alone {huge_fraction(c for _, _, c in held):.3f}")


def switch(arena: bool):
    with torch.inference_mode():
        for t, a, c in held:
            t.set_(a if arena else c)


run(engine, switch, rounds, steps)
