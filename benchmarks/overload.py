"""Overload: offer 10x what the server completes and measure how it refuses.

    python -m benchmarks.overload            # about a minute; loopback only

Starts `pdserve serve` (the bundled default model unless --model) with a small --max-waiting,
measures the rate at which it completes requests when saturated (closed loop), then offers
Poisson arrivals at --factor times that rate for --duration seconds while probing /health every
50 ms, with hostile clients alongside: 900 KB prompts, requests asking for n=64 x 200 tokens x
20 logprobs, and slowloris connections (hostile.py). Reports the refusal latency (503 +
Retry-After) and /health p50/p99 against 50 ms / 100 ms, the hostile requests' statuses and
latencies, when the slow clients were cut off, and admitted vs completed; writes
benchmarks/results/reliability/overload.json.
Latencies are measured by the client, on the same machine as the server.
"""
import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
from benchmarks.hostile import slow_clients
from pdserve.bench.servers import Server, free_port

DEFAULT_MODEL = os.path.join(HERE, "..", "pdserve", "data", "default-model")
OUT = os.path.join(HERE, "results", "reliability", "overload.json")


def pct(xs: list[float], p: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else None


async def request(client, args, i: int) -> tuple[int, float, str | None, bool]:
    """(status, seconds, Retry-After, completed in full)."""
    body = {"prompt": f"Request {i}: once upon a time", "max_tokens": args.max_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    try:
        r = await client.post("/v1/completions", json=body)
    except httpx.TransportError:
        return -1, time.perf_counter() - t0, None, False
    dt = time.perf_counter() - t0
    done = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == args.max_tokens
    return r.status_code, dt, r.headers.get("Retry-After"), done


async def saturated_rate(client, args) -> float:
    """Completed requests per second with every seat and waiting slot busy (closed loop)."""
    end, count = time.perf_counter() + args.calibrate, 0

    async def worker(w):
        nonlocal count
        i = 0
        while time.perf_counter() < end:
            status, *_ = await request(client, args, w * 100000 + i)
            count += status == 200
            i += 1
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(args.max_num_seqs + args.max_waiting)))
    return count / (time.perf_counter() - t0)


