"""`python -m benchmarks.device_check --out DIR [--device cuda] [--dry-run]`: issue 43's device check.

One run on a GPU machine (scripts/device_check.sh; docs/BENCHMARKS.md, "GPU (H200)", says how) that
fits in 8 minutes and writes DIR/device_check.json, DIR/device_check.txt and DIR/device_check.log:

1. exactness: pdserve's fp32 greedy tokens equal transformers' generate() on the device for every
   test architecture, and its bf16 logprobs are within a stated tolerance of transformers' bf16
   (benchmarks/device_exactness.py);
2. make_8b: a Llama-3-8B-shaped bf16 checkpoint with random weights, drawn on the device
   (`tools.make_model --size 8b --device cuda`);
3. roofline: a copy probe (bandwidth) and a bf16 GEMM probe (peak), then pdserve's batch-1 decode
   step against the time to read its bytes and a 2,048-token prefill against the peak
   (benchmarks/device_roofline.py);
4. serving: c64 output tok/s of `pdserve serve` against `pdserve serve --baseline static` on the
   same GPU and workload (benchmarks/device_serving.py);

then issue 43's targets, each met or short with its figure.

Each phase runs in a process of its own under a time limit: its share of --budget-s plus what the
phases before it left unused. A phase that would start with too little time is skipped, saying so;
one stopped at its limit keeps what it recorded; the JSON is written after every phase.

--dry-run: the same phases and code at tiny sizes (the 8B replaced by a 2-layer llama of width 128,
a 256-token prefill, 8 requests at concurrency 4), on the CPU unless --device says otherwise: the
test suite runs it (tests/test_device_check.py); with --device cuda it is a quick smoke test of
the device.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

from benchmarks.device_records import load, log_tail, save, say

# phase -> seconds it may take on the device, before what earlier phases left over
PHASES = {"exactness": 120, "make_8b": 50, "roofline": 90, "serving": 160}
TARGET_PHASE = {"decode_bandwidth_fraction": "roofline", "prefill_peak_fraction": "roofline",
                "c64_vs_static": "serving", "exact_every_arch": "exactness", "bf16_logprobs_every_arch": "exactness"}
MIN_START_S = 20          # a phase with less than this left is skipped
STOP_GRACE_S = 40         # after SIGTERM at a phase's limit, before SIGKILL (its servers stop in 30)
# the phases' sum: with the wheels' install and a phase stopped at its limit (STOP_GRACE_S), 8 minutes
DEFAULT_BUDGET_S = 420
TARGETS = {   # issue 43
    "decode_bandwidth_fraction": (0.70, "batch-1 decode >= 0.70 of the copy probe's bandwidth"),
    "prefill_peak_fraction": (0.60, "2,048-token prefill >= 0.60 of the GEMM probe's bf16 peak"),
    "c64_vs_static": (10.0, "c64 output tok/s >= 10x transformers' static batching"),
    "exact_every_arch": (1.0, "fp32 greedy tokens equal transformers' on the device, every architecture"),
    "bf16_logprobs_every_arch": (1.0, "bf16 logprobs within the stated tolerance, every architecture"),
}


# --- environment ----------------------------------------------------------------------------------

def package_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def gpu_facts() -> dict:
    """nvidia-smi's view of the GPUs (no CUDA context is made here): name, driver, memory."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"error": "no nvidia-smi on PATH"}
    try:
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm,pstate",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"nvidia-smi: {e}"}
    if out.returncode != 0:
        return {"error": f"nvidia-smi exited {out.returncode}: {out.stderr.strip()[:300]}"}
    keys = ("name", "driver", "memory_total", "max_sm_clock", "pstate")
    return {"gpus": [dict(zip(keys, (v.strip() for v in line.split(",")))) for line in out.stdout.splitlines()
                     if line.strip()]}


def git_commit() -> str | None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment(device: str) -> dict:
    import torch
    from pdserve.bench.machine_limits import cpu_name
    env = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), python=platform.python_version(),
               torch=torch.__version__, cuda=torch.version.cuda, triton=package_version("triton"),
               transformers=package_version("transformers"), pdserve_commit=git_commit(), cpu=cpu_name(),
               cpus=os.cpu_count(), device=device)
    if device.startswith("cuda"):
        env.update(gpu_facts())
    return env


# --- phases ---------------------------------------------------------------------------------------

