"""What `pdserve roofline` says about its measured points: one record per point (its roof and the
fraction of it reached), short findings computed from them, the table and the roofline plot."""
import statistics

import torch

from pdserve.bench.step_cost import StepCost

COLORS = {"prefill": "tab:blue", "decode": "tab:orange", "nocache": "tab:red"}


def record(phase: str, batch: int, context: int, cost: StepCost, logit_rows: int, forward: list[float],
           execute: list[float], peak: float, bandwidth: float) -> dict:
    t = statistics.median(forward)
    tokens = batch if phase == "decode" else context
    ai = cost.flops / cost.bytes
    roof = min(peak, ai * bandwidth)
    return dict(
        phase=phase, batch=batch, context=context, tokens=tokens, output_tokens=logit_rows,
        time_s=t, times_s=forward, execute_s=statistics.median(execute),
        flops=cost.flops, flops_linear=cost.flops_linear, flops_attn=cost.flops_attn,
        flops_lm_head=cost.flops_lm_head, bytes=cost.bytes, bytes_weights=cost.bytes_weights,
        bytes_kv_read=cost.bytes_kv_read, bytes_kv_write=cost.bytes_kv_write,
        flops_per_token=cost.flops / tokens,
        body_flops_per_token=(cost.flops_linear + cost.flops_attn) / tokens,
        weight_bytes_per_token=cost.bytes_weights / tokens, kv_read_bytes_per_token=cost.bytes_kv_read / tokens,
        arithmetic_intensity=ai, achieved_flops=cost.flops / t, achieved_bandwidth=cost.bytes / t,
        roof_flops=roof, bound="compute" if ai * bandwidth >= peak else "memory",
        fraction_of_roof=cost.flops / t / roof, time_per_output_token_s=t / logit_rows)


def find(recs: list[dict], phase: str, batch: int | None = None, context: int | None = None) -> list[dict]:
    return [r for r in recs if r["phase"] == phase and batch in (None, r["batch"]) and context in (None, r["context"])]


