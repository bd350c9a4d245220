"""Prefix caching side by side (issue 27): pdserve with its cache on and off, vLLM's CPU build and
llama-server, each with its own prefix cache on, on the two workloads a prefix cache is for.

- multi-turn: chats whose history grows (`pdserve bench --dataset-name multi-turn`): each turn is
  sent when the previous answer arrived, with the whole history; each user message quotes a story
  passage (--passage-words), so the history passes 1,000 tokens by the last turn also on a
  random-weight model whose answers decode to little text. Read: p50 TTFT of turns 2 on.
- shared-prefix: groups of requests sharing a long system prompt (--prefix-len) with their own
  suffixes, at concurrency 16. Read: output tok/s.

One system at a time on 127.0.0.1, each with its own seeds (every server caches: none may see
another run's prompts), after a short warm-up. Raw `pdserve bench` JSON goes to
RESULTS/prefix/<workload>/<system>.json, the summary to RESULTS/prefix.json, a table to stdout.

    python -m benchmarks.prefix_compare --quick                  # tiny model, pdserve on/off (~2 min)
    python -m benchmarks.prefix_compare --model /work/q05        # the 0.5B comparison with the peers
    python -m benchmarks.prefix_compare --model /work/q05 --systems engine,engine-nocache --dry-run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import compare, peers
from pdserve.bench import servers
from pdserve.engine.args import DEFAULT_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("engine", "engine-nocache", "vllm", "llama-server")
WORKLOADS = ("multi-turn", "shared-prefix")
SEED = 2700


def server_for(system: str, args, log_dir: str) -> servers.Server:
    name = os.path.basename(os.path.normpath(args.model))
    if system in ("vllm", "llama-server"):
        return compare.server_for(system, args.model, name, args.peers_dir, log_dir, args.dry_run)
    port = servers.free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", args.model, "--port", str(port),
           "--max-model-len", str(peers.context_len(args.model)), "--log-level", "warning"]
    if system == "engine-nocache":
        cmd.append("--no-enable-prefix-caching")
    return servers.Server(system, cmd, port, os.path.join(log_dir, f"{system}.log"),
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))


def bench_args(workload: str, args) -> list[str]:
    if workload == "multi-turn":
        return ["--dataset-name", "multi-turn", "--num-prompts", str(args.conversations),
                "--num-turns", str(args.turns), "--turn-passage-words", str(args.passage_words),
                "--random-output-len", str(args.output_len), "--max-concurrency", str(args.turn_concurrency)]
    return ["--dataset-name", "shared-prefix", "--prefix-len", str(args.prefix_len),
            "--num-prefix-groups", str(args.groups), "--random-input-len", str(args.suffix_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency)]


def bench_command(server: servers.Server, workload: str, args, seed: int, out: str | None) -> list[str]:
    name = os.path.basename(os.path.normpath(args.model))
    return [sys.executable, "-m", "pdserve", "bench", "--base-url", server.base_url, "--model", name,
            *bench_args(workload, args), "--seed", str(seed), "--label", server.name, "--disable-tqdm",
            *(["--output", out] if out else [])]


def row_of(system: str, workload: str, res: dict) -> dict:
    row = {"system": system, "workload": workload, "completed": res.get("completed"), "failed": res.get("failed"),
           "output_throughput": res.get("output_throughput"), "median_ttft_ms": res.get("median_ttft_ms"),
           "prefix_cache_hit_rate": res.get("prefix_cache_hit_rate")}
    if workload == "multi-turn":
        row["later_turns_median_ttft_ms"] = res.get("later_turns_median_ttft_ms")
        turns = res.get("turns") or []
        row["last_turn_prompt_tokens"] = turns[-1]["mean_prompt_tokens"] if turns else None
    return row


def run_system(system: str, args, out_dir: str, log_dir: str, seed: int, server_for=server_for,
               bench_command=bench_command, row_of=row_of) -> list[dict]:
    """Start `system`, warm it up, run each of args.workloads through `pdserve bench`, stop it. The
    three functions are this driver's; benchmarks.spec_compare passes its own."""
    try:
        server = server_for(system, args, log_dir)
    except Exception as e:  # noqa: BLE001  a peer that cannot be installed is a result
        print(f"{system}: install failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}", flush=True)
        return [{"system": system, "workload": w, "error": f"install failed: {e}"} for w in args.workloads]
    if args.dry_run:
        print(" ".join(server.cmd))
        for k, w in enumerate(args.workloads):
            print("  " + " ".join(bench_command(server, w, args, seed + k, "OUT.json")))
        return []
    rows = []
    try:
        server.start(timeout=args.start_timeout)
    except servers.PeerError as e:
        print(f"{system}: failed to start: {e}", flush=True)
        return [{"system": system, "workload": w, "error": f"start failed: {e}"} for w in args.workloads]
    try:
        warm = [sys.executable, "-m", "pdserve", "bench", "--base-url", server.base_url, "--dataset-name", "random",
                "--random-input-len", "128", "--random-output-len", "8", "--num-prompts", "2",
                "--seed", str(seed + 50), "--disable-tqdm"]
        subprocess.run(warm, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=900)
        for k, workload in enumerate(args.workloads):
            out = os.path.join(out_dir, workload, f"{system}.json")
            os.makedirs(os.path.dirname(out), exist_ok=True)
            t0 = time.monotonic()
            with open(os.path.join(log_dir, f"bench-{workload}-{system}.log"), "w") as log:
                rc = subprocess.run(bench_command(server, workload, args, seed + k, out), stdout=log,
                                    stderr=subprocess.STDOUT, timeout=args.bench_timeout).returncode
            if not os.path.exists(out):
                rows.append({"system": system, "workload": workload, "error": f"pdserve bench exit {rc}"})
                continue
            with open(out) as f:
                rows.append(row_of(system, workload, json.load(f)))
            print(f"{system} / {workload}: done in {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        server.stop()
    return rows


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def table(rows: list[dict]) -> str:
    """One markdown table per workload; ratios of pdserve (cache on) against each other system."""
    lines = []
    by = {(r["system"], r["workload"]): r for r in rows}
    if any(r["workload"] == "multi-turn" for r in rows):
        lines += ["| system | later turns' p50 TTFT (ms) | pdserve's against it | last turn's prompt tokens "
                  "| cache hit rate | failed |", "|---|---|---|---|---|---|"]
        ours = by.get(("engine", "multi-turn"), {}).get("later_turns_median_ttft_ms")
        for r in rows:
            if r["workload"] != "multi-turn":
                continue
            if "error" in r:
                lines.append(f"| {r['system']} | {r['error'][:60]} | | | | |")
                continue
            t, hit = r["later_turns_median_ttft_ms"], r.get("prefix_cache_hit_rate")
            lines.append(f"| {r['system']} | {t:,.0f} | {ratio(ours, t)} | {r['last_turn_prompt_tokens'] or 0:,.0f} "
                         f"| {'n/a' if hit is None else f'{hit:.0%}'} | {r['failed']} |")
        lines.append("")
    if any(r["workload"] == "shared-prefix" for r in rows):
        lines += ["| system | output tok/s | pdserve's against it | p50 TTFT (ms) | cache hit rate | failed |",
                  "|---|---|---|---|---|---|"]
        ours = by.get(("engine", "shared-prefix"), {}).get("output_throughput")
        for r in rows:
            if r["workload"] != "shared-prefix":
                continue
            if "error" in r:
                lines.append(f"| {r['system']} | {r['error'][:60]} | | | | |")
                continue
            hit = r.get("prefix_cache_hit_rate")
            lines.append(f"| {r['system']} | {r['output_throughput']:.1f} | {ratio(ours, r['output_throughput'])} "
                         f"| {r['median_ttft_ms']:,.0f} | {'n/a' if hit is None else f'{hit:.0%}'} | {r['failed']} |")
    return "\n".join(lines)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The flags run_system reads (benchmarks.spec_compare adds them too)."""
    p.add_argument("--peers-dir", default=peers.DEFAULT_PEERS_DIR)
    p.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--bench-timeout", type=float, default=3600)
    p.add_argument("--dry-run", action="store_true")


def split_choices(p: argparse.ArgumentParser, args, systems: tuple, workloads: tuple) -> None:
    """args.systems and args.workloads as lists, each name one of `systems` / `workloads`."""
    args.systems, args.workloads = args.systems.split(","), args.workloads.split(",")
    for given, known, flag in ((args.systems, systems, "--systems"), (args.workloads, workloads, "--workloads")):
        bad = [x for x in given if x not in known]
        if bad:
            p.error(f"{flag}: unknown {bad}; choose from {', '.join(known)}")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated (default: %(default)s)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: %(default)s)")
    g = p.add_argument_group("multi-turn")
    g.add_argument("--conversations", type=int, default=8)
    g.add_argument("--turns", type=int, default=5)
    g.add_argument("--passage-words", type=int, default=160, help="story words quoted in each user turn")
    g.add_argument("--turn-concurrency", type=int, default=4, help="conversations in flight at once")
    g = p.add_argument_group("shared-prefix")
    g.add_argument("--prefix-len", type=int, default=1024)
    g.add_argument("--suffix-len", type=int, default=128)
    g.add_argument("--groups", type=int, default=4)
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64, help="answer tokens, both workloads")
    add_run_arguments(p)
    p.add_argument("--quick", action="store_true", help="tiny default model, pdserve on/off, few requests")
    args = p.parse_args(argv)
    if args.quick:
        args.systems = "engine,engine-nocache"
        args.conversations, args.turns, args.passage_words, args.num_prompts = 4, 3, 60, 16
        args.prefix_len, args.suffix_len, args.output_len = 256, 32, 16
    split_choices(p, args, SYSTEMS, WORKLOADS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = os.path.join(args.results, "prefix")
    log_dir = os.path.join(out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    rows = []
    for k, system in enumerate(args.systems):
        rows += run_system(system, args, out_dir, log_dir, SEED + 10 * k)
    if args.dry_run:
        return 0
    summary = {"model": args.model, "machine": compare.machine_info(),
               "workloads": {w: bench_args(w, args) for w in args.workloads}, "rows": rows}
    with open(os.path.join(args.results, "prefix.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
