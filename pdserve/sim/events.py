"""The simulator's clock: a queue of timed callbacks, run in time order (ties in the order
they were scheduled, so a run is deterministic)."""
import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    def __init__(self):
        self.now = 0.0
        self._queue: list = []
        self._order = itertools.count()

    def at(self, when: float, fn: Callable, *args) -> None:
        """Call fn(*args) at simulated time `when` (never before now)."""
        heapq.heappush(self._queue, (max(when, self.now), next(self._order), fn, args))

    def run(self, max_events: int | None = None) -> None:
        """Run every event, including those scheduled while running, until none is left."""
        n = 0
        while self._queue:
            self.now, _, fn, args = heapq.heappop(self._queue)
            fn(*args)
            n += 1
            if max_events is not None and n >= max_events:
                raise RuntimeError(f"simulation did not finish within {max_events} events")
