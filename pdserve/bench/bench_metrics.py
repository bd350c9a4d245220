"""The arithmetic of `pdserve bench`: per-request timings in, vLLM's `bench serve` numbers out.

Pure functions over `RequestResult`s, so every definition can be tested on made-up timestamps:

- TTFT: first chunk carrying a token (a non-empty `choices`) minus the send time.
- ITL: the gaps between consecutive such chunks, pooled over all requests.
- E2EL: last such chunk minus the send time.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token.
- Goodput: requests meeting every given SLO, per second of benchmark. As in vLLM, a
  one-token request counts as TPOT 0 there.
- SLO attainment (with --slo-mix): the share of all requests, failed and refused ones
  included as misses, that met the TTFT and TPOT targets they were sent with.

Output token counts are the server's `usage`, never a count of chunks (a chunk may carry
several tokens, or a token may decode to no text). Failed requests count in `completed` +
`failed` and keep their error text, but add nothing to the latency statistics or the token
totals. Empty statistics are 0, as vLLM writes them.
"""
from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (90, 99)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""
    prompt_len: int | None = None   # the server's usage.prompt_tokens (or the id count if it failed)
    output_tokens: int = 0          # the server's usage.completion_tokens
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0            # E2EL
    start_time: float = 0.0         # send time, seconds after the benchmark started
    success: bool = False
    error: str = ""
    kind: str | None = None         # dataset label, e.g. "short" / "long", "turn2"
    cached_tokens: int | None = None   # the server's usage.prompt_tokens_details.cached_tokens, if given
    slo_ms: dict | None = None      # the targets it was sent with (--slo-mix): {"ttft": ms, "tpot": ms}
    text: str = ""                  # the answer as streamed (--save-detailed)

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS pairs with NAME one of {', '.join(SLO_METRICS)}; got {pair!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {pair!r}: an SLO cannot be negative")
    return slos


def parse_slo_mix(specs: list[str] | None) -> dict[str, dict]:
    """["short:2000:150:0", "long:30000:1000:1"] -> {kind: {"ttft": ms, "tpot": ms, "priority": p}};
    KIND "*" is every request without a kind of its own in the list; PRIORITY is optional (0)."""
    mix = {}
    for spec in specs or []:
        parts = spec.split(":")
        if len(parts) not in (3, 4) or not parts[0]:
            raise ValueError(f"--slo-mix takes KIND:TTFT_MS:TPOT_MS[:PRIORITY]; got {spec!r}")
        try:
            ttft, tpot = float(parts[1]), float(parts[2])
            priority = int(parts[3]) if len(parts) == 4 else 0
        except ValueError:
            raise ValueError(f"--slo-mix {spec!r}: targets are milliseconds, the priority an integer") from None
        if not (ttft > 0 and tpot > 0):
            raise ValueError(f"--slo-mix {spec!r}: targets must be > 0 ms")
        mix[parts[0]] = {"ttft": ttft, "tpot": tpot, "priority": priority}
    return mix


def objectives_for(mix: dict[str, dict], kind: str | None) -> dict | None:
    """The --slo-mix entry for a request of this kind (its own, else "*"), or None."""
    return mix.get(kind) if kind in mix else mix.get("*")


def attainment(results: list[RequestResult]) -> dict:
    """Shares of the requests sent with targets that met them: TTFT, TPOT, both."""
    sent = [r for r in results if r.slo_ms]
    if not sent:
        return {}
    ttft = [r.success and r.ttft * 1000 <= r.slo_ms["ttft"] for r in sent]
    tpot = [r.success and (r.tpot or 0.0) * 1000 <= r.slo_ms["tpot"] for r in sent]
    return {"slo_ttft_attainment": sum(ttft) / len(sent), "slo_tpot_attainment": sum(tpot) / len(sent),
            "slo_attainment": sum(a and b for a, b in zip(ttft, tpot)) / len(sent)}


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[name] * 1000 <= limit for name, limit in slos_ms.items())


def stats_ms(name: str, values_s: list[float]) -> dict[str, float]:
    """mean/median/std/p90/p99 of `values_s` (seconds) as `{stat}_{name}_ms` keys (vLLM's names)."""
    v = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * 1000
    out = {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(v.std())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(v, p))   # linear interpolation, as numpy's default
    return out


def latency_stats(results: list[RequestResult]) -> dict[str, float]:
    """TTFT, TPOT, ITL and E2EL statistics over the successful requests."""
    ok = [r for r in results if r.success]
    return {**stats_ms("ttft", [r.ttft for r in ok]),
            **stats_ms("tpot", [r.tpot for r in ok if r.tpot is not None]),
            **stats_ms("itl", [gap for r in ok for gap in r.itl]),
            **stats_ms("e2el", [r.latency for r in ok])}


def cache_stats(ok: list[RequestResult]) -> dict:
    """Prompt tokens the server said it took from its prefix cache, over the requests that said so."""
    told = [r for r in ok if r.cached_tokens is not None]
    prompt = sum(r.prompt_len or 0 for r in told)
    cached = sum(r.cached_tokens for r in told)
    return {"total_cached_tokens": cached if told else None,
            "prefix_cache_hit_rate": cached / prompt if told and prompt else None}


def compute_metrics(results: list[RequestResult], duration: float, slos_ms: dict[str, float] | None = None) -> dict:
    """The result dict under vLLM's key names, plus per-request lists in send order."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": sum(meets_slos(r, slos_ms) for r in ok) / duration if slos_ms else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        **cache_stats(ok),
        **latency_stats(results),
    }
    att = attainment(results)
    if att:   # goodput by the requests' own targets: those meeting both, per second
        out.update(att, slo_goodput=att["slo_attainment"] * sum(1 for r in results if r.slo_ms) / duration)
    kinds = sorted({r.kind for r in results if r.kind is not None})
    for kind in kinds:   # e.g. short_p99_itl_ms: how the short requests fared next to the long ones
        group = [r for r in results if r.kind == kind]
        out[f"{kind}_completed"] = sum(r.success for r in group)
        out.update({f"{kind}_{k}": v for k, v in latency_stats(group).items()})
        out.update({f"{kind}_{k}": v for k, v in attainment(group).items()})
    out.update({
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft if r.success else 0.0 for r in results],
        "itls": [r.itl if r.success else [] for r in results],
        "cached_tokens": [r.cached_tokens for r in results],
        "errors": [r.error for r in results],
        "start_times": [r.start_time for r in results],
    })
    if kinds:
        out["request_kinds"] = [r.kind for r in results]
    return out
