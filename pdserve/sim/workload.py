"""What the simulated clients send: requests with arrival times, prompts (token ids, so the
prefix cache sees what it would) and output lengths.

The synthetic workloads are `pdserve bench`'s own (bench/datasets.py, with its seeds), so a
simulation and a bench run with the same flags (and `pdserve bench --vocab-size V` for the
model's vocabulary V) see the same prompts, lengths and arrival times. A trace is JSON lines of
{"arrival": s, "prompt_len": n, "output_len": m} (optional "kind", "priority", "ttft_ms",
"tpot_ms"), or a `pdserve bench --output` result, replayed at its recorded send times."""
import json
import math
from dataclasses import dataclass

import numpy as np

from pdserve.bench.datasets import make_requests
from pdserve.bench.client import arrival_offsets


@dataclass
class SimRequest:
    arrival: float            # seconds after the start at which the client may send it
    prompt: list[int]
    output_len: int
    kind: str | None = None
    priority: int = 0
    ttft_ms: float | None = None   # its objectives (pdserve's `slo` request field), if any
    tpot_ms: float | None = None


def bench_workload(args, vocab_size: int, num_prompts: int | None = None, rate: float | None = None) -> list[SimRequest]:
    """The requests `pdserve bench` would send with these dataset and load flags."""
    if args.dataset_name == "multi-turn" and not args.dataset_path:
        raise ValueError("multi-turn turns depend on the server's answers: run `pdserve bench --dataset-name "
                         "multi-turn --output FILE` and simulate its requests with --trace FILE")
    n = args.num_prompts if num_prompts is None else num_prompts
    reqs = make_requests(args, n, args.seed, list(range(vocab_size)))
    for r in reqs:
        if r.prompt_len is None:
            raise ValueError("text prompts need a tokenizer: give --dataset-path prompts as token ids, or a --trace")
    rate = args.request_rate if rate is None else rate
    offsets = arrival_offsets(len(reqs), rate, args.burstiness, [args.seed, 2])
    return [SimRequest(at, list(r.prompt), r.output_len, r.kind) for r, at in zip(reqs, offsets)]


def rescale(requests: list[SimRequest], rate: float, burstiness: float, seed) -> list[SimRequest]:
    """The same requests arriving at another rate (the placement search's sweep)."""
    offsets = arrival_offsets(len(requests), rate, burstiness, [seed, 2])
    return [SimRequest(at, r.prompt, r.output_len, r.kind, r.priority, r.ttft_ms, r.tpot_ms)
            for r, at in zip(requests, offsets)]


def _positive_int(row: dict, key: str, where: str) -> int:
    v = row.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{where}: {key} must be an integer >= 1, got {v!r}")
    return v


def load_trace(path: str, vocab_size: int, seed=0) -> list[SimRequest]:
    """Requests from a JSONL trace or a `pdserve bench` result (its input_lens, output_lens and
    start_times; failed requests are left out). Prompt ids are drawn at random from the vocabulary."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(0, vocab_size, size=n).tolist()   # noqa: E731
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and "input_lens" in whole:
        ins, outs, starts = whole["input_lens"], whole.get("output_lens"), whole.get("start_times")
        if not (isinstance(outs, list) and isinstance(starts, list) and len(ins) == len(outs) == len(starts)):
            raise ValueError(f"{path}: a bench result needs input_lens, output_lens and start_times of one length")
        kinds = whole.get("request_kinds") or [None] * len(ins)
        reqs = [SimRequest(float(t), ids(int(i)), int(o), k) for i, o, t, k in zip(ins, outs, starts, kinds)
                if i and o]
    else:
        reqs = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected an object with arrival, prompt_len and output_len")
            arrival = row.get("arrival")
            if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not math.isfinite(arrival) \
                    or arrival < 0:
                raise ValueError(f"{where}: arrival must be seconds >= 0, got {arrival!r}")
            priority = row.get("priority", 0)
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise ValueError(f"{where}: priority must be an integer, got {priority!r}")
            targets = [row.get(k) for k in ("ttft_ms", "tpot_ms")]
            if any(t is not None and (not isinstance(t, (int, float)) or t <= 0) for t in targets):
                raise ValueError(f"{where}: ttft_ms and tpot_ms must be milliseconds > 0")
            reqs.append(SimRequest(float(arrival), ids(_positive_int(row, "prompt_len", where)),
                                   _positive_int(row, "output_len", where), row.get("kind"),
                                   priority, *targets))
    if not reqs:
        raise ValueError(f"{path}: no requests")
    reqs.sort(key=lambda r: r.arrival)
    t0 = reqs[0].arrival
    for r in reqs:
        r.arrival -= t0
    return reqs
