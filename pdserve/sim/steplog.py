"""Fit the step-time model on a server's own steps: the JSON lines of `pdserve serve --step-log`.

A logged step has its start, duration, sequences and prefill and decode tokens, not its
contexts, so the attention term stays 0. What a step costs the engine loop is the time until
the next one starts (the loop's bookkeeping and the output fan-out run between steps), so a
step followed at once by another is fitted on that period; a step followed by idle time on its
own duration plus the median gap of the back-to-back ones."""
import json
import statistics

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
    gaps = [b["start_time"] - a["start_time"] - a["duration"] for a, b in zip(steps, steps[1:])]
    busy = [g for g in gaps if g < BACK_TO_BACK_S]
    typical = statistics.median(busy) if busy else 0.0
    model = StepCostModel()
    for s, gap in zip(steps, gaps + [float("inf")]):
        period = s["duration"] + (gap if gap < BACK_TO_BACK_S else typical)
        tokens = s["num_prefill_tokens"] + s["num_decode_tokens"]
        model.add_calibration((1.0, tokens, s["num_seqs"], 0.0), period)
    model.fit()
    return model
