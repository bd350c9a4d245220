"""What the deployments of benchmarks/sim_validate.py add to each request beyond their engines'
steps, as the simulator's flags: the 1P1D hand-off (--kv-bandwidth, --kv-latency-ms: this machine's
TCP pull, the proxy's two calls, the decode worker's admission; from the servers' /metrics) and the
router's hops (--router-latency-ms: a probe's TTFT less its simulated steps)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from pdserve.bench import servers

# one short request at a time: its TTFT is one step plus what the router's hops add (Ray's HTTP
# proxy, the ingress and the handle's call to a replica, and the stream back through them)
PROBE = ("--random-input-len", "8", "--random-output-len", "2", "--num-prompts", "8", "--max-concurrency", "1")


def run_logged(cmd: list[str], log: str, timeout: float, cores: tuple[int, ...] | None = None) -> int:
    with open(log, "w") as f:
        f.write("$ " + shown(cmd, cores) + "\n")
        f.flush()
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, preexec_fn=pin).returncode


def shown(cmd: list[str], cores: tuple[int, ...] | None = None) -> str:
    return " ".join((["taskset", "-c", ",".join(map(str, cores))] if cores else []) + cmd)


def kv_link(model: str, out_dir: str, label: str) -> dict:
    """This machine's TCP KV pull, as the 1P1D workers make it: `benchmarks.kv_transfer --cache-only`
    at a short and a long prompt, fitted as latency + bytes / bandwidth."""
    points = []
    for n in KV_PROMPT_LENS:
        log = os.path.join(out_dir, f"{label}-kv-transfer-{n}.log")
        cmd = [sys.executable, "-m", "benchmarks.kv_transfer", model, "--cache-only", "--transports", "tcp",
               "--prompt-len", str(n), "--requests", "7"]
        if run_logged(cmd, log, 300):
            raise RuntimeError(f"benchmarks.kv_transfer failed: see {log}")
        with open(log) as f:
            row = json.loads([line for line in f if line.startswith("{")][-1])
        points.append((row["bytes_per_request"], row["ms_per_request_median"] / 1e3))
    (b0, t0), (b1, t1) = points
    bandwidth = (b1 - b0) / (t1 - t0) if t1 > t0 else b1 / t1
    return {"bandwidth_gb_s": bandwidth / 1e9, "latency_ms": max(0.0, t0 - b0 / bandwidth) * 1e3, "points": points}


def kv_flags(bandwidth_gb_s: float, latency_ms: float) -> list[str]:
    return ["--kv-bandwidth", f"{bandwidth_gb_s:.4g}", "--kv-latency-ms", f"{latency_ms:.4g}"]


KV_PROMPT_LENS = (16, 4096)
# the decode worker's pulls, and what the proxy's two calls take beyond the workers' own TTFT
KV_COUNTERS = ("pdserve:kv_transfer_bytes_total", "pdserve:kv_transfer_seconds_total", "pdserve:kv_transfers_total")
TTFT, TPOT = "pdserve:time_to_first_token_seconds", "pdserve:request_time_per_output_token_seconds"
PROXY_CALLS = (("prefill", "pdserve:proxy_prefill_seconds"), ("decode", "pdserve:proxy_decode_ttft_seconds"))


def worker_url(log_path: str, role: str) -> str | None:
    """The URL `pdserve serve --disaggregate` printed for this worker."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        m = re.search(rf"^{role} worker: (http://\S+)", f.read(), re.M)
    return m.group(1) if m else None


def handoff_metrics(server: servers.Server) -> dict:
    """The proxy's and both workers' /metrics that time the hand-off (totals since they started)."""
    urls = {"proxy": server.base_url, **{r: worker_url(server.log_path, r) for r in ("prefill", "decode")}}
    keep = (*KV_COUNTERS, *(f"{h}_{x}" for h in (TTFT, TPOT, *(n for _, n in PROXY_CALLS)) for x in ("sum", "count")))
    return {name: {k: v for k, v in servers.scrape_metrics(url).items() if k in keep}
            for name, url in urls.items() if url}


def handoff(before: dict, after: dict, link_gb_s: float) -> dict | None:
    """The hand-off between `before` and `after` as the simulator's KV flags. Bandwidth: the
    link's, or the decode worker's pulls' own rate where they were faster (the link was measured
    under other load). Latency: what the pulls took beyond their bytes over that; the proxy's
    overhead, each of its two calls (prefill; decode to its first token) as the proxy timed it
    less that worker's own TTFT (arrival in its engine to the token), i.e. the HTTP round trips;
    and the decode worker's admission: its TTFT less the pull and one decode step (its TPOT)."""
    d = {(w, k): after.get(w, {}).get(k, 0.0) - before.get(w, {}).get(k, 0.0)
         for w in ("proxy", "prefill", "decode") for k in {k for m in after.values() for k in m}}
    mean = lambda w, h: d[(w, h + "_sum")] / d[(w, h + "_count")] if d.get((w, h + "_count")) else None  # noqa: E731
    n = d.get(("decode", "pdserve:kv_transfers_total"))
    calls = [(mean("proxy", name), mean(role, TTFT)) for role, name in PROXY_CALLS]
    tpot = mean("decode", TPOT)
    if not n or tpot is None or any(a is None or b is None for a, b in calls):
        return None
    pull = d[("decode", "pdserve:kv_transfer_seconds_total")] / n
    nbytes = d[("decode", "pdserve:kv_transfer_bytes_total")] / n
    bandwidth = max(link_gb_s * 1e9, nbytes / pull if pull > 0 else 0.0)
    parts = {"pull_latency_ms": pull - nbytes / bandwidth, "proxy_overhead_ms": sum(c - t for c, t in calls),
             "decode_admission_ms": calls[1][1] - pull - tpot}
    parts = {k: max(0.0, v) * 1e3 for k, v in parts.items()}
    return {"requests": n, "mean_pull_ms": pull * 1e3, "mean_bytes": nbytes, "bandwidth_gb_s": bandwidth / 1e9,
            **parts, "latency_ms": sum(parts.values())}


def router_latency(probe: list[str], probe_sim: list[str], out_dir: str, tag: str) -> dict:
    """The probe's measured mean TTFT less its simulated one (`probe_sim`, with the prior model:
    its steps alone): what the router's hops add to each request."""
    out, log = os.path.join(out_dir, f"{tag}-probe-sim.json"), os.path.join(out_dir, f"{tag}-probe-sim.log")
    if run_logged(probe_sim + ["--output", out], log, 300):
        raise RuntimeError(f"pdserve simulate failed: see {log}")
    with open(probe[probe.index("--output") + 1]) as f:
        measured = json.load(f)["mean_ttft_ms"]
    with open(out) as f:
        simulated = json.load(f)["mean_ttft_ms"]
    return {"probe_ttft_ms": measured, "probe_sim_ttft_ms": simulated, "latency_ms": max(0.0, measured - simulated)}