async def run(args, url: str) -> dict:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        rate = await saturated_rate(client, args)
        offered = rate * args.factor
        print(f"saturated completion rate {rate:.1f} req/s; offering {offered:.1f} req/s for {args.duration:g} s")
        stop, health = asyncio.Event(), []

        async def probe():
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await client.get("/health")
                health.append((r.status_code, time.perf_counter() - t0))
                await asyncio.sleep(0.05)
        prober = asyncio.create_task(probe())
        hostile = {"huge_prompt": [], "amplification": []}
        done = threading.Event()

        def hostile_loop(kind: str, body: bytes):
            # on threads of their own with bodies encoded once, so this client's event loop (which
            # times the refusals and /health) does not pay for them
            with httpx.Client(base_url=url, timeout=300) as c:
                while not done.is_set():
                    t0 = time.perf_counter()
                    r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                    hostile[kind].append((r.status_code, time.perf_counter() - t0))
        huge = json.dumps({"prompt": "word " * 180_000}).encode()
        amplify = json.dumps({"prompt": "Hi", "n": 64, "max_tokens": 200, "logprobs": 20}).encode()
        hostiles = [threading.Thread(target=hostile_loop, args=("huge_prompt", huge)) for _ in range(args.huge_prompts)]
        hostiles += [threading.Thread(target=hostile_loop, args=("amplification", amplify))
                     for _ in range(args.amplifiers)]
        for t in hostiles:
            t.start()
        slow = asyncio.create_task(slow_clients(url, args.slow_clients, give_up=args.duration + 30))
        rng, tasks, i = random.Random(0), [], 0
        t_end = time.perf_counter() + args.duration
        while time.perf_counter() < t_end:
            tasks.append(asyncio.create_task(request(client, args, i)))
            i += 1
            await asyncio.sleep(rng.expovariate(offered))
        results = await asyncio.gather(*tasks)   # admitted ones run to completion
        stop.set()
        done.set()
        await prober
        for t in hostiles:
            t.join()
        slow = await slow
    refused = [r for r in results if r[0] == 503]
    admitted = [r for r in results if r[0] == 200]
    refusal_ms = [r[1] * 1e3 for r in refused]
    health_ms = [dt * 1e3 for _, dt in health]
    return {
        "model": os.path.basename(os.path.normpath(args.model)), "max_waiting": args.max_waiting,
        "max_num_seqs": args.max_num_seqs, "max_tokens": args.max_tokens, "duration_s": args.duration,
        "saturated_rate_rps": rate, "offered_rate_rps": offered, "factor": args.factor,
        "requests": len(results), "admitted": len(admitted), "completed": sum(r[3] for r in admitted),
        "refused_503": len(refused), "refused_with_retry_after": sum(r[2] is not None for r in refused),
        "other_statuses": sorted({r[0] for r in results} - {200, 503}),
        "other_5xx": sum(r[0] >= 500 and r[0] != 503 for r in results),
        "refusal_ms": {"p50": pct(refusal_ms, 50), "p99": pct(refusal_ms, 99), "max": max(refusal_ms, default=None)},
        "health_ms": {"p50": pct(health_ms, 50), "p99": pct(health_ms, 99), "max": max(health_ms, default=None),
                      "probes": len(health), "non_200": sum(s != 200 for s, _ in health)},
        "targets_ms": {"refusal_p50": 50, "refusal_p99": 100, "health_p50": 50, "health_p99": 100},
        "hostile": {kind: {"requests": len(v), "statuses": sorted({st for st, _ in v}),
                           "ms": {"p50": pct([dt * 1e3 for _, dt in v], 50), "p99": pct([dt * 1e3 for _, dt in v], 99)}}
                    for kind, v in hostile.items()},
        "slow_clients": slow,
        "loadavg_at_end": os.getloadavg()[0],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-waiting", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--factor", type=float, default=10.0, help="offered load / saturated completion rate")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of offered load")
    p.add_argument("--calibrate", type=float, default=8.0, help="seconds of the closed-loop rate measurement")
    p.add_argument("--huge-prompts", type=int, default=4, help="clients sending 900 KB prompts in a loop")
    p.add_argument("--amplifiers", type=int, default=2,
                   help="clients asking for n=64 x 200 tokens x 20 logprobs in a loop")
    p.add_argument("--slow-clients", type=int, default=50, help="slowloris connections during the load")
    p.add_argument("--out", default=OUT)
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", args.model, "--port", str(port),
           "--max-waiting", str(args.max_waiting), "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    server = Server("pdserve", cmd, port, os.path.join(os.path.dirname(args.out), "overload-server.log"))
    with server.start(timeout=300):
        result = asyncio.run(run(args, server.base_url))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    r, h = result["refusal_ms"], result["health_ms"]
    print(f"requests {result['requests']}: admitted {result['admitted']}, completed {result['completed']}, "
          f"refused 503 {result['refused_503']} (Retry-After on {result['refused_with_retry_after']}), "
          f"other 5xx {result['other_5xx']}")
    print(f"refusal latency p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms (target < 50)" if r["p99"] is not None
          else "no refusals")
    print(f"/health p50 {h['p50']:.1f} ms, p99 {h['p99']:.1f} ms over {h['probes']} probes (target < 100)")
    for kind, v in result["hostile"].items():
        print(f"{kind}: {v['requests']} requests, statuses {v['statuses']}, p50 {v['ms']['p50']} ms, "
              f"p99 {v['ms']['p99']} ms")
    print(f"slow clients: {result['slow_clients']}; load average at the end {result['loadavg_at_end']:.1f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
