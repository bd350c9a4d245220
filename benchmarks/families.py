"""`python -m benchmarks.families`: the 2026 families at their real shapes against the peers (issue 40).

On each checkpoint (e.g. `python -m tools.make_model --arch qwen3 --size hub`: Qwen3-0.6B's shape with
random weights; `--arch gemma3 --size hub`: Gemma-3-1B's) and dtype, start each system once on
127.0.0.1, record its time to ready (process start to a healthy /health, page cache warm), warm it up,
run compare.py's c32 and c1 workloads on the 0.5B sizes, and stop it. pdserve also gets
`pdserve roofline --read-rounds`: its batch-1 decode step against the time to read the weights it holds.
llama-server runs on its own GGUF conversion of the checkpoint at the same precision (f32 / bf16).

Each (checkpoint, dtype, system) is one record in OUT_DIR, so a shared machine can run them one at a
time (each under a lock that keeps other work off the cores) and `--doc` writes one table from all of
them:

    python -m benchmarks.families --model /work/models/qwen3-hub --dtype bfloat16 --systems pdserve,vllm
    python -m benchmarks.families --doc docs/BENCHMARKS.md        # the table from the records so far

The MoE checkpoints (issue 41) keep their records in an --out-dir of their own and their table in
`--block moe`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime

from benchmarks import peers
from benchmarks.report_md import replace_block
from benchmarks.compare import busy_cores, loadavg, machine_info
from benchmarks.neighbour import run_bench
from benchmarks.workloads import WARMUP, WORKLOADS
from pdserve.bench import servers

SYSTEMS = ("pdserve", "vllm", "llama-server")
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}
# --doc's block in docs/BENCHMARKS.md and the heading it goes under when the block is new
SECTIONS = {"families": "### The 2026 families at their real shapes against the peers (issue 40)",
            "moe": "### Mixture of experts at real shapes against the peers (issue 41)"}


def say(msg: str) -> None:
    print(f"[families {datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def make_server(system: str, model: str, dtype: str, peers_dir: str, log_path: str) -> servers.Server:
    port, name, ctx = servers.free_port(), os.path.basename(os.path.normpath(model)), peers.context_len(model)
    if system == "pdserve":
        cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model, "--dtype", dtype, "--port", str(port),
               "--max-model-len", str(ctx), "--log-level", "warning"]
        return servers.Server(system, cmd, port, log_path, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if system == "vllm":
        cmd = peers.vllm_command(peers.install_vllm(peers_dir), model, port, name, ctx)
        cmd[cmd.index("--dtype") + 1] = dtype
        return servers.Server(system, cmd, port, log_path, env=peers.vllm_env(peers_dir))
    gguf = peers.convert_to_gguf(peers_dir, model, GGUF_TYPES[dtype])
    # 32 slots sharing a KV pool of 32 x 1024 tokens: the workloads' sequences fit, and the pool of a
    # Qwen3-0.6B (114 KB a token in f16) stays within this machine's memory
    cmd = peers.llama_server_command(peers.install_llama_server(peers_dir), gguf, port, name, slots=32,
                                     ctx=32 * 1024, threads=os.cpu_count() or 2)
    # -nr: llama.cpp's weight repacking crashes at start on AMX CPUs (BENCHMARKS.md, issue 45)
    return servers.Server(system, cmd + ["-nr"], port, log_path)


def read_line(model: str, model_args: list[str], out: str, rounds: int, timeout: float) -> dict:
    """`pdserve roofline`'s batch-1 decode step against the time to read its weights (median ratio);
    `model_args`: how the weights are served (e.g. ["--dtype", "bfloat16"] or ["--quantization", "int4"])."""
    cmd = [sys.executable, "-m", "pdserve", "roofline", "--model", model, *model_args, "--prefill-lens", "128",
           "--decode-batches", "1", "--decode-contexts", "128", "--read-rounds", str(rounds), "--output", out]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"over {timeout:.0f} s"}
    if proc.returncode != 0 or not os.path.exists(out):
        return {"status": "roofline failed", "error": (proc.stderr or proc.stdout)[-500:]}
    with open(out, encoding="utf-8") as f:
        res = json.load(f)
    b1 = ((res.get("side_by_side_read") or {}).get("batches") or {}).get("1")
    if not b1:
        return {"status": "no read rounds in the roofline output"}
    bws = res["side_by_side_read"]["bandwidth"]
    mid = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"status": "ok", "ratio_median": b1["ratio_median"], "ratio_min": min(b1["ratio"]),
            "ratio_max": max(b1["ratio"]), "step_ms": mid(b1["step_s"]) * 1e3,
            "read_ms": b1["bytes"] / mid(bws) * 1e3, "weight_bytes": b1["bytes"]}


def serve_and_bench(rec: dict, make_server, label: str, out_prefix: str, name: str, args, seed: int,
                    log=None, workloads=None) -> bool:
    """Start the server make_server() builds (peers install and convert there), warm it up, run the c32
    and c1 workloads (or `workloads`) on it into rec[...] (each written to out_prefix-WORKLOAD.json),
    stop it. False, with rec saying why, where it did not start: a peer that cannot install, convert
    or start is a result. log: the caller's progress lines (default: this module's)."""
    log = log or say
    workloads = workloads or [w for w in WORKLOADS["0.5b"] if w.name in ("c32", "c1")]
    try:
        server = make_server()
        log(f"{label}: starting")
        server.start(timeout=args.start_timeout)
    except Exception as e:  # noqa: BLE001
        rec.update(status="start failed", error=str(e)[:2000])
        log(f"{label}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        return False
    rec.update(status="ok", ready_s=round(server.ready_s, 1), server_cmd=server.cmd)
    log(f"{label}: ready after {server.ready_s:.1f} s")
    try:
        run_bench(server, name, WARMUP, seed, os.path.join(args.out_dir, "warmup.json"), args.timeout)
        for i, wl in enumerate(workloads):
            rec[wl.name] = run_bench(server, name, wl, seed + 1 + i, f"{out_prefix}-{wl.name}.json",
                                     args.timeout)   # fresh prompts each
            m = rec[wl.name].get("metrics", {})
            log(f"{label} {wl.name}: {rec[wl.name]['status']}"
                + (f", {m['output_throughput']:.1f} tok/s, TPOT {m['mean_tpot_ms']:.1f} ms" if m else ""))
    finally:
        server.stop()
    return True


def run_one(model: str, dtype: str, system: str, args, seed: int) -> dict:
    name = os.path.basename(os.path.normpath(model))
    rec = dict(model=name, model_dir=model, dtype=dtype, system=system, date=f"{datetime.now():%Y-%m-%d %H:%M}",
               busy_cores_before=busy_cores(), loadavg_before=loadavg())
    log_path = os.path.join(args.out_dir, "logs", f"{name}-{dtype}-{system}.log")
    if not serve_and_bench(rec, lambda: make_server(system, model, dtype, args.peers_dir, log_path),
                           f"{name} {dtype} {system}", os.path.join(args.out_dir, f"{name}-{dtype}-{system}"),
                           name, args, seed):
        return rec
    if system == "pdserve" and args.read_rounds:
        rec["read_line"] = read_line(model, ["--dtype", dtype], os.path.join(args.out_dir, f"{name}-{dtype}-roofline.json"),
                                     args.read_rounds, args.timeout)
        say(f"{name} {dtype} batch-1 decode against its weight read: {rec['read_line']}")
    rec["loadavg_after"] = loadavg()
    return rec


def load_records(out_dir: str) -> list[dict]:
    recs = []
    for fn in sorted(os.listdir(out_dir)):
        if fn.startswith("record-") and fn.endswith(".json"):
            with open(os.path.join(out_dir, fn), encoding="utf-8") as f:
                recs.append(json.load(f))
    return recs


def fmt(x, spec: str = ".1f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def reason(error: str) -> str:
    """The line of a start failure that says why (the server's own error, not our wrapper's)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    why = [ln for ln in lines if "rror" in ln and not ln.startswith(("start ", "raise"))]
    return (why[0] if why else lines[0] if lines else "?")[:160].replace("|", "/")


