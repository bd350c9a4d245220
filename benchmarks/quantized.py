"""`python -m benchmarks.quantized`: each weight format of one checkpoint, served side by side with the peers (issue 45).

One record per variant (a system and the weights it serves), so a shared machine can run them one at a
time, each under a lock that keeps other work off the cores; `--doc` writes one table from all records.
The files are made as users make them: GGUF by llama.cpp's converter and `llama-quantize` (the same
file for pdserve and llama-server), W4A16 by `python -m tools.quantize_hub --format ct` (compressed-
tensors pack-quantized, group 128; the same directory for pdserve and vLLM). Every pdserve variant also
gets `pdserve roofline --read-rounds`: its batch-1 decode step against the time to read the bytes it holds.

    python -m benchmarks.quantized --model /work/models/qwen2-0.5b                     # every variant
    python -m benchmarks.quantized --model /work/models/qwen2-0.5b --variants pdserve-Q4_K_M,llama-server-Q4_K_M
    python -m benchmarks.quantized --doc docs/BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime

from benchmarks import peers
from benchmarks.compare import busy_cores, loadavg
from benchmarks.families import fmt, load_records, read_line, reason, report, serve_and_bench
from benchmarks.report_md import replace_block
from pdserve.bench import servers

SECTION = "### Every weight format against its full precision and the peers (issue 45)"


@dataclass(frozen=True)
class Variant:
    system: str          # pdserve | llama-server | vllm
    weights: str         # fp32 | bf16 | int8 | int4 | Q8_0 | Q4_K_M | W4A16
    isa: str = ""        # PDSERVE_CPU_ISA for pdserve ("" = the machine's best build)

    @property
    def name(self) -> str:
        return f"{self.system}-{self.weights}" + (f"-{self.isa}" if self.isa else "")


VARIANTS = [Variant("pdserve", w) for w in ("fp32", "bf16", "int8", "int4", "Q8_0", "Q4_K_M", "W4A16")] + [
    Variant("pdserve", "W4A16", "avx2"), Variant("llama-server", "Q8_0"), Variant("llama-server", "Q4_K_M"),
    Variant("vllm", "fp32"), Variant("vllm", "W4A16")]
# the pdserve flags each weight format is served with (the file itself for GGUF and W4A16)
PDSERVE_ARGS = {"fp32": ["--dtype", "float32"], "bf16": ["--dtype", "bfloat16"],
                "int8": ["--quantization", "int8"], "int4": ["--quantization", "int4"]}


def say(msg: str) -> None:
    print(f"[quantized {datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def weights_path(v: Variant, model: str, args) -> str:
    """The file or directory the variant serves, made (and cached) as its users make it."""
    if v.weights in ("Q8_0", "Q4_K_M"):
        return peers.quantize_gguf(args.peers_dir, peers.convert_to_gguf(args.peers_dir, model, "f32"), v.weights)
    if v.weights == "W4A16":
        out = os.path.join(args.out_dir, "files", f"{os.path.basename(os.path.normpath(model))}-"
                                                  f"{peers.checkpoint_key(model)}-w4a16-g128")
        if not os.path.exists(out):
            subprocess.run([sys.executable, "-m", "tools.quantize_hub", model, out, "--format", "ct", "--bits", "4",
                            "--group", "128"], check=True, stdout=subprocess.DEVNULL)
        return out
    return model


def make_server(v: Variant, model: str, path: str, args, log_path: str) -> servers.Server:
    port, name, ctx = servers.free_port(), os.path.basename(os.path.normpath(model)), peers.context_len(model)
    if v.system == "pdserve":
        cmd = [sys.executable, "-m", "pdserve", "serve", "--model", path, *PDSERVE_ARGS.get(v.weights, []),
               "--served-model-name", name, "--port", str(port), "--max-model-len", str(ctx), "--log-level", "warning"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", **({"PDSERVE_CPU_ISA": v.isa} if v.isa else {}))
        return servers.Server(v.name, cmd, port, log_path, env=env)
    if v.system == "vllm":
        cmd = peers.vllm_command(peers.install_vllm(args.peers_dir), path, port, name, ctx)
        if v.weights == "bf16":
            cmd[cmd.index("--dtype") + 1] = "bfloat16"
        elif v.weights == "W4A16":   # its CPU int4 kernels take bf16 activations
            cmd[cmd.index("--dtype") + 1] = "bfloat16"
        return servers.Server(v.name, cmd, port, log_path, env=peers.vllm_env(args.peers_dir))
    cmd = peers.llama_server_command(peers.install_llama_server(args.peers_dir), path, port, name, slots=32,
                                     ctx=32 * 1024, threads=os.cpu_count() or 2)
    # -nr: llama.cpp's weight repacking crashes at start on AMX CPUs (BENCHMARKS.md, issue 45)
    return servers.Server(v.name, cmd + ["-nr"], port, log_path)


def run_one(v: Variant, model: str, args, seed: int) -> dict:
    name = os.path.basename(os.path.normpath(model))
    rec = dict(model=name, model_dir=model, variant=v.name, system=v.system, weights=v.weights, isa=v.isa,
               date=f"{datetime.now():%Y-%m-%d %H:%M}", busy_cores_before=busy_cores(), loadavg_before=loadavg())
    log_path = os.path.join(args.out_dir, "logs", f"{name}-{v.name}.log")
    served = []

    def make():
        served.append(weights_path(v, model, args))
        return make_server(v, model, served[0], args, log_path)

    if not serve_and_bench(rec, make, v.name, os.path.join(args.out_dir, f"{name}-{v.name}"), name, args, seed, say):
        return rec
    path = rec["served"] = served[0]
    if v.system == "pdserve" and args.read_rounds and not v.isa:
        rec["read_line"] = read_line(path, PDSERVE_ARGS.get(v.weights, []),
                                     os.path.join(args.out_dir, f"{name}-{v.name}-roofline.json"),
                                     args.read_rounds, args.timeout)
        say(f"{v.name} batch-1 decode against its weight read: {rec['read_line']}")
    rec["loadavg_after"] = loadavg()
    return rec


def table(recs: list[dict]) -> str:
    """One row per variant; each pdserve row's c32 against its full precision, and each peer's against
    pdserve on the same file."""
    order = [v.name for v in VARIANTS]
    lines = ["| checkpoint | system | weights | c32 output tok/s | c32 TPOT ms | c1 TPOT ms | c32 / pdserve fp32 "
             "| pdserve c32 / this | batch-1 step / weight read |", "|---|---|---|---|---|---|---|---|---|"]

    def c32(r):
        return r.get("c32", {}).get("metrics", {}).get("output_throughput") if r else None

    for r in sorted(recs, key=lambda r: (r["model"], order.index(r["variant"]) if r["variant"] in order else 99)):
        same = lambda s, w, isa="": next((o for o in recs if o["model"] == r["model"] and o["system"] == s  # noqa: E731
                                           and o["weights"] == w and o.get("isa", "") == isa), None)
        mine, fp32 = c32(r), c32(same("pdserve", "fp32"))
        vs_fp32 = f"{mine / fp32:.2f}x" if mine and fp32 and r["system"] == "pdserve" else "-"
        ours = c32(same("pdserve", r["weights"]))
        vs_peer = f"{ours / mine:.2f}x" if ours and mine and r["system"] != "pdserve" else "-"
        rl = r.get("read_line", {})
        line = (f"{rl['ratio_median']:.2f}x ({rl['step_ms']:.1f} / {rl['read_ms']:.1f} ms)"
                if rl.get("status") == "ok" else rl.get("status", "-"))
        status = "" if r.get("status") == "ok" else f" ({r.get('status')}: {reason(r.get('error', ''))})"
        weights = r["weights"] + (f", PDSERVE_CPU_ISA={r['isa']}" if r.get("isa") else "")
        m32, m1 = r.get("c32", {}).get("metrics", {}), r.get("c1", {}).get("metrics", {})
        bad = "" if r.get("c32", {}).get("status", "ok") == "ok" else f" ({r['c32']['status']})"
        lines.append(f"| {r['model']} | {r['system']}{status} | {weights} | {fmt(mine)}{bad} "
                     f"| {fmt(m32.get('mean_tpot_ms'))} | {fmt(m1.get('mean_tpot_ms'))} | {vs_fp32} | {vs_peer} | {line} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the full-precision HF checkpoint directory")
    p.add_argument("--variants", default=",".join(v.name for v in VARIANTS),
                   help=f"comma-separated, from {', '.join(v.name for v in VARIANTS)}")
    p.add_argument("--read-rounds", type=int, default=4, help="pdserve roofline --read-rounds (0: skip)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one bench or roofline run may take")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--peers-dir", default=peers.DEFAULT_PEERS_DIR)
    p.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-quantized"))
    p.add_argument("--doc", default=None, help="write the table of every record in --out-dir into this file")
    p.add_argument("--seed", type=int, default=9500)
    args = p.parse_args(argv)
    by_name = {v.name: v for v in VARIANTS}
    wanted = [s for s in args.variants.split(",") if s]
    unknown = [s for s in wanted if s not in by_name]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}")
    os.makedirs(args.out_dir, exist_ok=True)
    if args.model:
        for i, name in enumerate(wanted):
            rec = run_one(by_name[name], args.model, args, args.seed + 10 * i)   # fresh prompts per server
            with open(os.path.join(args.out_dir, f"record-{rec['model']}-{name}.json"), "w", encoding="utf-8") as f:
                json.dump(rec, f, indent=1)
    text = report(table([r for r in load_records(args.out_dir) if "variant" in r]))
    print(text)
    if args.doc:
        replace_block(args.doc, "quantized", SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
