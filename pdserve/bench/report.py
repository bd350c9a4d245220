"""`pdserve report` (and `pdserve bench --plot`): PNG plots of benchmark results and step logs.

Results are the JSON files of `pdserve bench --output` or of vLLM's `bench serve
--save-detailed` (same keys). Per-request latencies are rebuilt from the vLLM keys alone
(`ttfts`, `itls`, `output_lens`, `errors`): E2EL = TTFT + the sum of the ITLs and TPOT = that
sum / (output tokens - 1), exactly as the client measured them.

- latency_cdf.png: CDFs of TTFT, TPOT, ITL and E2EL, one line per result file.
- latency_vs_rate.png: median and p99 TTFT and TPOT against request rate, one line per label.
- throughput_vs_concurrency.png: output tokens/s and requests/s against max concurrency.
- step_timeline.png: per engine step (from `pdserve serve --step-log`), prefill and decode
  tokens stacked, sequences in the batch, and step and forward time.
"""
import argparse
import json
import math
import os

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
IDLE_GAP_S = 0.05   # a longer pause between engine steps is drawn as idle time


def load_results(path: str) -> list[dict]:
    """One JSON object, or one per line (vLLM's --append-result)."""
    with open(path) as f:
        text = f.read()
    try:
        return [json.loads(text)]
    except ValueError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def latency_samples(res: dict, kind: str | None = None) -> dict[str, list[float]] | None:
    """Per-metric samples in ms over the successful requests (of one kind, if given); None
    without per-request data."""
    if not all(k in res for k in ("ttfts", "itls", "output_lens")):
        return None
    errors = res.get("errors") or [""] * len(res["ttfts"])
    kinds = res.get("request_kinds") or [None] * len(res["ttfts"])
    out = {name: [] for name, _ in METRICS}
    for ttft, itl, n, err, k in zip(res["ttfts"], res["itls"], res["output_lens"], errors, kinds):
        if err or not n or (kind is not None and k != kind):
            continue
        out["ttft"].append(ttft * 1e3)
        out["itl"].extend(g * 1e3 for g in itl)
        out["e2el"].append((ttft + sum(itl)) * 1e3)
        if n > 1:
            out["tpot"].append(sum(itl) / (n - 1) * 1e3)
    return out


def _rate(res: dict) -> float:
    r = res.get("request_rate", "inf")
    return float("inf") if r in (None, "inf") else float(r)


def _figure(nrows: int, ncols: int, size: tuple[float, float], **kw):
    import matplotlib
    matplotlib.use("Agg")   # files only, no display
    import matplotlib.pyplot as plt
    return plt, *plt.subplots(nrows, ncols, figsize=size, **kw)


def _save(plt, fig, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdfs(named: list[tuple[str, dict]], out_dir: str) -> str | None:
    samples = []
    for name, res in named:
        # a long-short run draws its short and long requests apart: the head-of-line effect
        kinds = sorted({k for k in res.get("request_kinds") or [] if k})
        parts = [(f"{name} [{k}]", latency_samples(res, k)) for k in kinds] or [(name, latency_samples(res))]
        samples += [(n, s) for n, s in parts if s]
    if not samples:
        return None
    plt, fig, axes = _figure(2, 2, (11, 8))
    for ax, (key, title) in zip(axes.flat, METRICS):
        values = [v for _, s in samples for v in s[key]]
        for name, s in samples:
            if s[key]:
                ax.ecdf(s[key], label=f"{name} (n={len(s[key])})")
        # latencies with a long tail read better on a log axis; zeros cannot go on one
        if values and min(values) > 0 and max(values) / min(values) > 20:
            _log_x(ax)
        for q in (0.5, 0.9, 0.99):
            ax.axhline(q, color="grey", lw=0.5, ls=":")
        ax.set(title=f"{title} CDF", xlabel=f"{title} (ms)", ylim=(0, 1.01),
               ylabel="fraction of " + ("gaps" if key == "itl" else "requests"))
        ax.grid(alpha=0.3)
        if values:
            ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _save(plt, fig, out_dir, "latency_cdf.png")


def _log_x(ax) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))   # 1-2-5 ticks as plain numbers
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _series(named: list[tuple[str, dict]], x_of) -> dict[str, list[tuple[float, dict]]]:
    """Results grouped by label (one line each), sorted by x; results without an x are left out."""
    series: dict[str, list[tuple[float, dict]]] = {}
    for name, res in named:
        x = x_of(res)
        if x is not None and math.isfinite(x):
            series.setdefault(res.get("label") or "unlabelled", []).append((x, res))
    return {label: sorted(points, key=lambda p: p[0]) for label, points in series.items()}


