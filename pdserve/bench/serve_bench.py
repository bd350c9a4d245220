"""`pdserve bench`: a load generator for any OpenAI-compatible server (pdserve, vLLM, llama-server).

It streams every request through /v1/completions and measures what a client sees, with the
definitions of vLLM's `bench serve` (see bench_metrics.py), so the numbers and the JSON compare
with vLLM's own. Requests arrive by a seeded Gamma process (`--request-rate`, `--burstiness`),
optionally capped by `--max-concurrency`; a request's clock starts when it is actually sent.

Every request opens its own connection: llama-server drops keep-alive connections idle for
5 s, and a reused connection the server has just closed would fail a request for the client's
reasons, not the server's. Failures (HTTP errors, error events, broken streams, no usage) are
counted and their error text kept, never retried or dropped.
"""
import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import sys
import time
from datetime import datetime

import httpx

from pdserve.bench import bench_metrics, multi_turn
from pdserve.bench.bench_metrics import RequestResult
from pdserve.bench.client import StreamRecorder, arrival_offsets, stream_post
from pdserve.bench.datasets import (BenchRequest, add_dataset_arguments, fetch_token_pool, make_requests,
                                    multi_turn_conversations)


async def send(client: httpx.AsyncClient, url: str, body: dict, req: BenchRequest, headers: dict,
               t0: float, mix: dict | None = None) -> RequestResult:
    payload = {**body, "prompt": req.prompt, "max_tokens": req.output_len}
    objectives = bench_metrics.objectives_for(mix or {}, req.kind)
    if objectives is not None:   # pdserve's (and vLLM's, for priority) request fields
        payload.update(priority=objectives["priority"],
                       slo={"ttft_ms": objectives["ttft"], "tpot_ms": objectives["tpot"]})
    rec = await stream_post(client, url, payload, headers, StreamRecorder(time.perf_counter()))
    result = rec.result(req.prompt_len)
    result.start_time, result.kind = rec.sent - t0, req.kind
    if objectives is not None:
        result.slo_ms = {"ttft": objectives["ttft"], "tpot": objectives["tpot"]}
    return result


async def benchmark(args, url: str, body: dict, headers: dict, requests: list[BenchRequest],
                    warmups: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Send the warmups (all at once, within the concurrency cap), then the measured requests on
    their arrival schedule. Returns the results in send order and the wall time of the run."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)   # a fresh connection per request
    cap = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout)) as client:
        async def one(req: BenchRequest, t0: float, bar) -> RequestResult:
            async with cap:   # the request's clock starts only once it may be sent
                result = await send(client, url, body, req, headers, t0, args.slo_mix)
            if bar is not None:
                bar.update(1)
            return result

        if warmups:
            t0 = time.perf_counter()
            done = await asyncio.gather(*(one(w, t0, None) for w in warmups))
            bad = [r.error for r in done if not r.success]
            print(f"warmup: {len(done) - len(bad)} of {len(done)} requests completed"
                  + (f"; first error: {bad[0]}" if bad else ""))

        offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, [args.seed, 2])
        bar = None
        if not args.disable_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(requests), desc="requests", unit="req")
        tasks = []
        t0 = time.perf_counter()
        for req, at in zip(requests, offsets):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, t0, bar)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return list(results), duration


