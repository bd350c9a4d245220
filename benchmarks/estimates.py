"""How long a compare.py run will take, from the past runs of the same systems and workloads:
each past run's time scaled by `work`. Past runs are read from the raw results (git-ignored) and
from the summary that docs/BENCHMARKS.md was generated from."""
from __future__ import annotations

import json
import math
import os

from benchmarks.workloads import SYSTEMS, Workload, warmup_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Requests a system serves at once: hf and nocache one at a time, static in batches of 4.
PARALLEL = {"hf": 1, "nocache": 1, "static": 4}
RESULT_DIRS = (os.path.join(REPO, "benchmarks", "results"), os.path.join(REPO, "benchmarks", "results", "quick"),
               os.path.join(REPO, "docs", "benchmarks"))


def work(wl: Workload, system: str) -> float:
    """The relative cost of `wl` on `system`, for scaling a past run's time to a new size:
    rounds of requests the system serves at once, times output tokens. nocache re-runs the
    whole sequence for every token, so its cost also grows with the context."""
    rounds = math.ceil(wl.num_prompts / min(wl.concurrency, PARALLEL.get(system, wl.concurrency)))
    cost = rounds * wl.output_len
    if system == "nocache":
        prompt = wl.input_len if wl.dataset == "random" else (
            wl.long_fraction * wl.long_len + (1 - wl.long_fraction) * wl.input_len)
        cost *= prompt + wl.output_len / 2
    return cost


def spec_of(res: dict, name: str) -> Workload:
    """The Workload a `pdserve bench` result JSON ran (for files no summary.json describes)."""
    kinds = res.get("request_kinds") or [None] * len(res["input_lens"])
    ins = [(n, k) for n, k in zip(res["input_lens"], kinds) if n]
    short = [n for n, k in ins if k != "long"] or [0]
    long_ = [n for n, k in ins if k == "long"]
    return Workload(name, res["dataset_name"], int(sorted(short)[len(short) // 2]), max(res["output_lens"] or [1]),
                    res["num_prompts"], res.get("max_concurrency") or res["num_prompts"],
                    long_len=max(long_, default=0), long_fraction=len(long_) / max(1, len(ins)) or 0.1)


def past_runs(dirs=RESULT_DIRS) -> list[dict]:
    """Every measured (model, system, workload) run under `dirs`: its summary.json records (bench
    time, server start time), then the result JSONs no summary describes (their duration)."""
    runs, seen = [], set()
    for d in dict.fromkeys(os.path.abspath(d) for d in dirs):
        try:
            with open(os.path.join(d, "summary.json"), encoding="utf-8") as f:
                records = json.load(f)["runs"]
        except (OSError, ValueError, KeyError):
            records = []
        for r in records:
            if r.get("status") == "ok" and r.get("bench_s") and r.get("json"):
                seen.add(os.path.normpath(os.path.join(REPO, r["json"])))
                runs.append(dict(model=r["model"], system=r["system"], spec=Workload(**r["workload_spec"]),
                                 seconds=r["bench_s"], ready_s=r.get("server_ready_s"), source=r["json"]))
        for model in ("tiny", "0.5b"):
            for wl_name in ("c32", "c1", "long-short"):
                for system in SYSTEMS:
                    path = os.path.normpath(os.path.join(d, model, wl_name, f"{system}.json"))
                    if path in seen or not os.path.exists(path):
                        continue
                    try:
                        with open(path, encoding="utf-8") as f:
                            res = json.load(f)
                        spec = spec_of(res, wl_name)
                    except (OSError, ValueError, KeyError, TypeError):
                        continue
                    if res.get("failed") == 0:
                        runs.append(dict(model=model, system=system, spec=spec, seconds=res["duration"] + 0.5,
                                         ready_s=None, source=os.path.relpath(path, REPO)))
    return runs


def estimate_s(model_key: str, system: str, workloads: list[Workload], runs: list[dict]) -> tuple[float, str] | None:
    """Seconds `system` will take on `model_key` (start, warm-up, every workload, stop), from
    the past runs of the same system on the same model, each scaled by `work`; None without one."""
    mine = [r for r in runs if r["model"] == model_key and r["system"] == system]
    if not mine:
        return None
    total, sources = 0.0, set()
    for wl in workloads + [warmup_for(system)]:
        same = [r for r in mine if r["spec"].name == wl.name] or [r for r in mine if r["spec"].name == "c1"] or mine
        # the same workload if it ran, else the biggest run (the nearest to the full size)
        ref = next((r for r in same if r["spec"] == wl), max(same, key=lambda r: work(r["spec"], system)))
        total += ref["seconds"] * work(wl, system) / work(ref["spec"], system)
        sources.add(os.path.dirname(os.path.dirname(os.path.dirname(ref["source"]))) or ".")
    ready = max((r["ready_s"] for r in mine if r["ready_s"]), default=90.0 if system == "vllm" else 10.0)
    return total + ready + 6.0, ", ".join(sorted(sources))  # 6 s: the load sample, the stop, the start