def _plot_sweep(named, x_of, xlabel: str, panels, title: str, out_dir: str, name: str) -> str | None:
    series = _series(named, x_of)
    if not any(len(points) > 1 for points in series.values()):
        return None   # a sweep needs at least two points on one line
    plt, fig, axes = _figure(1, len(panels), (6 * len(panels), 4.5))
    for ax, (ylabel, keys) in zip(axes, panels):
        for i, (label, points) in enumerate(series.items()):
            color = f"C{i}"
            for key, style in keys:
                ys = [res.get(key) for _, res in points]
                ax.plot([x for x, _ in points], ys, style, color=color, marker="o", ms=4,
                        label=f"{label} {key.split('_')[0]}" if len(keys) > 1 else label)
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(plt, fig, out_dir, name)


def plot_latency_vs_rate(named, out_dir: str) -> str | None:
    return _plot_sweep(named, _rate, "request rate (req/s)",
                       [("TTFT (ms)", [("median_ttft_ms", "-"), ("p99_ttft_ms", "--")]),
                        ("TPOT (ms)", [("median_tpot_ms", "-"), ("p99_tpot_ms", "--")])],
                       "Latency against request rate (solid: median, dashed: p99)", out_dir, "latency_vs_rate.png")


def plot_attainment_vs_rate(named, out_dir: str) -> str | None:
    """SLO attainment (`pdserve bench --slo-mix`) and goodput against request rate, one line per label."""
    named = [(n, r) for n, r in named if r.get("slo_attainment") is not None]
    path = _plot_sweep(named, _rate, "request rate (req/s)",
                       [("SLO attainment (both met)", [("slo_attainment", "-")]),
                        ("SLO goodput (req/s)", [("slo_goodput", "-")])],
                       "Requests meeting their own TTFT and TPOT targets", out_dir, "attainment_vs_rate.png")
    return path


def plot_throughput_vs_concurrency(named, out_dir: str) -> str | None:
    return _plot_sweep(named, lambda r: r.get("max_concurrency"), "max concurrency",
                       [("output tokens/s", [("output_throughput", "-")]),
                        ("requests/s", [("request_throughput", "-")])],
                       "Throughput against concurrency", out_dir, "throughput_vs_concurrency.png")


