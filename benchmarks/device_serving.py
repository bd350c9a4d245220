"""The device check's serving phase (benchmarks/device_check.py): output tok/s at concurrency 64 of
`pdserve serve` on the 8B-shaped checkpoint against `pdserve serve --baseline static` (transformers'
generate() on static batches of 64, each waiting up to 200 ms to fill) on the same GPU, the same
workload and bench client (benchmarks.families.serve_and_bench: start, warm up, run, stop), one
server at a time. The ratio is pdserve's output tok/s over the baseline's.
"""
from __future__ import annotations

import os
import sys
import time

from benchmarks.workloads import Workload

# (device, dry run): random prompts of 128 tokens, 128 out, two waves of 64 (the baseline's two batches)
WORKLOADS = {False: Workload("c64", "random", 128, 128, 128, 64), True: Workload("c4", "random", 16, 8, 8, 4)}
END_S = 10      # kept at the end of the phase: the last server's stop, the record


class ShareLimits:
    """serve_and_bench's limits for one server: its start's, and each bench's, which is what is left of
    the server's share when the bench starts (the warm-up takes seconds, the workload the rest)."""

    def __init__(self, end: float, start_timeout: float, out_dir: str):
        self.end, self.start_timeout, self.out_dir = end, start_timeout, out_dir

    @property
    def timeout(self) -> float:
        return max(5.0, self.end - time.time())


def commands(system: str, model: str, device: str, wl: Workload, port: int) -> list[str]:
    """The server command of each system: bf16 on the device, prompts + outputs within 2,048 tokens."""
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model, "--device", device, "--dtype", "bfloat16",
           "--port", str(port), "--max-model-len", "2048", "--log-level", "warning"]
    if system == "static":
        return cmd + ["--baseline", "static", "--batch-size", str(wl.concurrency), "--batch-wait-ms", "200"]
    cmd += ["--max-num-seqs", str(wl.concurrency), "--max-num-batched-tokens", "2048"]
    return cmd + (["--no-cpu-kernels"] if device == "cpu" else [])


def run(out_path: str, device: str, model: str, work_dir: str, dry_run: bool, deadline: float) -> dict:
    from benchmarks.device_records import save, say
    from benchmarks.families import serve_and_bench
    from pdserve.bench import servers

    wl = WORKLOADS[dry_run]
    name = os.path.basename(os.path.normpath(model))
    rec = dict(phase="serving", device=device, model=model, workload=vars(wl), systems={}, ratio=None)
    systems = ("pdserve", "static")
    for i, system in enumerate(systems):
        r = rec["systems"][system] = dict(status="not run")
        # this server's share of the time left: at most 60% to start (16 GB to load), the rest to the benches
        share = (deadline - time.time() - END_S) / (len(systems) - i)
        if share < 30:
            r["status"] = f"skipped: out of time ({max(share, 0):.0f} s)"
            save(out_path, rec)
            continue
        r["time_share_s"] = round(share)
        args = ShareLimits(time.time() + share, start_timeout=0.6 * share, out_dir=work_dir)
        log_path = os.path.join(work_dir, "logs", f"serve-{system}.log")

        def make_server(system=system, log_path=log_path):
            port = servers.free_port()
            return servers.Server(system, commands(system, model, device, wl, port), port, log_path,
                                  env=dict(os.environ, HF_HUB_OFFLINE="1"))

        serve_and_bench(r, make_server, system, os.path.join(work_dir, f"bench-{system}"), name, args,
                        seed=4300 + 10 * i, log=lambda m: say(f"serving: {m}"), workloads=[wl])
        if r["status"] != "ok":
            r["log_tail"] = servers.log_tail(log_path, 40)
        save(out_path, rec)
    # a ratio only of two complete runs (every request answered)
    runs = [rec["systems"][s].get(wl.name) or {} for s in systems]
    ours, theirs = (r.get("metrics", {}).get("output_throughput") if r.get("status") == "ok" else None for r in runs)
    if ours and theirs:
        rec["ratio"] = ours / theirs
    save(out_path, rec)
    return rec
