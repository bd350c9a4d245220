"""Fit the step-time model on servers' own steps: the JSON lines of `pdserve serve --step-log`.

A logged step has its start, duration, sequences and prefill and decode tokens, not its
contexts, so the attention term stays 0. What a step costs the engine loop is the time until
the next one starts (the loop's bookkeeping and the output fan-out run between steps, and on a
shared machine the time the process waited for a core), so a step after which the engine still
had work is fitted on that period; a step followed by idle time on its own duration plus the
median gap of the busy ones. The engine still had work if the next step decodes (its decodes
were running when this one ended: arrivals start with a prefill) or starts within 20 ms.

"The next step" is the same engine's: several logs (a prefill and a decode worker's), or one log
that several engines append to (Ray replicas share the --step-log path; each line names its
process, `pid`), are split into one chain of steps per file and process before the gaps are
taken; all chains are fitted as one model."""
import json
import statistics

import numpy as np

from pdserve.engine.cost_model import StepCostModel

BACK_TO_BACK_S = 0.02   # a longer gap before the next step: the engine was idle (waiting for requests)
MIN_STEPS = 4   # more than the model's three coefficients


def read_steps(path: str) -> dict[object, list[dict]]:
    """The file's steps per engine process (its `pid`; None for lines without one), each in start order."""
    chains: dict[object, list[dict]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step = {k: float(row[k]) for k in ("start_time", "duration", "num_seqs", "num_prefill_tokens",
                                                   "num_decode_tokens")}
                pid = row.get("pid")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{lineno}: not a --step-log line ({e})") from None
            chains.setdefault(pid, []).append(step)
    return {pid: sorted(steps, key=lambda s: s["start_time"]) for pid, steps in chains.items()}


def chain_periods(steps: list[dict]) -> list[float]:
    """Each step's cost to its engine loop: the time until that engine's next step starts, or
    for one followed by idle time, its duration plus the chain's median busy gap."""
    gaps = [max(0.0, b["start_time"] - a["start_time"] - a["duration"]) for a, b in zip(steps, steps[1:])]
    busy = [b["num_decode_tokens"] > 0 or g < BACK_TO_BACK_S for b, g in zip(steps[1:], gaps)]
    typical = statistics.median([g for g, b in zip(gaps, busy) if b] or [0.0])
    return [s["duration"] + (gap if was_busy else typical) for s, gap, was_busy in zip(steps, gaps + [0.0],
                                                                                       busy + [False])]


def fit_step_log(paths: str | list[str]) -> StepCostModel:
    paths = [paths] if isinstance(paths, str) else list(paths)
    chains = [steps for path in paths for steps in read_steps(path).values()]
    n = sum(map(len, chains))
    if n < MIN_STEPS:
        raise ValueError(f"{', '.join(paths)}: {n} steps; fitting needs at least {MIN_STEPS}")
    x = np.array([(1.0, s["num_prefill_tokens"] + s["num_decode_tokens"], s["num_seqs"])
                  for steps in chains for s in steps])
    y = np.array([p for steps in chains for p in chain_periods(steps)])
    c = nonnegative_least_squares(x, y)
    model = StepCostModel((*c, 0.0))
    model.num_observed = n
    return model


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |x c - y| with c >= 0 (active set: drop the negative coefficients and solve again).
    Absolute, not relative, error (unlike the engine's fit): the simulator adds step times up,
    so their sum, the run's busy time, is what must come out right."""
    active = np.ones(x.shape[1], dtype=bool)
    c = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        c[:] = 0.0
        c[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if (c >= 0).all():
            break
        active &= c >= 0
    return np.maximum(c, 0.0)
