"""The workloads of benchmarks/compare.py: what each system runs on each model.

Every workload is one `pdserve bench` run (vLLM's `bench serve` definitions): c32 is the serving
target of issue 6 (many requests in flight), c1 the latency of one request alone, long-short the
head-of-line case (a few long prompts among short ones, arriving while others decode).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


OURS = ("engine", "static", "hf", "nocache")   # pdserve's backends
PEERS = ("vllm", "llama-server")
SYSTEMS = OURS + PEERS

@dataclass(frozen=True)
class Workload:
    name: str
    dataset: str  # pdserve bench --dataset-name
    input_len: int  # for long-short: the short prompts
    output_len: int
    num_prompts: int
    concurrency: int
    long_len: int = 0  # long-short only
    long_fraction: float = 0.1

    def describe(self) -> str:
        prompt = (f"{self.input_len} in" if self.dataset == "random" else
                  f"{self.input_len} in ({self.long_fraction:.0%} of them {self.long_len} in)")
        return (f"{self.dataset}, {prompt} / {self.output_len} out, {self.num_prompts} requests, "
                f"max concurrency {self.concurrency}")

    def bench_args(self) -> list[str]:
        args = ["--dataset-name", self.dataset, "--random-input-len", str(self.input_len),
                "--random-output-len", str(self.output_len), "--num-prompts", str(self.num_prompts),
                "--max-concurrency", str(self.concurrency)]
        if self.dataset == "long-short":
            args += ["--long-input-len", str(self.long_len), "--long-fraction", str(self.long_fraction)]
        return args


# The workloads, in run order. c32 is the serving target of issue 6, c1 the latency of one
# request alone, long-short the head-of-line case (a few long prompts among short ones).
WORKLOADS = {
    "tiny": [Workload("c32", "random", 128, 128, 64, 32),
             Workload("c1", "random", 128, 128, 2, 1),
             Workload("long-short", "long-short", 128, 64, 64, 32, long_len=768)],
    "0.5b": [Workload("c32", "random", 128, 128, 64, 32),
             Workload("c1", "random", 128, 32, 2, 1),
             Workload("long-short", "long-short", 128, 32, 16, 8, long_len=1024)],
    "quick": [Workload("c32", "random", 64, 32, 16, 8),
              Workload("c1", "random", 64, 32, 2, 1),
              Workload("long-short", "long-short", 64, 32, 16, 8, long_len=512)],
}
TITLES = {"c32": "throughput under load", "c1": "latency of one request alone",
          "long-short": "head-of-line blocking"}

# Smaller versions of the workloads for the slow baselines, where the full ones would take most
# of the time budget by themselves (issue 5: the full run within 20 minutes): `hf` runs one
# request at a time (~80 ms a token on the 0.5B model), `static` one batch of 4 at a time, and
# `nocache` re-runs the whole sequence for every token (a 1024-token prompt costs seconds per
# output token). Same lengths, fewer requests (for hf and static on the 0.5B model one batch's
# worth: more would only repeat it), except for nocache on the 0.5B model, which also gets
# fewer output tokens.
SCALED = {
    ("0.5b", "hf"): {"c32": dict(num_prompts=2, output_len=64), "c1": dict(num_prompts=1),
                     "long-short": dict(num_prompts=2)},
    ("0.5b", "static"): {"c32": dict(num_prompts=4, output_len=64), "c1": dict(num_prompts=1),
                         "long-short": dict(num_prompts=4)},
    ("0.5b", "nocache"): {"c32": dict(num_prompts=2, output_len=8), "c1": dict(num_prompts=1, output_len=8),
                          "long-short": dict(num_prompts=2, output_len=4)},
    ("tiny", "hf"): {"c32": dict(num_prompts=8), "long-short": dict(num_prompts=8)},
    ("tiny", "static"): {"c32": dict(num_prompts=8), "long-short": dict(num_prompts=8)},
    ("tiny", "nocache"): {"c32": dict(num_prompts=2), "c1": dict(num_prompts=1), "long-short": dict(num_prompts=2)},
}
# Before the first workload, each server gets these unmeasured requests (fresh prompts): the
# first requests pay for compilation (vLLM), allocation and cold caches.
WARMUP = Workload("warmup", "random", 128, 8, 2, 2)


def warmup_for(system: str) -> Workload:
    """hf and nocache serve one request at a time: one warm-up request does (on the 0.5B model a
    nocache warm-up request costs seconds)."""
    return replace(WARMUP, num_prompts=1, concurrency=1) if system in ("hf", "nocache") else WARMUP


def plan_workloads(model_key: str, system: str, quick: bool, only: list[str] | None = None) -> list[Workload]:
    """The workloads `system` runs on `model_key`, in order."""
    scaled = {} if quick else SCALED.get((model_key, system), {})
    return [replace(wl, **scaled.get(wl.name, {})) for wl in WORKLOADS["quick" if quick else model_key]
            if not only or wl.name in only]