def load_step_log(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _tiles(steps: list[dict], values: list[float]) -> tuple[list[float], list[float]]:
    """(values, edges) for `stairs`: each step spans its wall time up to the next step, so the
    picture tiles real time; only gaps over IDLE_GAP_S (an idle engine) are drawn as zero."""
    t0 = steps[0]["start_time"]
    edges, vals = [], []
    for s, v in zip(steps, values):
        start = s["start_time"] - t0
        if edges and start - edges[-1] > IDLE_GAP_S:
            vals.append(0)   # idle until this step
        elif edges:
            edges.pop()      # busy: the previous step lasts until this one starts
        edges += [start, start + s["duration"]]
        vals.append(v)
    return vals, edges


def plot_step_timeline(path: str, out_dir: str, name: str = "step_timeline.png") -> str:
    steps = sorted(load_step_log(path), key=lambda s: s["start_time"])
    if not steps:
        raise ValueError(f"{path} has no steps")
    prefill = [s["num_prefill_tokens"] for s in steps]
    total = [s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps]
    plt, fig, (ax_tok, ax_seq, ax_time) = _figure(3, 1, (12, 8), sharex=True,
                                                  gridspec_kw={"height_ratios": [3, 1.2, 2]})
    ax_tok.stairs(*_tiles(steps, prefill), fill=True, color="C1", label="prefill tokens")
    top, edges = _tiles(steps, total)
    ax_tok.stairs(top, edges, baseline=_tiles(steps, prefill)[0], fill=True, color="C0", label="decode tokens")
    t0 = steps[0]["start_time"]
    preempted = [(s["start_time"] - t0, n) for s, n in zip(steps, total) if s.get("num_preemptions")]
    if preempted:
        ax_tok.plot(*zip(*preempted), "rv", ms=5, label="step with preemptions")
    ax_tok.set(ylabel="tokens in step")
    ax_tok.legend(fontsize=8, loc="upper right")
    ax_seq.stairs(*_tiles(steps, [s["num_seqs"] for s in steps]), color="C2")
    ax_seq.set(ylabel="sequences")
    ax_time.stairs(*_tiles(steps, [s["duration"] * 1e3 for s in steps]), fill=True, color="C3", alpha=0.35,
                   label="step time")
    ax_time.stairs(*_tiles(steps, [s["forward_time"] * 1e3 for s in steps]), color="C4", lw=0.8,
                   label="forward time")
    ax_time.set(ylabel="ms per step", xlabel="time since first step (s)", ylim=(0, None))
    ax_time.legend(fontsize=8, loc="upper right")
    for ax in (ax_tok, ax_seq, ax_time):
        ax.grid(alpha=0.3)
    busy = sum(s["duration"] for s in steps)
    fig.suptitle(f"{os.path.basename(path)}: {len(steps)} steps, {sum(prefill)} prefill + "
                 f"{sum(total) - sum(prefill)} decode tokens, mean step {busy / len(steps) * 1e3:.1f} ms")
    fig.tight_layout()
    return _save(plt, fig, out_dir, name)


def plot_results(named: list[tuple[str, dict]], out_dir: str) -> list[str]:
    """Every results plot that the given (name, result) pairs have data for; returns the paths."""
    plots = (plot_latency_cdfs, plot_latency_vs_rate, plot_attainment_vs_rate, plot_throughput_vs_concurrency)
    return [p for plot in plots if (p := plot(named, out_dir))]


def _names(paths: list[str], results: list[list[dict]]) -> list[tuple[str, dict]]:
    """(name, result) pairs: the label, made unique with the file name where labels repeat."""
    flat = [(os.path.splitext(os.path.basename(p))[0], r) for p, rs in zip(paths, results) for r in rs]
    labels = [r.get("label") or stem for stem, r in flat]
    return [(label if labels.count(label) == 1 else f"{label} ({stem})", r)
            for label, (stem, r) in zip(labels, flat)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="*", metavar="RESULT.json",
                        help="result files of `pdserve bench --output` (or vLLM's bench serve --save-detailed)")
    parser.add_argument("--step-log", action="append", default=[], metavar="FILE",
                        help="a step log of `pdserve serve --step-log` to draw as a timeline (repeatable)")
    parser.add_argument("--out", default="bench-plots", metavar="DIR", help="where the PNGs go (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if not args.results and not args.step_log:
        print("pdserve report: error: give result files and/or --step-log", flush=True)
        return 2
    written = plot_results(_names(args.results, [load_results(p) for p in args.results]), args.out)
    if args.results and not written:
        print("pdserve report: no plots: the results have no per-request data (ttfts, itls, output_lens) "
              "and no sweep of rate or concurrency")
    for log in args.step_log:
        stem = os.path.splitext(os.path.basename(log))[0]
        name = "step_timeline.png" if len(args.step_log) == 1 else f"step_timeline_{stem}.png"
        written.append(plot_step_timeline(log, args.out, name))
    for path in written:
        print(f"wrote {path}")
    return 0
