"""Soak: thousands of mixed requests against one live server, then check that nothing was lost.

One command, loopback only, bounded in count (--num-requests) and time (--timeout per request):

    python -m benchmarks.soak                       # 2000 requests on a tiny llama (~10 min on 2 cores)
    python -m benchmarks.soak --num-requests 200    # the size tests/reliability/test_soak.py runs

It starts `pdserve serve` (engine backend) on a tiny random checkpoint with a KV cache of
--num-kv-blocks blocks, small enough that the scheduler preempts many times, warms it up, then
fires the requests at --concurrency: /v1/completions and /v1/chat/completions, streamed and not,
prompts of 1 to ~400 tokens and outputs of 1 to 200, greedy or sampled with a seed; about
--abort-frac of the clients disconnect at a random point. Then it checks:

- every request its client did not abort came back 200 with a finish reason on every choice;
- the engine finished every engine request it admitted (request_success_total, none as "error");
- every completed output equals the same request sent again alone (all, or --verify-sample),
  except where, alone, its two best tokens were within NEAR_TIE logprob of each other before the
  point of difference: there fp32 rounding, which depends on the batch, may flip the choice
  (reported as near_tie_divergences);
- once idle: no request running or waiting, no KV block in use;
- the server's RSS is within 5% of its level after warm-up;
- all through the load, hostile clients (hostile.py) get their 4xx, on a connection that stays
  open, and slow clients (4 at a time) are cut off.

The summary is printed and written as JSON (default benchmarks/results/reliability/soak.json).
`run_soak(model, ...)` is the same run as a function returning the summary dict.
"""
import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
from benchmarks.hostile import CASES as HOSTILE_CASES, check_refusals, slow_clients
from pdserve.bench.servers import Server, free_port, scrape_metrics

DEFAULT_OUT = os.path.join(HERE, "results", "reliability", "soak.json")
RSS_TOLERANCE = 0.05
NEAR_TIE = 1e-4   # logprob gap between the two best tokens below which batch-dependent rounding may flip a choice


@dataclass
class Job:
    idx: int
    path: str                  # /v1/completions or /v1/chat/completions
    body: dict
    abort_after: float | None  # streamed: close after this many events; plain: after this many seconds


@dataclass
class Outcome:
    status: int | None = None
    texts: dict[int, str] = field(default_factory=dict)            # choice index -> text
    finish: dict[int, str | None] = field(default_factory=dict)    # choice index -> finish_reason
    aborted: bool = False      # the client left before the response was complete
    error: str | None = None


# ---- the workload

