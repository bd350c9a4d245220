"""A request's latency objectives: a priority (lower runs first, as in vLLM) and per-phase
targets, TTFT for the prefill and its queueing, TPOT for the decode steps.

They travel in SamplingParams.objectives; the engine fills a missing target from its defaults
(--slo-ttft-ms, --slo-tpot-ms) and records on the request's metrics whether it was met."""
import math
from dataclasses import dataclass

from pdserve.errors import RequestError


@dataclass(slots=True, frozen=True)
class RequestObjectives:
    priority: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self):
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or \
                not -2**31 <= self.priority < 2**31:
            raise RequestError(f"priority must be an integer in [-2**31, 2**31), got {self.priority!r}",
                               param="priority")
        for name in ("ttft_ms", "tpot_ms"):
            v = getattr(self, name)
            ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)
            if not ok:
                raise RequestError(f"slo.{name} must be a number of milliseconds > 0, got {v!r}", param="slo")
