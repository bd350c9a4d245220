"""How long a simulated engine step takes: what replaces the forward in the simulator.

Two kinds, both functions of the step the real Scheduler built (SchedulerOutput, read before
mark_computed advances the sequences):

- FittedStepTime: pdserve's own step-time model (engine/cost_model.py), fitted on a machine by
  `pdserve simulate --fit-cost-model` or `pdserve roofline --cost-model --output`.
- DatasheetStepTime: a roofline from a GPU's datasheet peak (dense bf16 FLOP/s) and memory
  bandwidth, times assumed efficiencies, plus a fixed per-step overhead; FLOPs and bytes are
  counted from the model config as `pdserve roofline` counts them (bench/step_cost.py). These
  are predictions from assumptions, never measurements."""
import json
from dataclasses import dataclass

from pdserve.bench.step_cost import ModelCost
from pdserve.engine.cost_model import StepCostModel, step_features
from pdserve.engine.scheduler import SchedulerOutput


class FittedStepTime:
    kind = "fitted"

    def __init__(self, model: StepCostModel, source: str = ""):
        self.model = model
        self.source = source

    def __call__(self, out: SchedulerOutput) -> float:
        x = step_features(out.num_tokens, [s.num_computed_tokens for s in out.seqs])
        return max(self.model.predict(*x[1:]), 1e-6)

    def describe(self) -> str:
        return f"fitted step-time model{f' ({self.source})' if self.source else ''}: {self.model.describe()}"


def load_cost_model(path: str) -> StepCostModel:
    """A step-time model from JSON: `pdserve simulate --fit-cost-model`'s or `pdserve roofline
    --cost-model --output`'s file (the model under "cost_model"), or the bare as_dict()."""
    with open(path) as f:
        try:
            d = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    inner = d.get("cost_model", d) if isinstance(d, dict) else None
    if not isinstance(inner, dict):
        raise ValueError(f"{path}: expected a JSON object with the model's coefficients")
    try:
        return StepCostModel.from_dict(inner)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float     # dense bf16 tensor FLOP/s, datasheet
    bandwidth: float      # HBM bytes/s, datasheet
    memory: float         # HBM bytes


# NVIDIA's datasheet figures (SXM parts, dense bf16, no sparsity)
GPUS = {
    "a100": GPU("NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80e9),
    "h100": GPU("NVIDIA H100 SXM", 989e12, 3.35e12, 80e9),
    "h200": GPU("NVIDIA H200 SXM", 989e12, 4.8e12, 141e9),
}


def attention_keys(q: int, c: int, window: int | None) -> int:
    """Keys scored by q new queries ending at context c: sum over p in [c-q, c) of min(p + 1, w)."""
    a, w = c - q + 1, window or c
    top = min(c, w)
    below = (top * (top + 1) - (a - 1) * a) // 2 if top >= a else 0
    return below + max(0, c - max(a - 1, w)) * w


class DatasheetStepTime:
    kind = "datasheet"

    def __init__(self, gpu: GPU, cost: ModelCost, mfu: float = 0.5, mbu: float = 0.8, overhead_s: float = 0.003):
        for name, v in (("mfu", mfu), ("mbu", mbu)):
            if not 0 < v <= 1:
                raise ValueError(f"--{name} must be in (0, 1], got {v}")
        if overhead_s < 0:
            raise ValueError(f"--step-overhead-ms must be >= 0, got {overhead_s * 1e3}")
        self.gpu, self.cost, self.mfu, self.mbu, self.overhead_s = gpu, cost, mfu, mbu, overhead_s
        m = cost
        self._weight_bytes = m.body_matmul_params * (m.weight_itemsize or m.itemsize) + m.body_other_params * m.itemsize

    def __call__(self, out: SchedulerOutput) -> float:
        """As bench/step_cost.step_cost counts a step, in closed form (it runs for every step)."""
        m = self.cost
        tokens = attn = kv_tokens = rows = 0
        for seq, n in zip(out.seqs, out.num_tokens):
            c = seq.num_computed_tokens + n
            seen = min(c, n + (m.sliding_window or c) - 1)
            tokens += n
            attn += m.attention_flops(n, attention_keys(n, c, m.sliding_window), seen)
            kv_tokens += seen
            rows += c == seq.num_tokens   # it samples: a logits row
        flops = 2 * m.body_matmul_params * tokens + attn + 2 * m.lm_head_params * rows
        nbytes = (self._weight_bytes + (m.lm_head_params * (m.weight_itemsize or m.itemsize) if rows else 0)
                  + m.embed_row_params * tokens * m.itemsize + (kv_tokens + tokens) * m.kv_bytes_per_token)
        return max(flops / (self.gpu.peak_flops * self.mfu), nbytes / (self.gpu.bandwidth * self.mbu)) + self.overhead_s

    def describe(self) -> str:
        return (f"DATASHEET PREDICTION for {self.gpu.name}: {self.gpu.peak_flops / 1e12:.0f} TFLOP/s bf16 x "
                f"assumed MFU {self.mfu:g}, {self.gpu.bandwidth / 1e12:.2f} TB/s x assumed bandwidth use "
                f"{self.mbu:g}, + {self.overhead_s * 1e3:g} ms a step (assumptions, not measurements)")