def make_jobs(num: int, tokenizer, capacity: int, seed: int, abort_frac: float) -> list[Job]:
    """A reproducible mix. Every request fits the KV cache alone (prompt + max_tokens < capacity)."""
    from tools.make_model import corpus_texts
    rng = random.Random(seed)
    corpus = tokenizer.encode(" ".join(corpus_texts())[:60000], add_special_tokens=False)
    jobs = []
    for i in range(num):
        prompt_len = rng.choice([rng.randint(1, 16), rng.randint(16, 96), rng.randint(96, 400)])
        max_tokens = rng.choice([rng.randint(1, 8), rng.randint(8, 64), rng.randint(64, 200)])
        max_tokens = max(1, min(max_tokens, capacity - prompt_len - 48))   # room for the chat template
        start = rng.randrange(len(corpus) - prompt_len)
        ids = corpus[start:start + prompt_len]
        body = {"max_tokens": max_tokens, "stream": rng.random() < 0.6, "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.4:   # sampled with a seed; the rest greedy
            body.update(temperature=round(rng.uniform(0.5, 1.5), 2), seed=rng.randrange(1 << 31))
            if rng.random() < 0.5:
                body["top_p"] = round(rng.uniform(0.5, 1.0), 2)
            if rng.random() < 0.3:
                body["top_k"] = rng.randint(1, 50)
        else:
            body["temperature"] = 0
        if rng.random() < 0.1:
            body["n"] = 2
        stop = tokenizer.decode(corpus[start + prompt_len:start + prompt_len + 1])
        if rng.random() < 0.1 and stop.strip():   # exercises the stream's hold-back of a possible stop string
            body["stop"] = [stop]
        if rng.random() < 0.5:
            path = "/v1/completions"
            body["prompt"] = ids if rng.random() < 0.5 else tokenizer.decode(ids)
        else:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": tokenizer.decode(ids)}]
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        abort_after = None
        if rng.random() < abort_frac:
            abort_after = rng.randint(0, max_tokens) if body["stream"] else rng.uniform(0.05, 2.0)
        jobs.append(Job(i, path, body, abort_after))
    return jobs


# ---- the client side

async def send(client: httpx.AsyncClient, job: Job, timeout: float) -> Outcome:
    out = Outcome()
    try:
        if job.body["stream"]:
            await asyncio.wait_for(_stream(client, job, out), timeout)
        elif job.abort_after is not None:
            try:
                await asyncio.wait_for(_plain(client, job, out), job.abort_after)
            except asyncio.TimeoutError:   # the cancelled request closed its connection
                out.aborted = True
        else:
            await asyncio.wait_for(_plain(client, job, out), timeout)
    except asyncio.TimeoutError:
        out.error = f"no complete response within {timeout} s"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def _plain(client, job, out):
    r = await client.post(job.path, json=job.body)
    out.status = r.status_code
    if r.status_code != 200:
        out.error = f"HTTP {r.status_code}: {r.text[:300]}"
        return
    for c in r.json()["choices"]:
        out.texts[c["index"]] = c["text"] if "text" in c else c["message"]["content"]
        out.finish[c["index"]] = c["finish_reason"]


async def _stream(client, job, out):
    events = 0
    async with client.stream("POST", job.path, json=job.body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = f"error event: {chunk['error']}"
                return
            for c in chunk["choices"]:
                i = c["index"]
                text = c["text"] if "text" in c else c["delta"].get("content") or ""
                out.texts[i] = out.texts.get(i, "") + text
                if c.get("finish_reason"):
                    out.finish[i] = c["finish_reason"]
            events += 1
            if job.abort_after is not None and events >= job.abort_after:
                out.aborted = True   # leaving the block closes the connection mid-stream
                return
    out.error = out.error or "stream ended without [DONE]"


async def run_jobs(base_url: str, jobs: list[Job], concurrency: int, timeout: float) -> list[Outcome]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        async def one(job):
            async with sem:
                return await send(client, job, timeout)
        return await asyncio.gather(*(one(j) for j in jobs))


def solo_body(job: Job) -> dict:
    """The same request, not streamed, as the reference: its text must equal the streamed one."""
    body = {k: v for k, v in job.body.items() if k != "stream_options"}
    return {**body, "stream": False}


async def run_solo(base_url: str, jobs: list[Job], timeout: float) -> list[Outcome]:
    """One request at a time: each runs alone in the engine."""
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        return [await send(client, Job(j.idx, j.path, solo_body(j), None), timeout) for j in jobs]


async def top2_logprobs(base_url: str, job: Job, timeout: float) -> dict[int, list[tuple[str, list[float]]]]:
    """The request alone again, with logprobs: per choice, each generated token's text and its
    two best logprobs (best first)."""
    body = solo_body(job)
    body.update({"logprobs": 2} if job.path == "/v1/completions" else {"logprobs": True, "top_logprobs": 2})
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        r = await client.post(job.path, json=body)
    r.raise_for_status()
    out = {}
    for c in r.json()["choices"]:
        if job.path == "/v1/completions":
            lp = c["logprobs"]
            out[c["index"]] = [(t, sorted(top.values(), reverse=True)) for t, top in zip(lp["tokens"], lp["top_logprobs"])]
        else:
            out[c["index"]] = [(e["token"], [t["logprob"] for t in e["top_logprobs"]]) for e in c["logprobs"]["content"]]
    return out


def near_tie_before(tokens: list[tuple[str, list[float]]], chars: int, tol: float = NEAR_TIE) -> bool:
    """Whether a token starting within the first `chars` characters of the text had its best two
    candidates within `tol` of each other: there float rounding that depends on the batch may flip
    the greedy (or seeded) choice. Token texts only approximate the offsets (a token may hold part
    of a character), so the search runs a few tokens past `chars`."""
    offset, slack = 0, 4
    for text, top in tokens:
        if offset > chars:
            slack -= 1
            if slack < 0:
                return False
        if len(top) >= 2 and top[0] - top[1] < tol:
            return True
        offset += len(text)
    return False


def common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- the server side

def successes(m: dict[str, float]) -> dict[str, float]:
    """request_success_total by finish reason."""
    out = {}
    for k, v in m.items():
        hit = re.fullmatch(r'pdserve:request_success_total\{finished_reason="(\w+)"\}', k)
        if hit:
            out[hit.group(1)] = v
    return out


def wait_idle(base_url: str, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds a KV block; the last samples either way."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape_metrics(base_url)
        if is_idle(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def is_idle(m: dict[str, float]) -> bool:
    return (m["pdserve:num_requests_running"] == 0 and m["pdserve:num_requests_waiting"] == 0
            and m["pdserve:kv_cache_usage_perc"] == 0)


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def settled_rss(pid: int, seconds: float = 2.0) -> int:
    """RSS once idle, after a short pause so freed memory has been handed back."""
    time.sleep(seconds)
    return rss_kb(pid)


# ---- the run

def run_soak(model: str | None = None, num_requests: int = 2000, concurrency: int = 64, num_kv_blocks: int = 40,
             block_size: int = 16, abort_frac: float = 0.2, verify_sample: int | None = None, seed: int = 0,
             timeout: float = 300.0, log_dir: str | None = None) -> dict:
    """Start a server, soak it, check every guarantee; the summary (with "ok" and "failures")."""
    from pdserve.tokenizer import Tokenizer
    from tools.make_model import make_model
    t_start = time.monotonic()
    tmp = log_dir or tempfile.mkdtemp(prefix="pdserve-soak-")   # the server log, and the model if built
    if model is None:
        model = make_model(os.path.join(tmp, "tiny-llama"), "llama")
    tokenizer = Tokenizer.from_dir(model)
    capacity = num_kv_blocks * block_size
    warm = make_jobs(max(50, num_requests // 20), tokenizer, capacity, seed + 1, abort_frac)
    jobs = make_jobs(num_requests, tokenizer, capacity, seed, abort_frac)
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model, "--port", str(port),
           "--num-kv-blocks", str(num_kv_blocks), "--block-size", str(block_size),
           "--max-num-seqs", str(concurrency), "--max-waiting", str(4 * concurrency), "--log-level", "warning"]
    server = Server("soak", cmd, port, os.path.join(tmp, "soak-server.log")).start(timeout=120)
    try:
        pid = server.proc.pid
        asyncio.run(run_jobs(server.base_url, warm, concurrency, timeout))
        wait_idle(server.base_url)
        rss_warm = settled_rss(pid)
        before = scrape_metrics(server.base_url)

        t0 = time.monotonic()
        # hostile clients all through the load: refused requests and slow connections (hostile.py)
        stop, hostile = threading.Event(), {"rounds": 0, "problems": [], "slow": []}

        def hostile_loop():
            while not stop.is_set():
                hostile["problems"] += check_refusals(server.base_url)["problems"]
                hostile["slow"].append(asyncio.run(slow_clients(server.base_url, 4, give_up=60.0)))
                hostile["rounds"] += 1
        hostile_thread = threading.Thread(target=hostile_loop, daemon=True)
        hostile_thread.start()
        outcomes = asyncio.run(run_jobs(server.base_url, jobs, concurrency, timeout))
        load_s = time.monotonic() - t0
        stop.set()
        hostile_thread.join()
        idle = wait_idle(server.base_url)
        rss_after_load = settled_rss(pid)

        done = [(j, o) for j, o in zip(jobs, outcomes) if not o.aborted and o.error is None]
        rng = random.Random(seed)
        checked = done if verify_sample is None or verify_sample >= len(done) else rng.sample(done, verify_sample)
        t0 = time.monotonic()
        solos = asyncio.run(run_solo(server.base_url, [j for j, _ in checked], timeout))
        verify_s = time.monotonic() - t0
        # A difference is excused only where the request, alone, had a near-tie before it.
        ties = {}
        for (j, o), solo in zip(checked, solos):
            if solo.error is None and solo.texts != o.texts:
                top2 = asyncio.run(top2_logprobs(server.base_url, j, timeout))
                ties[j.idx] = all(near_tie_before(top2[i], common_prefix(o.texts.get(i, ""), solo.texts[i]))
                                  for i in solo.texts if o.texts.get(i) != solo.texts[i])
        final = wait_idle(server.base_url)
        rss_end = settled_rss(pid)
        log = open(server.log_path, encoding="utf-8", errors="replace").read()
    finally:
        server.stop()
    return summarize(locals())


def summarize(r: dict) -> dict:
    """The checks and the summary, from run_soak's local variables (what was sent, seen and measured)."""
    jobs, outcomes, before, idle = r["jobs"], r["outcomes"], r["before"], r["idle"]
    failures = []
    errors = [(j.idx, o.error) for j, o in zip(jobs, outcomes) if o.error is not None]
    if errors:
        failures.append(f"{len(errors)} requests failed, e.g. {errors[:3]}")
    unfinished = [j.idx for j, o in r["done"] if sorted(o.finish) != list(range(j.body.get("n", 1)))
                  or any(f not in ("stop", "length") for f in o.finish.values())]
    if unfinished:
        failures.append(f"{len(unfinished)} completed requests lack a finish reason: {unfinished[:10]}")
    mismatches, near_ties = [], []
    for (j, o), solo in zip(r["checked"], r["solos"]):
        if solo.error is not None or solo.texts != o.texts or solo.finish != o.finish:
            diff = {"idx": j.idx, "body": {k: v for k, v in j.body.items() if k not in ("prompt", "messages")},
                    "load": [o.texts, o.finish], "solo": [solo.texts, solo.finish, solo.error]}
            (near_ties if r["ties"].get(j.idx) else mismatches).append(diff)
    if mismatches:
        failures.append(f"{len(mismatches)} outputs differ from the same request run alone")
    # engine side: every admitted engine request finished (abort counts), none with "error". A plain
    # request whose client left before the answer may or may not have been admitted.
    reasons = {k: v - successes(before).get(k, 0) for k, v in successes(idle).items()}
    admitted = sum(j.body.get("n", 1) for j, o in zip(jobs, outcomes) if o.status == 200)
    maybe = sum(j.body.get("n", 1) for j, o in zip(jobs, outcomes) if o.status is None and o.aborted)
    if not admitted <= sum(reasons.values()) <= admitted + maybe or reasons.get("error", 0):
        failures.append(f"engine requests admitted {admitted} (+ up to {maybe}), finished by reason {reasons}")
    leaks = {name: m for name, m in (("after load", idle), ("at the end", r["final"])) if not is_idle(m)}
    if leaks:
        failures.append("not idle: " + "; ".join(
            f"{name}: running {m['pdserve:num_requests_running']}, waiting {m['pdserve:num_requests_waiting']}, "
            f"kv usage {m['pdserve:kv_cache_usage_perc']}" for name, m in leaks.items()))
    preemptions = idle["pdserve:num_preemptions_total"] - before["pdserve:num_preemptions_total"]
    if preemptions < len(jobs) // 20:
        failures.append(f"only {preemptions:.0f} preemptions: the KV cache is too large to test them")
    rss_change = r["rss_end"] / r["rss_warm"] - 1
    if abs(rss_change) > RSS_TOLERANCE:
        failures.append(f"RSS {r['rss_warm']} kB after warm-up, {r['rss_end']} kB at the end ({rss_change:+.1%})")
    hostile = r["hostile"]
    if hostile["problems"] or any(s["still_open"] for s in hostile["slow"]):
        failures.append(f"hostile clients: {hostile['problems'][:3]}, slow clients never cut off: "
                        f"{sum(s['still_open'] for s in hostile['slow'])}")
    if "Traceback" in r["log"]:
        failures.append("the server log has a traceback: " + r["log"][r["log"].index("Traceback"):][:1500])
    aborted = sum(o.aborted for o in outcomes)
    return {
        "ok": not failures, "failures": failures,
        "requests": len(jobs), "concurrency": r["concurrency"], "num_kv_blocks": r["num_kv_blocks"],
        "block_size": r["block_size"], "client_aborts_planned": sum(j.abort_after is not None for j in jobs),
        "client_aborts": aborted, "completed": len(r["done"]), "errors": len(errors),
        "unfinished": len(unfinished), "streamed": sum(j.body["stream"] for j in jobs),
        "chat": sum(j.path.endswith("chat/completions") for j in jobs),
        "seeded": sum("seed" in j.body for j in jobs), "greedy": sum(j.body["temperature"] == 0 for j in jobs),
        "engine_requests_admitted": admitted, "engine_finished_by_reason": reasons,
        "preemptions": preemptions, "verified": len(r["checked"]), "mismatches": len(mismatches),
        "near_tie_divergences": len(near_ties), "mismatch_examples": mismatches[:5],
        "near_tie_examples": near_ties[:5], "kv_leak": bool(leaks),
        "hostile": {"rounds": hostile["rounds"], "refusal_cases": hostile["rounds"] * len(HOSTILE_CASES),
                    "problems": hostile["problems"][:5],
                    "slow_clients": sum(s["clients"] for s in hostile["slow"]),
                    "slow_clients_never_cut": sum(s["still_open"] for s in hostile["slow"])},
        "idle_after_load": {k.split(":")[1]: idle[k] for k in
                            ("pdserve:num_requests_running", "pdserve:num_requests_waiting",
                             "pdserve:kv_cache_usage_perc")},
        "rss_kb": {"after_warmup": r["rss_warm"], "after_load": r["rss_after_load"], "end": r["rss_end"],
                   "change_pct": round(100 * rss_change, 2)},
        "seconds": {"load": round(r["load_s"], 1), "verify": round(r["verify_s"], 1),
                    "total": round(time.monotonic() - r["t_start"], 1)},
        "generated_tokens": idle.get("pdserve:generation_tokens_total", 0)
        - before.get("pdserve:generation_tokens_total", 0),
        "loadavg_at_end": os.getloadavg()[0],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: a tiny llama built into a temp dir)")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=40, help="KV blocks of 16 tokens (default: 40 = 640 tokens)")
    p.add_argument("--abort-frac", type=float, default=0.2, help="fraction of clients that disconnect early")
    p.add_argument("--verify-sample", type=int, default=None,
                   help="re-run only this many completed requests alone (default: all of them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request before it counts as hung")
    p.add_argument("--out", default=DEFAULT_OUT)
    a = p.parse_args(argv)
    summary = run_soak(a.model, a.num_requests, a.concurrency, a.num_kv_blocks, abort_frac=a.abort_frac,
                       verify_sample=a.verify_sample, seed=a.seed, timeout=a.timeout)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if not k.endswith("_examples")}, indent=1))
    print(f"wrote {a.out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
