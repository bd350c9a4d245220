"""A simulation's numbers, by `pdserve bench`'s own definitions (bench/bench_metrics.py:
TTFT, TPOT, throughput, goodput), as a dict and as a plain table."""
from pdserve.bench import bench_metrics
from pdserve.sim.cluster import SimResult

# (key, column title, format) of the summary table
COLUMNS = (("placement", "placement", "{}"), ("machines", "machines", "{}"), ("rate", "rate", "{}"),
           ("mean_ttft_ms", "TTFT mean", "{:.1f}"), ("median_ttft_ms", "p50", "{:.1f}"),
           ("p99_ttft_ms", "p99", "{:.1f}"), ("mean_tpot_ms", "TPOT mean", "{:.2f}"),
           ("p99_tpot_ms", "p99", "{:.2f}"), ("output_throughput", "out tok/s", "{:.1f}"),
           ("request_goodput", "goodput req/s", "{:.2f}"), ("failed", "failed", "{}"))


def summarize(result: SimResult, slos_ms: dict[str, float] | None) -> dict:
    """bench's metrics of the simulated requests (without the per-request lists), plus the share
    of requests meeting every SLO (`slo_attainment`, failed ones as misses)."""
    m = bench_metrics.compute_metrics(result.results, max(result.duration, 1e-9), slos_ms or None)
    for key in ("input_lens", "output_lens", "ttfts", "itls", "cached_tokens", "errors", "start_times",
                "request_kinds"):
        m.pop(key, None)
    m["p50_ttft_ms"] = m["median_ttft_ms"]
    if slos_ms:
        good = sum(bench_metrics.meets_slos(r, slos_ms) for r in result.results)
        m["goodput_attainment"] = good / len(result.results) if result.results else 0.0
    errors = [r.error for r in result.results if r.error]
    if errors:
        m["first_error"] = errors[0]
    m["replicas"] = result.replicas
    return m


def table(rows: list[dict], title: str = "") -> str:
    cols = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    cells = [[title for _, title, _ in cols]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else fmt.format(r[k]) for k, _, fmt in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = [title] if title else []
    for j, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