def print_summary(res: dict, slos: dict) -> None:
    line = "{:<40} {:<10}".format
    print("{:=^50}".format(" Serving Benchmark Result "))
    print(line("Successful requests:", res["completed"]))
    print(line("Failed requests:", res["failed"]))
    if res["max_concurrency"] is not None:
        print(line("Maximum request concurrency:", res["max_concurrency"]))
    print(line("Request rate configured (RPS):", res["request_rate"]))
    print(line("Benchmark duration (s):", f"{res['duration']:.2f}"))
    print(line("Total input tokens:", res["total_input_tokens"]))
    print(line("Total generated tokens:", res["total_output_tokens"]))
    print(line("Request throughput (req/s):", f"{res['request_throughput']:.2f}"))
    if slos:
        print(line("Request goodput (req/s):", f"{res['request_goodput']:.2f}"))
    if "slo_attainment" in res:
        print(line("SLO attainment (TTFT, TPOT, both):", f"{res['slo_ttft_attainment']:.1%}, "
                                                          f"{res['slo_tpot_attainment']:.1%}, "
                                                          f"{res['slo_attainment']:.1%}"))
        print(line("SLO goodput (req/s):", f"{res['slo_goodput']:.2f}"))
    print(line("Output token throughput (tok/s):", f"{res['output_throughput']:.2f}"))
    print(line("Total token throughput (tok/s):", f"{res['total_token_throughput']:.2f}"))
    rate = res.get("prefix_cache_hit_rate")
    print(line("Prefix cache hit rate (usage):", "n/a (no cached_tokens)" if rate is None else f"{100 * rate:.1f}%"))
    if res.get("spec_decode_num_draft_tokens"):
        print(line("Spec decode acceptance rate:", f"{100 * res['spec_decode_acceptance_rate']:.1f}% of "
                                                   f"{res['spec_decode_num_draft_tokens']} drafts"))
    kinds = {k for k in res.get("request_kinds", []) if k and not k.startswith("turn")}   # turns: their own table
    groups = [""] + [f"{k}_" for k in sorted(kinds)]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{:-^50}".format(title))
        for g in groups:
            for stat in ("mean", "median", "p90", "p99"):
                label = f"{g.rstrip('_')} " if g else ""
                print(line(f"{label}{stat.capitalize()} {name.upper()} (ms):", f"{res[f'{g}{stat}_{name}_ms']:.2f}"))
    if res.get("turns"):
        multi_turn.print_turns(res)
    print("=" * 50)
    chunks = sum(len(itl) + 1 for itl, n in zip(res["itls"], res["output_lens"]) if n)
    if chunks < res["total_output_tokens"]:
        print(f"note: {res['total_output_tokens']} tokens arrived in {chunks} chunks; ITL is the gap between "
              "chunks (vLLM's definition), TPOT is per token")
    errors = collections.Counter(e.splitlines()[0] if e else "" for e in res["errors"] if e)
    for err, count in errors.most_common(5):
        print(f"failed x{count}: {err[:300]}")
    if len(errors) > 5:
        print(f"... and {len(errors) - 5} other errors (all in the JSON's `errors`)")


SPEC_COUNTERS = ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total")


def spec_decode_counters(base_url: str, headers: dict) -> dict | None:
    """The server's speculative-decoding counters from /metrics (pdserve's and vLLM's names);
    None where it has no /metrics or no such counters."""
    try:
        r = httpx.get(base_url + "/metrics", headers=headers, timeout=30)
        if r.status_code != 200:
            return None
    except httpx.HTTPError:
        return None
    return parse_spec_counters(r.text)


def parse_spec_counters(text: str) -> dict | None:
    """SPEC_COUNTERS' totals in a Prometheus text page (summed over labels), if all are there."""
    totals = {}
    for row in text.splitlines():
        name, _, rest = row.partition("{")
        name = name.split(" ")[0].split(":", 1)[-1]
        if name in SPEC_COUNTERS and not row.startswith("#"):
            try:
                totals[name] = totals.get(name, 0.0) + float(row.rsplit(" ", 1)[-1])
            except ValueError:
                continue
    return totals if len(totals) == len(SPEC_COUNTERS) else None