def checkpoint_8b(args) -> str:
    """The 8B-shaped checkpoint's folder (the dry run's small stand-in has its own: never taken for it)."""
    return os.path.join(args.work_dir, "dry-run-llama" if args.dry_run else "llama3-8b-shape")


def run_phase(name: str, args) -> dict:
    """In the phase's own process: run it, writing its record to the work dir as it goes."""
    out = os.path.join(args.work_dir, f"phase-{name}.json")
    if name == "exactness":
        from benchmarks import device_exactness
        names = args.archs or list(device_exactness.variants())
        return device_exactness.run(out, args.device, args.work_dir, names, args.deadline,
                                    min(len(names), args.exactness_workers))
    if name == "make_8b":
        return make_8b(out, args)
    if name == "roofline":
        from benchmarks import device_roofline
        return device_roofline.run(out, args.device, checkpoint_8b(args), args.dry_run)
    from benchmarks import device_serving
    return device_serving.run(out, args.device, checkpoint_8b(args), args.work_dir, args.dry_run,
                              args.deadline)


# the dry run's stand-in for the 8B: the same code path, a model the CPU runs in milliseconds
DRY_8B = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=256, vocab_size=4096)


def make_8b(out: str, args) -> dict:
    """The Llama-3-8B-shaped bf16 checkpoint, drawn on the device; one left complete by an earlier
    run in the same work dir is used again."""
    from tools.make_model import make_model
    path, done = checkpoint_8b(args), os.path.join(checkpoint_8b(args), ".complete")
    rec = dict(phase="make_8b", path=path, dry_run=args.dry_run)
    if os.path.exists(done):
        return _saved(out, dict(rec, status="ok", reused=True))
    t0 = time.monotonic()
    make_model(path, "llama", size="8b", dtype="bfloat16", device=args.device, force=True,
               **(DRY_8B if args.dry_run else {}))
    open(done, "w").close()
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return _saved(out, dict(rec, status="ok", reused=False, seconds=round(time.monotonic() - t0, 1), bytes=size))


def _saved(path: str, rec: dict) -> dict:
    save(path, rec)
    return rec


def phase_limit(name: str, order: list[str], started: float, budget: float) -> float:
    """Seconds this phase may take: its own share plus whatever the earlier ones left unused, but
    never time the later phases' shares need."""
    left = budget - (time.monotonic() - started)
    later = sum(PHASES[p] for p in order[order.index(name) + 1:])
    return min(left, max(PHASES[name], left - later))


def spawn_phase(name: str, args, limit: float, log) -> dict:
    """Run one phase in its own process under `limit` seconds; its record, status and time."""
    record = os.path.join(args.work_dir, f"phase-{name}.json")
    if os.path.exists(record):
        os.remove(record)
    cmd = [sys.executable, "-m", "benchmarks.device_check", "--phase", name, "--out", args.out, "--device",
           args.device, "--work-dir", args.work_dir, "--deadline", str(time.time() + limit)]
    cmd += (["--dry-run"] if args.dry_run else []) + (["--archs", ",".join(args.archs)] if args.archs else [])
    cmd += ["--exactness-workers", str(args.exactness_workers)]
    log.write(f"\n===== phase {name} (limit {limit:.0f} s): {' '.join(cmd)}\n")
    log.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    status = None
    try:
        rc = proc.wait(limit)
    except subprocess.TimeoutExpired:
        status = f"stopped at its limit of {limit:.0f} s"
        proc.send_signal(signal.SIGTERM)   # the serving phase stops its servers on it
        try:
            rc = proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    rec = load(record) or {}
    if status is None:
        status = "ok" if rc == 0 else f"failed (exit status {rc})"
    return dict(rec, status=status, seconds=round(time.monotonic() - t0, 1), limit_s=round(limit))


# --- targets and the summary ----------------------------------------------------------------------

