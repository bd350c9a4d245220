"""A step-time model: how long one engine step takes, from what it carries.

    t = c0 + c_tok * tokens + c_seq * seqs + c_attn * attention_pairs

tokens: all scheduled tokens (the linears' rows); seqs: the sequences in the step (per-sequence
work: metadata, sampling, outputs); attention_pairs: sum over sequences of n * (context + n), the
query-key pairs the step's attention touches (a decode at context L adds about L; a prefill chunk
of n after c cached tokens adds n * (c + n)).

The engine fits it at start-up on a few timed forwards of the loaded model (calibrate()) and keeps
refitting it from the steps it runs (observe()): measured steps are weighted with exponential
forgetting, so the model follows the machine; the start-up points fade too but keep a small
weight, which anchors the coefficients of shapes the live workload has not shown lately. The fit is least squares on relative error (a 2 ms
decode step matters as much as a 400 ms prefill), with coefficients kept >= 0."""
import math
import time

import numpy as np

FEATURES = ("intercept", "tokens", "seqs", "attention_pairs")
REFIT_EVERY = 32    # steps between refits; a refit is a 4x4 solve
FORGET = 0.995      # per-step weight decay of measured steps (about the last 200 count)
CALIBRATION_FLOOR = 0.05   # the start-up points fade as steps are measured, down to this weight


def step_features(num_tokens: list[int], contexts: list[int]) -> tuple[float, float, float, float]:
    """The model's inputs for a step: per sequence, tokens scheduled and tokens cached before it."""
    pairs = 0
    for n, c in zip(num_tokens, contexts):
        pairs += n * (c + n)
    return 1.0, float(sum(num_tokens)), float(len(num_tokens)), float(pairs)


