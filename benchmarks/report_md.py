"""docs/BENCHMARKS.md from the summary that benchmarks/compare.py collects: the machine, the
method, one table per model and workload with every system side by side and its ratios to the
engine, links to the latency plots, and every command that was run."""
from __future__ import annotations

import os
import sys

from benchmarks.workloads import TITLES, Workload

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COLUMNS = ("System", "Done / failed", "Output tok/s", "TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99", "ITL mean",
           "Tok/s vs engine", "TTFT vs engine", "TPOT vs engine", "Busy cores before")


def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "–"
    return f"{v:,.{digits}f}"


def ratio(a, b) -> str:
    return f"{a / b:.2f}×" if a is not None and b else "–"


def workload_table(records: list[dict], base: Workload) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    engine = next((r.get("metrics") for r in records if r["system"] == "engine"), None) or {}
    scaled, one_chunk_systems, notes = [], [], []
    for r in records:
        m = r.get("metrics")
        label = r["system"]
        wl = Workload(**r["workload_spec"])
        if (wl.num_prompts, wl.output_len) != (base.num_prompts, base.output_len):
            label += " †"
            scaled.append(f"{r['system']} {wl.num_prompts} requests of {wl.output_len} output tokens")
        if not m:
            err = (r.get("error") or "").splitlines()[0][:160] if r.get("error") else ""
            lines.append(f"| {label} | **{r['status']}** | " + " | ".join(["–"] * (len(COLUMNS) - 4))
                         + f" | {err} | – |")
            continue
        one_chunk = m.get("mean_chunks_per_request") == 1 and wl.output_len > 1
        if one_chunk:
            label += " ‡"
            one_chunk_systems.append(r["system"])
        tpot = ["n/a"] * 3 if one_chunk else [fmt(m["mean_tpot_ms"]), fmt(m["p99_tpot_ms"]), fmt(m["mean_itl_ms"])]
        cells = [label, f"{m['completed']} / {m['failed']}", fmt(m["output_throughput"]),
                 fmt(m["mean_ttft_ms"], 0), fmt(m["p99_ttft_ms"], 0), *tpot,
                 ratio(m["output_throughput"], engine.get("output_throughput")),
                 ratio(m["mean_ttft_ms"], engine.get("mean_ttft_ms")),
                 "n/a" if one_chunk else ratio(m["mean_tpot_ms"], engine.get("mean_tpot_ms")),
                 fmt(r.get("busy_cores_before"), 2)]
        lines.append("| " + " | ".join(cells) + " |")
        if r["status"] != "ok" and r.get("error"):
            notes.append(f"{r['system']}: {r['error'].splitlines()[0][:300]}")
    failures = [f"- **{r['system']}** ({r['status']}): `{' '.join(r['error'].split())[:600]}`"
                for r in records if not r.get("metrics") and r.get("error")]
    if scaled:
        notes.insert(0, "† scaled down to fit the time budget (fewer requests in flight and queued than the "
                        "others had): " + "; ".join(scaled))
    if one_chunk_systems:
        notes.insert(0, f"‡ {', '.join(one_chunk_systems)}: every token arrives in one chunk at the end "
                        "(TTFT = end-to-end latency), so TPOT and ITL are not defined")
    notes = [f"{n}  " for n in dict.fromkeys(notes)]
    return lines + ([""] + notes if notes else []) + ([""] + failures if failures else [])


def shown(cmd: list[str], env: dict | None = None) -> str:
    """A command as the doc shows it: `python` for this interpreter, paths in the repository
    relative to it, the home directory as ~, the environment variables it was given in front."""
    home = os.path.expanduser("~")

    def short(w: str) -> str:
        return "python" if w in (sys.executable, "python3") or w.endswith("/bin/python") else \
            w.replace(REPO + "/", "").replace(home, "~")

    return " ".join([f"{k}={short(v)}" for k, v in (env or {}).items()] + [short(w) for w in cmd])


def wrapped(command: str, width: int = 110) -> list[str]:
    """A long shell command as lines joined by backslashes, so no line of the doc is too long."""
    lines, line = [], ""
    for word in command.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line + " \\")
            line = "    " + word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


KEEP_MARKER = "<!-- hand-written below: compare.py keeps everything from this line on -->"


