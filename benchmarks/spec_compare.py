"""Speculative decoding side by side (issue 33): pdserve with n-gram speculation on and off, and
vLLM's CPU build and llama-server with and without their n-gram modes, on one checkpoint.

- edit-c1: `pdserve bench --dataset-name edit` (a story, an instruction to write it out again,
  its first sentence) one request at a time. Read: median TPOT, and tokens equal to plain greedy.
- edit-c32 and random-c32: 32 requests at once, the edit prompts and random 128-token prompts.
  Read: output tok/s (speculation must not lose where decode is compute-bound).

Every system runs greedy (the bench's temperature 0) with k = 4 drafts and lookups of 2-4 tokens
where the system lets one set them. One system at a time, after a short warm-up; the same seeds
for every system (speculation does not change what a prefix cache holds, and every system gets
the same prompts). Raw `pdserve bench` JSON to RESULTS/spec/<workload>/<system>.json, the summary
to RESULTS/spec.json, a table to stdout.

    python -m benchmarks.spec_compare --quick                        # bundled model, pdserve only (~2 min)
    python -m benchmarks.spec_compare --model /work/copy05b          # the 0.5B-shaped comparison
    python -m benchmarks.spec_compare --model M --systems engine,engine-ngram --workloads edit-c1

A model that never repeats its prompt gives speculation nothing to accept: `python -m
tools.finetune_edit` and `python -m tools.widen_model` make a 0.5B-shaped checkpoint that does.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks import compare, peers, prefix_compare
from pdserve.bench import servers
from pdserve.engine.args import DEFAULT_MODEL

SYSTEMS = ("engine", "engine-ngram", "vllm", "vllm-ngram", "llama-server", "llama-server-ngram")
WORKLOADS = ("edit-c1", "edit-c32", "random-c32")
SEED = 3300
K, LOOKUP_MIN, LOOKUP_MAX = 4, 2, 4


def spec_flags(system: str) -> list[str]:
    """The flags that turn on each system's n-gram speculation."""
    if system == "engine-ngram":
        return ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": K,
                                                    "prompt_lookup_min": LOOKUP_MIN, "prompt_lookup_max": LOOKUP_MAX})]
    if system == "vllm-ngram":
        return ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": K,
                                                    "prompt_lookup_min": LOOKUP_MIN, "prompt_lookup_max": LOOKUP_MAX})]
    if system == "llama-server-ngram":   # ngram-simple: one lookup length N, drafts of M tokens
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(LOOKUP_MIN + 1),
                "--spec-ngram-simple-size-m", str(K)]
    return []


def server_for(system: str, args, log_dir: str) -> servers.Server:
    base = system.removesuffix("-ngram")
    name = os.path.basename(os.path.normpath(args.model))
    if base in ("vllm", "llama-server"):
        server = compare.server_for(base, args.model, name, args.peers_dir, log_dir, args.dry_run)
        server.name = system
        server.cmd += spec_flags(system)
        server.log_path = os.path.join(log_dir, f"{system}.log")
        return server
    port = servers.free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", args.model, "--port", str(port),
           "--max-model-len", str(peers.context_len(args.model)), "--log-level", "warning", *spec_flags(system)]
    return servers.Server(system, cmd, port, os.path.join(log_dir, f"{system}.log"),
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))


def bench_args(workload: str, args) -> list[str]:
    if workload == "edit-c1":
        return ["--dataset-name", "edit", "--num-prompts", str(args.c1_prompts), "--max-concurrency", "1",
                "--random-output-len", str(args.output_len)]
    n = str(args.c32_prompts)
    if workload == "edit-c32":
        return ["--dataset-name", "edit", "--num-prompts", n, "--max-concurrency", "32",
                "--random-output-len", str(args.output_len)]
    return ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", str(args.output_len),
            "--num-prompts", n, "--max-concurrency", "32"]


def bench_command(server: servers.Server, workload: str, args, seed: int, out: str | None) -> list[str]:
    name = os.path.basename(os.path.normpath(args.model))
    # the same prompts for every system (seed per workload, not per system); the answers' texts are kept
    return [sys.executable, "-m", "pdserve", "bench", "--base-url", server.base_url, "--model", name,
            *bench_args(workload, args), "--seed", str(SEED + WORKLOADS.index(workload)), "--label", server.name,
            "--save-detailed", "--disable-tqdm", *(["--output", out] if out else [])]


def row_of(system: str, workload: str, res: dict) -> dict:
    return {"system": system, "workload": workload, "completed": res.get("completed"), "failed": res.get("failed"),
            "output_throughput": res.get("output_throughput"), "median_tpot_ms": res.get("median_tpot_ms"),
            "median_ttft_ms": res.get("median_ttft_ms"), "acceptance_rate": res.get("spec_decode_acceptance_rate"),
            "texts": res.get("generated_texts")}


def same_tokens(rows: list[dict]) -> None:
    """Mark each speculating row with whether its answers equal its plain counterpart's, text for text
    (greedy on one tokenizer: the same text is the same tokens)."""
    by = {(r["system"], r["workload"]): r for r in rows}
    for r in rows:
        plain = by.get((r["system"].removesuffix("-ngram"), r["workload"]))
        if r["system"].endswith("-ngram") and plain and "error" not in r and "error" not in plain:
            r["tokens_equal_plain"] = bool(r["texts"]) and r["texts"] == plain["texts"]


def table(rows: list[dict]) -> str:
    lines = ["| workload | system | median TPOT (ms) | against plain | output tok/s | against plain | acceptance "
             "| tokens equal plain | failed |", "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["system"], r["workload"]): r for r in rows}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['system']} | {r['error'][:70]} | | | | | | |")
            continue
        plain = by.get((r["system"].removesuffix("-ngram"), r["workload"]), {})
        tpot_x = prefix_compare.ratio(r["median_tpot_ms"], plain.get("median_tpot_ms"))
        tput_x = prefix_compare.ratio(r["output_throughput"], plain.get("output_throughput"))
        acc = r.get("acceptance_rate")
        eq = {True: "yes", False: "no"}.get(r.get("tokens_equal_plain"), "")
        lines.append(f"| {r['workload']} | {r['system']} | {r['median_tpot_ms']:.1f} | {tpot_x} | "
                     f"{r['output_throughput']:.1f} | {tput_x} | {'' if acc is None else f'{acc:.0%}'} | {eq} | "
                     f"{r['failed']} |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated (default: %(default)s)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: %(default)s)")
    p.add_argument("--c1-prompts", type=int, default=8)
    p.add_argument("--c32-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128, help="answer tokens (and story words of the edit prompts)")
    prefix_compare.add_run_arguments(p)
    p.add_argument("--quick", action="store_true", help="pdserve on/off, few requests")
    args = p.parse_args(argv)
    if args.quick:
        args.systems, args.c1_prompts, args.c32_prompts, args.output_len = "engine,engine-ngram", 2, 8, 32
    prefix_compare.split_choices(p, args, SYSTEMS, WORKLOADS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = os.path.join(args.results, "spec")
    log_dir = os.path.join(out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    rows = []
    for system in args.systems:
        rows += prefix_compare.run_system(system, args, out_dir, log_dir, SEED, server_for=server_for,
                                          bench_command=bench_command, row_of=row_of)
    if args.dry_run:
        return 0
    same_tokens(rows)
    summary = {"model": args.model, "machine": compare.machine_info(),
               "workloads": {w: bench_args(w, args) for w in args.workloads},
               "rows": [{k: v for k, v in r.items() if k != "texts"} for r in rows]}
    with open(os.path.join(args.results, "spec.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