def evaluate_targets(phases: dict) -> dict:
    """Each of issue 43's targets: met or short with its figure, or not measured and why."""
    ex, rl, sv = phases.get("exactness", {}), phases.get("roofline", {}), phases.get("serving", {})
    figures = {
        "decode_bandwidth_fraction": (rl.get("decode") or {}).get("bandwidth_fraction"),
        "prefill_peak_fraction": (rl.get("prefill") or {}).get("peak_fraction"),
        "c64_vs_static": sv.get("ratio"),
    }
    variants, why = ex.get("variants") or {}, {}
    if variants:
        unchecked = [n for n, v in variants.items() if v["status"] not in ("ok", "failed", "checkpoint failed")]
        if unchecked or ex.get("registry_not_covered"):
            why["exact_every_arch"] = why["bf16_logprobs_every_arch"] = (
                f"not checked: {', '.join(unchecked + ex.get('registry_not_covered', []))}")
        else:   # the fraction of variants that passed; a checkpoint that could not be made passed nothing
            n = len(variants)
            figures["exact_every_arch"] = sum((v.get("fp32_tokens") or {}).get("equal") is True
                                              for v in variants.values()) / n
            figures["bf16_logprobs_every_arch"] = sum((v.get("bf16_logprobs") or {}).get("within_tolerance") is True
                                                      for v in variants.values()) / n
    out = {}
    for key, (threshold, text) in TARGETS.items():
        fig = figures.get(key)
        if fig is None:
            phase = TARGET_PHASE[key]
            status = phases[phase].get("status", "?") if phase in phases else "not run"
            out[key] = dict(target=text, threshold=threshold, figure=None, status="not measured",
                            reason=why.get(key, f"{phase} phase: {status}, no figure"))
        else:
            out[key] = dict(target=text, threshold=threshold, figure=fig, status="met" if fig >= threshold else "short")
    return out


