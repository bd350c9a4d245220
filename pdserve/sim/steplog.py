"""Fit the step-time model on a server's own steps: the JSON lines of `pdserve serve --step-log`.

A logged step has its start, duration, sequences and prefill and decode tokens, not its
contexts, so the attention term stays 0. What a step costs the engine loop is the time until
the next one starts (the loop's bookkeeping and the output fan-out run between steps, and on a
shared machine the time the process waited for a core), so a step after which the engine still
had work is fitted on that period; a step followed by idle time on its own duration plus the
median gap of the busy ones. The engine still had work if the next step decodes (its decodes
were running when this one ended: arrivals start with a prefill) or starts within 20 ms."""
import json
import statistics

import numpy as np

from pdserve.engine.cost_model import StepCostModel

BACK_TO_BACK_S = 0.02   # a longer gap before the next step: the engine was idle (waiting for requests)


def read_steps(path: str) -> list[dict]:
    steps = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                steps.append({k: float(row[k]) for k in ("start_time", "duration", "num_seqs", "num_prefill_tokens",
                                                         "num_decode_tokens")})
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a --step-log line ({e})") from None
    if len(steps) < 8:
        raise ValueError(f"{path}: {len(steps)} steps; fitting needs at least 8")
    return sorted(steps, key=lambda s: s["start_time"])


def fit_step_log(path: str) -> StepCostModel:
    steps = read_steps(path)
    gaps = [max(0.0, b["start_time"] - a["start_time"] - a["duration"]) for a, b in zip(steps, steps[1:])]
    busy = [b["num_decode_tokens"] > 0 or g < BACK_TO_BACK_S for b, g in zip(steps[1:], gaps)]
    typical = statistics.median([g for g, b in zip(gaps, busy) if b] or [0.0])
    x = np.array([(1.0, s["num_prefill_tokens"] + s["num_decode_tokens"], s["num_seqs"]) for s in steps])
    y = np.array([s["duration"] + (gap if was_busy else typical)
                  for s, gap, was_busy in zip(steps, gaps + [0.0], busy + [False])])
    c = nonnegative_least_squares(x, y)
    model = StepCostModel((*c, 0.0))
    model.num_observed = len(steps)
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