def plot_link(summary: dict, key: str, doc_dir: str) -> str | None:
    """The latency-CDF plot of `key` ("model/workload") relative to the doc, if the file is there."""
    path = summary["plots"].get(key)
    if path and not os.path.isabs(path):
        path = os.path.join(REPO, path)
    return os.path.relpath(path, doc_dir) if path and os.path.exists(path) else None


def write_doc(path: str, summary: dict) -> None:
    m = summary["machine"]
    doc_dir = os.path.dirname(os.path.abspath(path))
    lines = [
        "# Benchmarks: pdserve and its baselines against vLLM and llama.cpp",
        "",
        f"Generated by `python -m benchmarks.compare` from a run of {summary['started']} "
        f"({summary['duration_s'] / 60:.1f} min)"
        + (" (**--quick**: tiny model, few requests; not the full comparison)" if summary["args"]["quick"] else "")
        + ". Rerun with the command below; `--from-summary FILE` rewrites this page from a run's summary.",
        "",
        "```bash",
        summary["command"],
        "```",
        "",
        "## Machine",
        "",
        f"- CPU: {m.get('model name', '?')} (family {m.get('cpu family', '?')}, model {m.get('model', '?')}), "
        f"{m.get('cores')} cores; AVX-512: {'yes' if m.get('avx512') else 'no'}, AMX: {'yes' if m.get('amx') else 'no'}",
        f"- RAM: {m.get('ram_gib')} GiB; Python {m.get('python')}; torch {m.get('torch')} "
        f"({m.get('torch_threads')} threads); pdserve {m.get('pdserve_commit', '?')}",
        *(["- Peers: " + "; ".join(summary["versions"].values())] if summary.get("versions") else []),
        f"- Load average at start / end: {summary['loadavg_start']} / {summary['loadavg_end']}. The last column "
        "of each table is how many cores other work kept busy just before that system started.",
        "",
        "## Method",
        "",
        "- Every system serves the same checkpoint in fp32 on 127.0.0.1, one at a time, measured by `pdserve bench` "
        "(docs/BENCH_TOOL.md): vLLM's `bench serve` definitions of TTFT, TPOT and ITL, tokens counted from `usage`, "
        "times in ms.",
        "- Every (model, system, workload) run has its own `--seed` (fresh prompts: the servers cache prefixes), "
        "after unmeasured warm-up requests.",
        "- `static` (batches of 4), `hf` (one `generate()` at a time) and `nocache` (no KV cache) are the origin "
        "server's paths; they run smaller workloads, marked †.",
        "- Servers:",
        *[f"  - {k}: `{v}`" for k, v in summary.get("server_flags", {}).items()],
        "",
    ]
    for model_key, model_dir in summary["models"].items():
        lines += [f"## Model: {model_key} (`{shown([model_dir])}`)", ""]
        for wl in summary["workloads"].get(model_key, []):   # a partial run has not reached every model
            wl = Workload(**wl)
            recs = [r for r in summary["runs"] if r["model"] == model_key and r["workload"] == wl.name]
            if not recs:
                continue
            lines += [f"### {wl.name}: {TITLES.get(wl.name, '')} ({wl.describe()})", ""]
            lines += workload_table(recs, wl)
            plot = plot_link(summary, f"{model_key}/{wl.name}", doc_dir)
            if plot:
                lines += ["", f"Latency CDFs: [{os.path.basename(plot)}]({plot})"]
            lines.append("")
    servers = dict.fromkeys(shown(r.get("server_cmd", []), r.get("server_env")) for r in summary["runs"])
    lines += ["## Commands", "",
              "One server command per system; each ran the bench commands recorded per run in "
              f"`{shown([summary['summary_path']])}`.", "", "```", *[ln for c in servers if c for ln in wrapped(c)], "```", ""]
    text = "\n".join(lines)
    if os.path.exists(path):   # hand-written sections after the marker survive a rerun
        with open(path, encoding="utf-8") as f:
            old = f.read()
        if KEEP_MARKER in old:
            text += "\n" + old[old.index(KEEP_MARKER):]
    os.makedirs(doc_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def replace_block(path: str, name: str, heading: str, text: str) -> None:
    """Put `text` between the doc's <!-- name:begin/end --> markers, or append it under `heading`."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    block = f"{begin}\n{text}\n{end}"
    if begin in doc and end in doc:
        doc = doc[:doc.index(begin)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + f"\n\n{heading}\n\n" + block + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(doc)
