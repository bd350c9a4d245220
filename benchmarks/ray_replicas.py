"""Replicas on Ray against one engine, and KV-aware routing against round-robin (issue 30's targets).

Two comparisons, each measured with `pdserve bench` on 127.0.0.1:
  1. throughput: 2 engine replicas on a 2-node local Ray cluster (one CPU each, --threads 1) against
     one `pdserve serve` on 2 threads; the random workload at full concurrency: throughput, TTFT, TPOT.
  2. routing: the 2-replica app with --routing prefix-aware, then round-robin, on the multi-turn
     workload; a conversation's later turns find their history cached only on the replica that
     served the earlier ones: TTFT of turns 2+ and the prefix-cache hit rate.

    python -m benchmarks.ray_replicas --quick            # the bundled tiny model, a few requests (~2 min)
    python -m benchmarks.ray_replicas --model DIR        # the full sizes

Writes the bench JSONs and a summary under --out (default benchmarks/results/ray_replicas/, git-ignored)
and prints one table per comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from pdserve.bench import servers
from pdserve.engine.args import DEFAULT_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# passage_words: each user turn quotes a story passage, so the history grows also on a random-weight model
FULL = dict(prompts=64, input_len=256, output_len=64, conversations=16, turns=5, turn_output=32, passage_words=160)
QUICK = dict(prompts=8, input_len=64, output_len=16, conversations=4, turns=3, turn_output=8, passage_words=30)


def bench(url: str, out: str, label: str, sizes: dict, workload: str, seed: int) -> dict:
    """One `pdserve bench` run (a subprocess, so the client does not share this process's GIL)."""
    # --model names the checkpoint: a server on that port serving anything else fails the run, not measures it
    cmd = [sys.executable, "-m", "pdserve", "bench", "--base-url", url, "--model", sizes["served_name"], "--label", label,
           "--output", out, "--seed", str(seed), "--disable-tqdm", "--num-warmups", "2"]
    if workload == "random":
        cmd += ["--dataset-name", "random", "--num-prompts", str(sizes["prompts"]),
                "--random-input-len", str(sizes["input_len"]), "--random-output-len", str(sizes["output_len"])]
    else:
        cmd += ["--dataset-name", "multi-turn", "--num-prompts", str(sizes["conversations"]),
                "--num-turns", str(sizes["turns"]), "--random-output-len", str(sizes["turn_output"]),
                "--turn-passage-words", str(sizes["passage_words"])]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    with open(out) as f:
        return json.load(f)


def one_engine(model: str, out_dir: str, sizes: dict, seed: int) -> dict:
    port = servers.free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", model, "--port", str(port), "--threads", "2"]
    with servers.Server("pdserve-1x2", cmd, port, os.path.join(out_dir, "engine.log")).start(300) as s:
        return bench(s.base_url, os.path.join(out_dir, "engine-random.json"), "1 engine, 2 threads", sizes,
                     "random", seed)


def ray_runs(model: str, out_dir: str, sizes: dict, seed: int) -> dict:
    """The 2-replica app on a local 2-node cluster: the random workload, then multi-turn per routing."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from pdserve.cli import Parser
    from pdserve.entrypoints.ray_serve import deploy
    from pdserve.entrypoints import serve_args

    def args(routing: str):
        p = Parser(prog="pdserve serve")
        serve_args.add_arguments(p)
        return p.parse_args(["--model", model, "--ray", "--num-replicas", "2", "--ray-replicas-per-node", "1",
                             "--routing", routing])

    cluster, port, results = Cluster(), servers.free_port(), {}
    try:
        cluster.add_node(num_cpus=1, include_dashboard=False)
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
        url = f"http://127.0.0.1:{port}"
        for routing in ("prefix-aware", "round-robin"):
            deploy(args(routing))   # new replicas: no cache carried over from the last run
            if routing == "prefix-aware":
                results["random"] = bench(url, os.path.join(out_dir, "ray-random.json"),
                                          "2 Ray replicas, 1 CPU each", sizes, "random", seed)
                deploy(args(routing))
            results[routing] = bench(url, os.path.join(out_dir, f"ray-multi-turn-{routing}.json"),
                                     f"2 Ray replicas, {routing}", sizes, "multi-turn", seed + 1)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return results


def row(label: str, res: dict) -> str:
    return (f"| {label} | {res['completed']} | {res['output_throughput']:.1f} | {res['mean_ttft_ms']:.1f} | "
            f"{res['median_ttft_ms']:.1f} | {res['mean_tpot_ms']:.1f} |")


def turn_row(label: str, res: dict) -> str:
    later = [t for t in res["turns"] if t["turn"] > 1]
    hit = [t["prefix_cache_hit_rate"] for t in later if t["prefix_cache_hit_rate"] is not None]
    hit_text = f"{100 * sum(hit) / len(hit):.0f}%" if hit else "n/a"
    return (f"| {label} | {res['completed']} | {res['later_turns_median_ttft_ms']:.1f} | {hit_text} | "
            f"{res['mean_ttft_ms']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory (default: the bundled tiny model)")
    p.add_argument("--quick", action="store_true", help="a few small requests: checks the driver, measures little")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "ray_replicas"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL, served_name=os.path.basename(os.path.normpath(args.model)))
    os.makedirs(args.out, exist_ok=True)
    engine = one_engine(args.model, args.out, sizes, args.seed)
    ray_results = ray_runs(args.model, args.out, sizes, args.seed)
    lines = ["| system | requests | output tok/s | mean TTFT (ms) | median TTFT (ms) | mean TPOT (ms) |",
             "|---|---|---|---|---|---|", row("1 engine, 2 threads", engine),
             row("2 Ray replicas (2 nodes, 1 CPU each)", ray_results["random"]), "",
             "| routing (multi-turn) | requests | median TTFT turns 2+ (ms) | cache hit turns 2+ | mean TTFT (ms) |",
             "|---|---|---|---|---|"]
    lines += [turn_row(r, ray_results[r]) for r in ("prefix-aware", "round-robin")]
    summary = {"model": args.model, "sizes": sizes, "engine": engine, **{f"ray_{k}": v for k, v in ray_results.items()}}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