def spec_decode_delta(before: dict | None, after: dict | None) -> dict:
    """Drafts and accepted drafts during the run, and the acceptance rate; {} if not known."""
    if before is None or after is None:
        return {}
    drafts, accepted = (int(after[k] - before[k]) for k in SPEC_COUNTERS)
    return {"spec_decode_num_draft_tokens": drafts, "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / drafts if drafts else None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server, without /v1 (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY)")
    add_dataset_arguments(parser)
    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean requests per second; inf sends them all at once (default: %(default)s)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of the gaps between arrivals: 1 = Poisson, < 1 burstier, > 1 more even "
                        "(default: %(default)s)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no cap)")
    g.add_argument("--num-warmups", type=int, default=0,
                   help="unmeasured requests sent first, prompts of the same kind from another seed (default: 0)")
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times (default: 0)")
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos, so outputs run to max_tokens (always on for generated datasets)")
    g.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help="extra request fields, e.g. '{\"cache_prompt\": false}' for llama-server")
    g = parser.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000: a request is good if it meets all")
    g.add_argument("--slo-mix", nargs="+", default=None, metavar="KIND:TTFT_MS:TPOT_MS[:PRIORITY]",
                   help="send each request its kind's objectives (`priority`, `slo`) and report the share that "
                        "met them (slo_attainment); KIND is a dataset label (long-short: short, long) or * for "
                        "all, e.g. short:2000:150:0 long:30000:1000:1")
    g.add_argument("--label", default=None, help="name of this run in the JSON and in plots (e.g. pdserve, vllm)")
    g.add_argument("--output", default=None, metavar="FILE", help="write the result as JSON to FILE")
    g.add_argument("--save-detailed", action="store_true",
                   help="also write each request's answer text, in send order (vLLM's generated_texts)")
    g.add_argument("--plot", default=None, metavar="DIR", help="also write latency CDF plots (PNG) to DIR")
    g.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds a request may wait for any one read before it fails (default: %(default)s)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _setup(args, headers: dict) -> tuple[str, list[BenchRequest], list[BenchRequest]]:
    """The model name, the measured requests and the warmups (may raise: nothing has been sent yet)."""
    for flag, value, least in (("--num-prompts", args.num_prompts, 1), ("--num-warmups", args.num_warmups, 0),
                               ("--max-concurrency", args.max_concurrency, 1)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    model = args.model
    if model is None:
        r = httpx.get(args.base_url + "/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    if args.dataset_name == "multi-turn" and not args.dataset_path:   # conversations, not requests
        n = 100 if args.num_prompts is None else args.num_prompts
        words = args.turn_passage_words
        warmups = multi_turn_conversations(args.num_warmups, args.num_turns, [args.seed, 1], words) if args.num_warmups else []
        return model, multi_turn_conversations(n, args.num_turns, args.seed, words), warmups
    pool = None
    if not args.dataset_path and args.dataset_name != "edit":   # edit: text prompts, no ids
        pool = list(range(args.vocab_size)) if args.vocab_size else fetch_token_pool(args.base_url, headers)
    requests = make_requests(args, args.num_prompts, args.seed, pool)
    # warmups: fresh prompts (another seed), so they warm the server without caching measured prefixes
    warmups = make_requests(args, args.num_warmups, [args.seed, 1], pool) if args.num_warmups else []
    return model, requests, warmups


def run(args: argparse.Namespace) -> int:
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        slos = bench_metrics.parse_goodput(args.goodput)
        args.slo_mix = bench_metrics.parse_slo_mix(args.slo_mix)
        arrival_offsets(1, args.request_rate, args.burstiness, 0)   # validates rate and burstiness
        model, requests, warmups = _setup(args, headers)
    except httpx.HTTPError as e:   # its message does not say where it went
        try:
            where = f" ({e.request.url})"
        except RuntimeError:   # an error httpx made without a request
            where = ""
        what = "cannot reach" if isinstance(e, httpx.RequestError) else "the server at"
        print(f"pdserve bench: error: {what} {args.base_url}{where}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError, KeyError, IndexError) as e:
        print(f"pdserve bench: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    body = {"model": model, "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos or not args.dataset_path:
        body["ignore_eos"] = True
    body.update(args.extra_body or {})
    print(f"{len(requests)} requests ({args.dataset_path or args.dataset_name}) to {args.base_url} model {model}; "
          f"rate {args.request_rate}, burstiness {args.burstiness}, max concurrency {args.max_concurrency}")

    spec_before = spec_decode_counters(args.base_url, headers)
    if args.dataset_name == "multi-turn" and not args.dataset_path:
        results, duration = asyncio.run(multi_turn.benchmark(args, args.base_url + "/v1/chat/completions", body,
                                                             headers, requests, warmups))
    else:
        results, duration = asyncio.run(benchmark(args, args.base_url + "/v1/completions", body, headers,
                                                  requests, warmups))
    res = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "endpoint_type": "openai",
        "label": args.label, "model_id": model, "base_url": args.base_url, "num_prompts": len(requests),
        "dataset_name": "file" if args.dataset_path else args.dataset_name, "dataset_path": args.dataset_path,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
        "num_warmups": args.num_warmups, "goodput_slos_ms": slos or None,
        **bench_metrics.compute_metrics(results, duration, slos),
        **spec_decode_delta(spec_before, spec_decode_counters(args.base_url, headers)),
    }
    if args.save_detailed:
        res["generated_texts"] = [r.text for r in results]
    if args.dataset_name == "multi-turn" and not args.dataset_path:
        res.update(num_turns=args.num_turns, **multi_turn.turn_summary(results))
    print_summary(res, slos)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(res, f)
        print(f"wrote {args.output}")
    if args.plot:
        from pdserve.bench.report import plot_results
        for path in plot_results([(args.label or model, res)], args.plot):
            print(f"wrote {path}")
    return 0 if res["completed"] else 1