def failed(run: dict) -> str:
    return "" if run.get("status", "ok") == "ok" else f" ({run['status']})"


def table(recs: list[dict]) -> str:
    """One row per (checkpoint, dtype, system); pdserve's c32 ratio to each peer in the same group."""
    lines = ["| checkpoint | dtype | system | time to ready s | c32 output tok/s | c32 TPOT ms | c1 TPOT ms "
             "| pdserve c32 / this | batch-1 step / weight read |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(recs, key=lambda r: (r["model"], r["dtype"], SYSTEMS.index(r["system"]))):
        c32 = r.get("c32", {}).get("metrics", {})
        c1 = r.get("c1", {}).get("metrics", {})
        ours = next((o.get("c32", {}).get("metrics", {}).get("output_throughput") for o in recs
                     if o["system"] == "pdserve" and o["model"] == r["model"] and o["dtype"] == r["dtype"]), None)
        theirs = c32.get("output_throughput")
        ratio = f"{ours / theirs:.2f}x" if ours and theirs and r["system"] != "pdserve" else "-"
        rl = r.get("read_line", {})
        line = (f"{rl['ratio_median']:.2f}x ({rl['step_ms']:.1f} / {rl['read_ms']:.1f} ms)"
                if rl.get("status") == "ok" else rl.get("status", "-"))
        status = "" if r.get("status") == "ok" else f" ({r.get('status')}: {reason(r.get('error', ''))})"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['system']}{status} | {fmt(r.get('ready_s'))} "
                     f"| {fmt(c32.get('output_throughput'))}{failed(r.get('c32', {}))} | {fmt(c32.get('mean_tpot_ms'))} "
                     f"| {fmt(c1.get('mean_tpot_ms'))} | {ratio} | {line} |")
    return "\n".join(lines)