def fmt(x, spec: str = ".2f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def summary(result: dict) -> str:
    env, ph = result["environment"], result["phases"]
    gpu = (env.get("gpus") or [{}])[0]
    lines = [f"pdserve device check{' (DRY RUN: tiny shapes, figures mean nothing)' if result['dry_run'] else ''}, "
             f"{env['date']}, device {env['device']}"
             + (f": {gpu.get('name')}, driver {gpu.get('driver')}" if gpu else "")
             + f"; torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, transformers {env['transformers']}"]
    for name, rec in ph.items():
        lines.append(f"{name}: {rec.get('status')}, {fmt(rec.get('seconds'), '.0f')} s" + _phase_line(name, rec))
    lines.append("targets:")
    for t in result["targets"].values():
        lines.append(f"  {t['status']:>12}: {t['target']} (figure {fmt(t['figure'])})"
                     + (f" - {t['reason']}" if t.get("reason") else ""))
    return "\n".join(lines) + "\n"


def _phase_line(name: str, rec: dict) -> str:
    if name == "exactness" and rec.get("variants"):
        vs = rec["variants"].values()
        exact = sum((v.get("fp32_tokens") or {}).get("equal") is True for v in vs)
        bf16 = sum((v.get("bf16_logprobs") or {}).get("within_tolerance") is True for v in vs)
        bad = [n for n, v in rec["variants"].items() if v["status"] != "ok"]
        return (f"; fp32 tokens equal {exact}/{len(rec['variants'])}, bf16 logprobs within tolerance "
                f"{bf16}/{len(rec['variants'])}"
                + (f"; not ok: {', '.join(bad)}" if bad else ""))
    if name == "roofline" and rec.get("decode"):
        d, p, c, g = rec["decode"], rec.get("prefill") or {}, rec["copy"], rec["gemm"]
        return (f"; copy {fmt(c['bandwidth'] / 1e9, '.0f')} GB/s, bf16 GEMM {fmt(g['flops'] / 1e12, '.0f')} TFLOP/s; "
                f"batch-1 decode {fmt(d['forward_ms'])} ms against {fmt(d['read_ms'])} ms to read "
                f"{fmt(d['bytes'] / 1e9)} GB ({fmt(d['bandwidth_fraction'])}); prefill {p.get('tokens')}: "
                f"{fmt(p.get('forward_ms'))} ms, {fmt(p.get('peak_fraction'))} of peak")
    if name == "serving" and rec.get("systems"):
        parts = [f"{s}: {fmt(((r.get(rec['workload']['name']) or {}).get('metrics') or {}).get('output_throughput'), '.0f')}"
                 f" tok/s" for s, r in rec["systems"].items()]
        return f"; {rec['workload']['name']} " + ", ".join(parts) + f"; ratio {fmt(rec.get('ratio'))}"
    return f"; {rec.get('reason') or rec.get('error') or ''}".rstrip("; ")


# --- the command ----------------------------------------------------------------------------------

def default_work_dir() -> str:
    """/dev/shm where it has room for the 8B checkpoint (loads at memory speed), else the temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > 40e9:
        return os.path.join(shm, "pdserve-device-check")
    return os.path.join(tempfile.gettempdir(), "pdserve-device-check")


def parse_args(argv):
    from benchmarks.device_exactness import variants
    from pdserve.arg_types import int_at_least
    from pdserve.cli import Parser
    p = Parser(prog="python -m benchmarks.device_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for device_check.json, .txt and .log")
    p.add_argument("--device", default=None, help="cuda (default) or cuda:N; cpu for --dry-run (its default)")
    p.add_argument("--dry-run", action="store_true", help="the same phases at tiny sizes (the test suite's run)")
    p.add_argument("--work-dir", default=None, help="checkpoints, phase records, server logs "
                   "(default: /dev/shm/pdserve-device-check where it has 40 GB free, else the temp dir)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds for all phases together")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, from {', '.join(PHASES)}")
    p.add_argument("--archs", default=None, help="exactness: comma-separated variants (default: every one)")
    p.add_argument("--exactness-workers", type=int_at_least(1), default=None,
                   help="exactness: variants checked at once, each in its own process (default: a quarter of the "
                        "cores, at most 4: 4 on the H200's 16)")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)      # one phase, in its own process
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.dry_run else "cuda")
    args.exactness_workers = args.exactness_workers or min(4, max(1, (os.cpu_count() or 1) // 4))
    if args.device.split(":")[0] not in ("cpu", "cuda"):
        p.error(f"--device {args.device!r}: cpu, cuda or cuda:N")
    if args.device == "cpu" and not args.dry_run:
        p.error("--device cpu measures nothing of a GPU: add --dry-run (tiny sizes), or run on a GPU machine")
    phases = [x for x in args.phases.split(",") if x]
    if not phases or any(x not in PHASES for x in phases):
        p.error(f"--phases {args.phases!r}: comma-separated, from {', '.join(PHASES)}")
    args.phases = [x for x in PHASES if x in phases]
    if args.archs is not None:
        args.archs = [a for a in args.archs.split(",") if a]
        unknown = [a for a in args.archs if a not in variants()]
        if unknown or not args.archs:
            p.error(f"--archs: unknown variant {unknown[0] if unknown else '(none given)'!r} "
                    f"(choose from {', '.join(variants())})")
    if args.budget_s < MIN_START_S:
        p.error(f"--budget-s {args.budget_s:g}: at least {MIN_START_S}")
    args.out = os.path.abspath(args.out)
    args.work_dir = os.path.abspath(args.work_dir or default_work_dir())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.phase:
        # SIGTERM at the phase's limit: unwind (the serving phase's servers stop in its finally blocks)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        run_phase(args.phase, args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    result = dict(check="pdserve device check (issue 43)", dry_run=args.dry_run, device=args.device,
                  budget_s=args.budget_s, work_dir=args.work_dir, environment=environment(args.device),
                  phases={}, targets={})
    json_path, log_path = os.path.join(args.out, "device_check.json"), os.path.join(args.out, "device_check.log")
    if args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():   # the JSON still says so, with what nvidia-smi saw
            result["error"] = "no CUDA device here"
            save(json_path, result)
            print("device_check: error: no CUDA device here (on a CPU, run with --dry-run)", file=sys.stderr)
            return 2
    os.makedirs(args.work_dir, exist_ok=True)
    say(f"{result['environment']['date']}: phases {', '.join(args.phases)} on {args.device}, "
        f"budget {args.budget_s:.0f} s, work dir {args.work_dir}")
    with open(log_path, "a", encoding="utf-8") as log:
        for name in args.phases:
            limit = phase_limit(name, args.phases, started, args.budget_s)
            needs_8b = name in ("roofline", "serving")
            have_8b = os.path.exists(os.path.join(checkpoint_8b(args), ".complete"))
            if needs_8b and not have_8b:
                rec = dict(status="skipped", reason="no 8B-shaped checkpoint (make_8b did not finish)")
            elif limit < MIN_START_S:
                rec = dict(status="skipped", reason=f"out of time ({max(limit, 0):.0f} s left of the budget)")
            else:
                say(f"{name}: up to {limit:.0f} s")
                rec = spawn_phase(name, args, limit, log)
                if rec["status"] != "ok":
                    log.flush()
                    rec["log_tail"] = log_tail(log_path)
            result["phases"][name] = rec
            result["targets"] = evaluate_targets(result["phases"])
            result["seconds"] = round(time.monotonic() - started, 1)
            save(json_path, result)
            say(f"{name}: {rec['status']}{_phase_line(name, rec)}")
    text = summary(result)
    with open(os.path.join(args.out, "device_check.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