def findings(recs: list[dict], peak: float, bandwidth: float, dtype: str, overhead: dict | None,
             read: dict | None = None, overhead_final: dict | None = None, peak_rounds: dict | None = None) -> list[str]:
    """Short statements computed from the measured points (each one only if its points exist)."""
    def get(phase, batch, context):
        return next(iter(find(recs, phase, batch, context)), None)

    out, ridge = [], peak / bandwidth
    pre, dec = find(recs, "prefill"), find(recs, "decode")
    batches, contexts = sorted({r["batch"] for r in dec}), sorted({r["context"] for r in dec})
    ends = sorted({contexts[0], contexts[-1]}) if contexts else []
    common = sorted({r["context"] for r in pre} & {r["context"] for r in find(recs, "decode", 1)})
    if common:
        n = common[-1]
        p, d = get("prefill", 1, n), get("decode", 1, n)
        out.append(f"FLOPs per token, layers + attention: prefill {n} {p['body_flops_per_token'] / 1e6:.1f} M, "
                   f"decode at context {n} {d['body_flops_per_token'] / 1e6:.1f} M (ratio "
                   f"{d['body_flops_per_token'] / p['body_flops_per_token']:.2f}); the lm_head adds "
                   f"{d['flops_lm_head'] / 1e6:.1f} M per sampled token (every decode token, one per prompt)")
    if pre:
        p = max(pre, key=lambda r: r["context"])
        out.append(f"prefill {p['context']}: {p['achieved_flops'] / 1e9:.1f} GFLOP/s = "
                   f"{100 * p['achieved_flops'] / peak:.0f}% of the {dtype} GEMM peak; AI "
                   f"{p['arithmetic_intensity']:.0f} FLOP/B vs ridge {ridge:.1f}: {p['bound']}-bound")
    if dec:
        d = min(dec, key=lambda r: (r["batch"], r["context"]))
        out.append(f"decode batch {d['batch']}, context {d['context']}: AI {d['arithmetic_intensity']:.2f} FLOP/B "
                   f"vs ridge {ridge:.1f}: {d['bound']}-bound; moves {d['achieved_bandwidth'] / 1e9:.1f} GB/s = "
                   f"{100 * d['achieved_bandwidth'] / bandwidth:.0f}% of the measured bandwidth")
    for c in ends if len(batches) > 1 else []:
        b0, b1 = batches[0], batches[-1]
        lo, hi = get("decode", b0, c), get("decode", b1, c)
        if lo and hi:
            kv_share = 100 * (hi["bytes_kv_read"] + hi["bytes_kv_write"]) / hi["bytes"]
            out.append(f"decode context {c}, batch {b0} -> {b1}: weight bytes per token "
                       f"/{lo['weight_bytes_per_token'] / hi['weight_bytes_per_token']:.0f}, KV read per token "
                       f"{lo['kv_read_bytes_per_token'] / 1e6:.2f} -> {hi['kv_read_bytes_per_token'] / 1e6:.2f} MB "
                       f"(KV is {kv_share:.0f}% of the bytes at batch {b1}); time per step "
                       f"x{hi['time_s'] / lo['time_s']:.1f}, tokens/s x{(b1 / hi['time_s']) / (b0 / lo['time_s']):.1f}")
    if len(ends) == 2:
        # what the longer context costs at the largest batch: the effective rate of its extra KV read
        b = batches[-1]
        short, long = get("decode", b, ends[0]), get("decode", b, ends[1])
        if short and long and long["time_s"] > short["time_s"]:   # noise can invert two cheap steps
            extra, dt = long["bytes_kv_read"] - short["bytes_kv_read"], long["time_s"] - short["time_s"]
            out.append(f"decode batch {b}, context {ends[0]} -> {ends[1]}: +{extra / 1e9:.2f} GB of KV read per "
                       f"step cost +{dt * 1e3:.0f} ms, i.e. {extra / dt / 1e9:.2f} GB/s (measured bandwidth "
                       f"{bandwidth / 1e9:.1f} GB/s)")
    for c in ends:
        rates = [f"batch {r['batch']} {r['batch'] / r['time_s']:.1f}" for r in find(dec, "decode", context=c)]
        out.append(f"decode tokens/s at context {c}: " + ", ".join(rates))
    ratios = [(r["context"], r["time_s"] / d["time_s"]) for r in find(recs, "nocache")
              if (d := get("decode", 1, r["context"]))]
    if ratios:
        out.append("nocache decode (re-runs the sequence per token) vs cached decode, batch 1: " +
                   ", ".join(f"context {c}: x{x:.1f}" for c, x in ratios))
    for b, r in (read or {}).get("batches", {}).items():
        out.append(f"decode batch {b}, context {read['context']}, side by side with a read probe ({read['rounds']} "
                   f"rounds, probe {min(read['bandwidth']) / 1e9:.1f}-{max(read['bandwidth']) / 1e9:.1f} GB/s): "
                   f"{r['ratio_median']:.2f}x the time to read its {r['bytes'] / 1e6:.0f} MB (rounds "
                   f"{min(r['ratio']):.2f}-{max(r['ratio']):.2f}; step {min(r['step_s']) * 1e3:.1f}-"
                   f"{max(r['step_s']) * 1e3:.1f} ms)")
    for name, r in (peak_rounds or {}).get("steps", {}).items():
        ps = peak_rounds["peak_flops"]
        out.append(f"{name}, side by side with a GEMM probe ({peak_rounds['rounds']} rounds, probe "
                   f"{min(ps) / 1e9:.1f}-{max(ps) / 1e9:.1f} GFLOP/s): {100 * r['fraction_median']:.0f}% of the "
                   f"probed peak (rounds {100 * min(r['fraction']):.0f}-{100 * max(r['fraction']):.0f}%; step "
                   f"{min(r['step_s']) * 1e3:.1f}-{max(r['step_s']) * 1e3:.1f} ms)")
    if overhead:
        o = overhead
        out.append(f"engine overhead, decode batch {o['batch']} at context {o['context']} (median of "
                   f"{o['steps']} steps): engine.step() {o['step_ms']:.2f} ms, forward "
                   f"{o['forward_ms']:.2f} ms, overhead {o['overhead_ms']:.2f} ms ({o['overhead_pct']:.1f}%)")
    if overhead_final:
        o = overhead_final
        out.append(f"the same for final-only requests (no output per step: LLM.generate, non-streamed "
                   f"responses): overhead {o['overhead_ms']:.2f} ms ({o['overhead_pct']:.1f}%)")
    return out