def report(table_text: str) -> str:
    """The machine and the workloads, then the table: the text of a --doc block."""
    info = machine_info()
    return (f"{info.get('model name', '?')}, {info.get('cores')} cores (AVX-512: "
            f"{'yes' if info.get('avx512') else 'no'}); random 128 in / 128 out, 64 requests at concurrency 32 (c32) "
            f"and 128 in / 32 out one at a time (c1), `pdserve bench`; each record's date, load and command are in its "
            f"JSON.\n\n" + table_text)


def write_doc(path: str, text: str, block: str = "families") -> None:
    replace_block(path, block, SECTIONS[block], text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], help="checkpoint directory (repeatable)")
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    p.add_argument("--read-rounds", type=int, default=4, help="pdserve roofline --read-rounds (0: skip)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one bench or roofline run may take")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--peers-dir", default=peers.DEFAULT_PEERS_DIR)
    p.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-families"))
    p.add_argument("--doc", default=None, help="write the table of every record in --out-dir into this file")
    p.add_argument("--block", choices=SECTIONS, default="families", help="--doc's block (moe: issue 41's MoE checkpoints)")
    p.add_argument("--seed", type=int, default=9100)
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    dtypes = [d for d in args.dtype.split(",") if d]
    bad = [s for s in systems if s not in SYSTEMS] + [d for d in dtypes if d not in GGUF_TYPES]
    if bad:
        p.error(f"unknown system or dtype {bad[0]!r}")
    os.makedirs(args.out_dir, exist_ok=True)
    seed = args.seed
    for model in args.model:
        for dtype in dtypes:
            for system in systems:
                seed += 10   # fresh prompts per server: the peers cache prefixes
                rec = run_one(model, dtype, system, args, seed)
                fn = f"record-{rec['model']}-{dtype}-{system}.json"
                with open(os.path.join(args.out_dir, fn), "w", encoding="utf-8") as f:
                    json.dump(rec, f, indent=1)
    text = report(table(load_records(args.out_dir)))
    print(text)
    if args.doc:
        write_doc(args.doc, text, args.block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