class StepCostModel:
    def __init__(self, coef: tuple[float, ...] | None = None):
        self.coef = np.asarray(coef if coef is not None else (0.0,) * len(FEATURES), dtype=float)
        k = len(FEATURES)
        # normal equations as plain lists: observe() runs in every step, and numpy's per-call
        # cost on a handful of floats is many times the arithmetic
        self._cal_xtx, self._cal_xty = [0.0] * (k * k), [0.0] * k   # start-up points
        self._cal_weight = 1.0
        self._xtx, self._xty = [0.0] * (k * k), [0.0] * k           # measured steps, decayed
        self.num_observed = 0
        self.num_calibration = 0
        self._since_fit = 0

    # ---- prediction

    def predict(self, tokens: float, seqs: float, attention_pairs: float) -> float:
        c = self.coef
        return c[0] + c[1] * tokens + c[2] * seqs + c[3] * attention_pairs

    def max_prefill_tokens(self, target_s: float, decode_seqs: int, decode_pairs: float, limit: int,
                           prefill_context: int = 0) -> int:
        """Most prefill tokens (one chunk, after prefill_context cached tokens) a step with these
        decodes may add and still take at most target_s; 0 if even the decodes alone exceed it."""
        def fits(n: int) -> bool:
            seqs = decode_seqs + (n > 0)
            return self.predict(decode_seqs + n, seqs, decode_pairs + n * (prefill_context + n)) <= target_s
        if not fits(0):
            return 0
        if fits(limit):
            return limit
        lo, hi = 0, limit   # fits(lo), not fits(hi): the step time grows with n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def prefill_time(self, tokens: int, per_step: int, decode_seqs: int, decode_pairs: float) -> float:
        """Seconds to prefill `tokens` at `per_step` tokens a step next to these decodes."""
        if tokens <= 0:
            return 0.0
        per_step = max(1, per_step)
        steps = math.ceil(tokens / per_step)
        chunk = min(tokens, per_step)
        return steps * self.predict(decode_seqs + chunk, decode_seqs + 1, decode_pairs + chunk * chunk)

    # ---- fitting

    def add_calibration(self, x, seconds: float) -> None:
        self._accumulate(self._cal_xtx, self._cal_xty, x, seconds)
        self.num_calibration += 1

    def observe(self, x, seconds: float) -> None:
        """A measured step; refits every REFIT_EVERY of them."""
        self._cal_weight = max(CALIBRATION_FLOOR, self._cal_weight * FORGET)
        self._accumulate(self._xtx, self._xty, x, seconds, FORGET)
        self.num_observed += 1
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self.fit()

    @staticmethod
    def _accumulate(xtx: list, xty: list, x, seconds: float, decay: float = 1.0) -> None:
        if seconds <= 0:
            return
        x = [v / seconds for v in x]   # relative error: each row divided by its target (y / y = 1)
        k = len(x)
        for i in range(k):
            xty[i] = decay * xty[i] + x[i]
            xi, row = x[i], i * k
            for j in range(k):
                xtx[row + j] = decay * xtx[row + j] + xi * x[j]

    def fit(self) -> np.ndarray:
        """Non-negative least squares on the accumulated normal equations (active set)."""
        self._since_fit = 0
        k, w = len(FEATURES), self._cal_weight
        a = (w * np.array(self._cal_xtx) + np.array(self._xtx)).reshape(k, k)
        b = w * np.array(self._cal_xty) + np.array(self._xty)
        if not a.any():
            return self.coef
        # features differ by orders of magnitude (1 against ~1e5 attention pairs): solve in
        # units where each has unit norm, with a small ridge that keeps unseen ones solvable
        d = np.sqrt(np.diag(a))
        d[d == 0] = 1.0
        a, b = a / np.outer(d, d) + 1e-9 * np.eye(len(b)), b / d
        active = np.ones(len(b), dtype=bool)
        coef = np.zeros(len(b))
        for _ in range(len(b)):
            idx = np.flatnonzero(active)
            sol = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            coef[:] = 0.0
            coef[idx] = sol
            if (sol >= 0).all():
                break
            active[idx[sol < 0]] = False
        coef /= d
        self.coef = np.maximum(coef, 0.0)
        return self.coef

    def describe(self) -> str:
        c = self.coef
        return (f"step time = {1e3 * c[0]:.3f} ms + {1e6 * c[1]:.2f} us/token + {1e6 * c[2]:.2f} us/seq + "
                f"{1e9 * c[3]:.3f} ns/attention pair (fit on {self.num_calibration} start-up points, "
                f"{self.num_observed} measured steps)")

    def as_dict(self) -> dict:
        return {**{f"{name}_s": float(v) for name, v in zip(FEATURES, self.coef)},
                "num_calibration": self.num_calibration, "num_observed": self.num_observed}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCostModel":
        """The model as_dict() wrote (its coefficients; the fit's history is not kept)."""
        missing = [f"{name}_s" for name in FEATURES if f"{name}_s" not in d]
        if missing:
            raise ValueError(f"a step cost model needs {', '.join(missing)}")
        coef = [d[f"{name}_s"] for name in FEATURES]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in coef):
            raise ValueError(f"step cost model coefficients must be finite numbers >= 0, got {coef}")
        model = cls(tuple(float(v) for v in coef))
        model.num_calibration, model.num_observed = int(d.get("num_calibration", 0)), int(d.get("num_observed", 0))
        return model


def calibrate(model: StepCostModel, run_step, shapes: list[tuple[list[int], list[int]]], repeats: int = 2,
              clock=time.perf_counter) -> None:
    """Time run_step(num_tokens, contexts) on each shape (one untimed warm-up each), then fit."""
    for num_tokens, contexts in shapes:
        run_step(num_tokens, contexts)
        for _ in range(repeats):
            t0 = clock()
            run_step(num_tokens, contexts)
            model.add_calibration(step_features(num_tokens, contexts), clock() - t0)
    model.fit()


def calibration_shapes(max_batched_tokens: int, max_num_seqs: int, max_context: int) -> list:
    """A few steps spanning what the scheduler builds: prefill chunks, decode batches at two
    contexts, and decodes with a prefill chunk beside them."""
    shapes = []
    for n in sorted({max(1, max_batched_tokens // 8), max(1, max_batched_tokens // 2), max_batched_tokens}):
        shapes.append(([min(n, max_context)], [0]))
    ctxs = sorted({min(128, max_context - 1), min(512, max_context - 1)})
    for b in sorted({1, min(8, max_num_seqs), min(32, max_num_seqs)}):
        for c in ctxs:
            shapes.append(([1] * b, [c] * b))
    b, c = min(16, max_num_seqs - 1), ctxs[0]
    if b >= 1:
        chunk = min(max_batched_tokens - b, max_context - 1, 128)
        if chunk > 1:
            shapes.append(([1] * b + [chunk], [c] * b + [0]))
    return shapes