def experts_finding(cost, reads: list[dict]) -> str:
    """What a mixture of experts' weight-read line counts: attention, dense and shared weights every
    step, and the routed experts each measured step selected, counted from its routers (beside the
    expectation under uniform routing)."""
    per_layer = cost.moe_layers
    shown = [r for r in reads if r["phase"] == "decode"] or reads
    return (f"mixture of experts ({cost.moe_layers} layers of {cost.num_experts} experts, top {cost.top_k}): the "
            f"weight-read line is attention, dense and shared weights plus the routed experts each step selected, "
            f"counted from the routers in the measured run (distinct experts per layer; uniform routing's "
            f"expectation in brackets): " + ", ".join(
                f"{r['phase']} batch {r['batch']} context {r['context']} {r['counted'] / per_layer:.2f} "
                f"[{r['expected'] / per_layer:.2f}]" for r in shown))


def print_table(recs: list[dict]) -> None:
    if not recs:
        return
    cols = [("phase", "{}", "phase"), ("B", "{}", "batch"), ("ctx", "{}", "context"), ("tok", "{}", "tokens"),
            ("ms", "{:.2f}", "time_s", 1e3), ("GFLOP", "{:.3f}", "flops", 1e-9), ("MB", "{:.1f}", "bytes", 1e-6),
            ("FLOP/B", "{:.2f}", "arithmetic_intensity"), ("GFLOP/s", "{:.1f}", "achieved_flops", 1e-9),
            ("GB/s", "{:.1f}", "achieved_bandwidth", 1e-9), ("roof", "{:.1f}", "roof_flops", 1e-9),
            ("bound", "{}", "bound"), ("%roof", "{:.0f}", "fraction_of_roof", 100)]
    rows = [[fmt.format(r[key] * scale[0] if scale else r[key]) for _, fmt, key, *scale in cols] for r in recs]
    widths = [max(len(c[0]), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print("  ".join(c[0].rjust(w) for c, w in zip(cols, widths)))
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def plot(path: str, recs: list[dict], limits, dtype: str, model_name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak, bw = limits.peak_flops(dtype), limits.bandwidth
    ais = [r["arithmetic_intensity"] for r in recs] + [peak / bw]
    x = torch.logspace(torch.log10(torch.tensor(min(ais) / 2)), torch.log10(torch.tensor(max(ais) * 2)), 200).tolist()
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot(x, [min(peak, a * bw) for a in x], color="black", lw=2,
            label=f"roof: {bw / 1e9:.1f} GB/s, {dtype} GEMM {peak / 1e9:.0f} GFLOP/s")
    for name, f in limits.gemm_flops.items():
        if name != dtype:
            ax.axhline(f, color="gray", ls="--", lw=1, label=f"{name} GEMM {f / 1e9:.0f} GFLOP/s")
    lo, hi = (min(r["context"] for r in find(recs, "decode")), max(r["context"] for r in find(recs, "decode"))) \
        if find(recs, "decode") else (None, None)
    for phase, color in COLORS.items():
        pts = find(recs, phase)
        if not pts:
            continue
        xs, ys = [r["arithmetic_intensity"] for r in pts], [r["achieved_flops"] for r in pts]
        if phase == "nocache":   # the same step as a prefill of the context: a ring around that point
            ax.scatter(xs, ys, s=90, facecolors="none", edgecolors=color, zorder=4,
                       label="nocache decode (= prefill of its context)")
            continue
        ax.scatter(xs, ys, color=color, label=phase, zorder=3, s=24)
        for r in pts:
            label = str(r["context"]) if phase == "prefill" else \
                f"b{r['batch']}/{r['context']}" if r["context"] in (lo, hi) else ""
            ax.annotate(label, (r["arithmetic_intensity"], r["achieved_flops"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(f"{model_name} ({dtype}) {limits.threads} thread(s); decode labels: b<batch>/<context>")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
