"""The forward's CPU thread count, chosen while the engine runs (issue 39).

On a quiet machine every core helps (2 threads: c32 1.7x one thread on a 0.5B model). But when
another process keeps a core busy, one of torch's OpenMP workers is often descheduled, and each
of a step's hundreds of parallel regions waits for it at its barrier, while the other worker spins
its own time slice away: measured, c32 fell to 0.32x its quiet figure with two threads against
0.95x with one (docs/PERFORMANCE.md, "Busy neighbours"). Neither count is right on every machine,
and neighbours come and go, so the engine measures: now and then it runs one step with a
neighbouring thread count and compares its time with recent steps of the same shape (same tokens
and sequences, so the same work) at the current count. When a count is clearly faster in
repeated probes, the engine switches to it and says so (log line, /metrics
pdserve:cpu_threads). Probes are spaced so that their extra cost stays near PROBE_SHARE of the
time: a probe that was 3x slower waits three times as long as one that was 1.5x slower.

Only where the thread count is pdserve's to choose: an explicit --threads N is kept."""
import logging
import math
from collections import deque

logger = logging.getLogger("pdserve")

PROBE_SHARE = 0.02   # the time probes may cost, as a share of all steps' time
MIN_GAP = 8          # steps between probes at least
SWITCH_BELOW = 0.85  # switch when a count's steps take less than this share of the current count's
PROBES_TO_SWITCH = 2  # ... in this many probes in a row (one descheduled step must not decide it)
RECENT = 8           # steps of a shape at the current count a probe is compared with


class ThreadTuner:
    def __init__(self, max_threads: int, set_threads):
        """set_threads(n) sets the forward's thread count (torch.set_num_threads)."""
        self.max_threads, self.set_threads = max_threads, set_threads
        self.current = max_threads
        self.num_changes = 0
        self._recent: dict[tuple, deque] = {}   # step shape -> recent durations at the current count
        self._gap = MIN_GAP                      # steps until the next probe
        self._since_probe = 0
        self._probe: int | None = None           # the count this step runs with, if it probes
        self._wins: dict[int, int] = {}          # count -> probes in a row where it was faster
        self._next_side = -1                     # which neighbour count the next probe tries

    def before_step(self, shape: tuple) -> None:
        """Called with the step's shape (total tokens, sequences) before its forward."""
        self._probe = None
        self._since_probe += 1
        if self._since_probe < self._gap or shape not in self._recent:
            return
        candidates = [c for c in (self.current + self._next_side, self.current - self._next_side)
                      if 1 <= c <= self.max_threads and c != self.current]
        if not candidates:
            return
        self._probe = candidates[0]
        self._next_side = -self._next_side
        self.set_threads(self._probe)

    def after_step(self, shape: tuple, duration: float) -> None:
        """Called with the step's wall time once it ran."""
        if self._probe is None:
            self._recent.setdefault(shape, deque(maxlen=RECENT)).append(duration)
            if len(self._recent) > 64:   # shapes seen long ago say nothing of the machine now
                self._recent.pop(next(iter(self._recent)))
            return
        probe, self._probe = self._probe, None
        self.set_threads(self.current)
        self._since_probe = 0
        # the mean, not the median: a descheduled worker shows as rare steps many times longer, and
        # those are what a neighbour costs
        recent = self._recent[shape]
        usual = sum(recent) / len(recent)
        ratio = duration / usual if usual > 0 else 1.0
        # a probe costs (ratio - 1) steps more than a usual one: space them so that stays ~PROBE_SHARE
        self._gap = max(MIN_GAP, math.ceil((ratio - 1) / PROBE_SHARE)) if ratio > 1 else MIN_GAP
        if ratio >= SWITCH_BELOW:
            self._wins.pop(probe, None)
            return
        self._wins[probe] = self._wins.get(probe, 0) + 1
        if self._wins[probe] >= PROBES_TO_SWITCH:
            self._switch(probe, ratio)

    def _switch(self, count: int, ratio: float) -> None:
        logger.info("CPU threads %d -> %d: its steps took %.2fx the time of %d threads' (other work is %s the "
                    "cores)", self.current, count, ratio, self.current,
                    "using" if count < self.current else "leaving")
        self.current = count
        self.num_changes += 1
        self.set_threads(count)
        self._recent.clear()
        self._wins.clear()
        self._gap = MIN_GAP
