"""`pdserve bench --dataset-name multi-turn`: chats whose history grows, the traffic a prefix cache
is for. Each conversation sends its next user turn only when the previous answer has arrived,
with the whole history in `messages` (earlier questions and the server's own answers), through
/v1/chat/completions. Concurrency and arrival rate apply to conversations; TTFT is reported per
turn, and for the later turns (2 on) together."""
import asyncio
import contextlib
import time

import httpx
import numpy as np

from pdserve.bench.bench_metrics import RequestResult, cache_stats
from pdserve.bench.client import StreamRecorder, arrival_offsets, stream_post


class ChatRecorder(StreamRecorder):
    """A chat stream: the answer's text is kept for the history, and a chunk carrying only the
    assistant role (sent before any token by some servers) is not a token."""

    def takes(self, choice: dict) -> bool:
        delta = choice.get("delta") or {}
        return bool(delta.get("content")) or "role" not in delta or choice.get("finish_reason") is not None

    def text_of(self, choice: dict) -> str:
        return (choice.get("delta") or {}).get("content") or ""


async def conversation(client: httpx.AsyncClient, url: str, body: dict, turns: list[str], output_len: int,
                       headers: dict, t0: float) -> list[RequestResult]:
    """One conversation's turns in order; it stops at a failed turn (the next would lack its history)."""
    messages, results = [], []
    for k, question in enumerate(turns, 1):
        messages.append({"role": "user", "content": question})
        payload = {**body, "messages": list(messages), "max_tokens": output_len}
        rec = await stream_post(client, url, payload, headers, ChatRecorder(time.perf_counter()))
        result = rec.result(None)
        result.start_time, result.kind = rec.sent - t0, f"turn{k}"
        results.append(result)
        if not result.success:
            break
        messages.append({"role": "assistant", "content": rec.text})
    return results


async def benchmark(args, url: str, body: dict, headers: dict, conversations: list[list[str]],
                    warmups: list[list[str]]) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    cap = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout)) as client:
        async def one(turns, t0):
            async with cap:
                return await conversation(client, url, body, turns, args.random_output_len, headers, t0)

        if warmups:
            t0 = time.perf_counter()
            done = [r for rs in await asyncio.gather(*(one(w, t0) for w in warmups)) for r in rs]
            print(f"warmup: {sum(r.success for r in done)} of {len(done)} turns completed")
        offsets = arrival_offsets(len(conversations), args.request_rate, args.burstiness, [args.seed, 2])
        tasks, t0 = [], time.perf_counter()
        for turns, at in zip(conversations, offsets):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(turns, t0)))
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
        duration = time.perf_counter() - t0
    results.sort(key=lambda r: r.start_time)
    return results, duration


def turn_summary(results: list[RequestResult]) -> dict:
    """Per turn: requests, mean prompt tokens, the cache's share of them, TTFT; and the later turns' TTFT."""
    ok = [r for r in results if r.success]
    turns = sorted({int(r.kind[4:]) for r in ok})
    rows = []
    for k in turns:
        group = [r for r in ok if r.kind == f"turn{k}"]
        ttft = np.asarray([r.ttft for r in group]) * 1000
        rows.append({"turn": k, "completed": len(group), "mean_prompt_tokens": float(np.mean([r.prompt_len or 0 for r in group])),
                     "prefix_cache_hit_rate": cache_stats(group)["prefix_cache_hit_rate"],
                     "mean_ttft_ms": float(ttft.mean()), "median_ttft_ms": float(np.median(ttft)),
                     "p90_ttft_ms": float(np.percentile(ttft, 90))})
    later = [r.ttft * 1000 for r in ok if r.kind != "turn1"]
    return {"turns": rows, "later_turns_median_ttft_ms": float(np.median(later)) if later else None}


def print_turns(res: dict) -> None:
    print("{:-^50}".format("Per turn (multi-turn)"))
    print(f"{'turn':>4} {'done':>5} {'prompt tok':>10} {'cached':>7} {'p50 TTFT':>9} {'p90 TTFT':>9} (ms)")
    for row in res["turns"]:
        rate = row["prefix_cache_hit_rate"]
        print(f"{row['turn']:>4} {row['completed']:>5} {row['mean_prompt_tokens']:>10.0f} "
              f"{'n/a' if rate is None else f'{100 * rate:.0f}%':>7} {row['median_ttft_ms']:>9.1f} "
              f"{row['p90_ttft_ms']:>9.1f}")
    if res["later_turns_median_ttft_ms"] is not None:
        print("{:<40} {:<10}".format("Median TTFT of turns 2+ (ms):", f"{res['later_turns_median_ttft_ms']:.2f}"))
