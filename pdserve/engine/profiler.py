"""Where engine steps spend their time: --profile-steps N logs a summary every N steps.

Every step already times its phases (StepStats.phases): schedule, prepare (flat inputs and
attention metadata), forward (model and lm_head), sample, output (detokenize, stop checks,
outputs). Overhead is everything but the forward: what the engine adds to the model's own cost."""
import collections
import logging
from dataclasses import dataclass, field

from pdserve.engine.outputs import StepStats

log = logging.getLogger("pdserve.engine")
PHASES = ("schedule", "prepare", "forward", "sample", "output")
KEEP_STEPS = 10_000   # history kept for summary(): a long-running server must not grow without bound


@dataclass
class StepProfiler:
    log_every: int = 0              # log a summary every this many steps (0: never, read summary())
    steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=KEEP_STEPS))
    _window: list = field(default_factory=list)   # the steps since the last logged summary

    def add(self, step: StepStats) -> None:
        self.steps.append(step)
        if self.log_every:
            self._window.append(step)
            if len(self._window) == self.log_every:
                log.info("step profile (last %d steps): %s", self.log_every, format_summary(summarize(self._window)))
                self._window = []

    def summary(self) -> dict:
        """Over the last KEEP_STEPS steps."""
        return summarize(self.steps)


def summarize(steps) -> dict:
    """Mean ms per phase, overhead (step minus forward) in ms and as a share of the step."""
    steps = [s for s in steps if s.phases]
    if not steps:
        return {"steps": 0}
    n = len(steps)
    out = {"steps": n, "mean_step_ms": 1e3 * sum(s.duration for s in steps) / n,
           "mean_tokens": sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps) / n}
    for p in PHASES:
        out[f"mean_{p}_ms"] = 1e3 * sum(s.phases.get(p, 0.0) for s in steps) / n
    out["mean_overhead_ms"] = out["mean_step_ms"] - out["mean_forward_ms"]
    out["overhead_share"] = out["mean_overhead_ms"] / out["mean_step_ms"] if out["mean_step_ms"] else 0.0
    return out


def format_summary(s: dict) -> str:
    if not s.get("steps"):
        return "no steps"
    phases = " ".join(f"{p} {s[f'mean_{p}_ms']:.3f}" for p in PHASES)
    return (f"{s['steps']} steps, {s['mean_tokens']:.1f} tokens/step, step {s['mean_step_ms']:.3f} ms = {phases} ms; "
            f"overhead {s['mean_overhead_ms']:.3f} ms ({100 * s['overhead_share']:.1f}%)")
