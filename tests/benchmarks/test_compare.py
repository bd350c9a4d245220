"""benchmarks/compare.py and its helpers, without installing or running any real peer: the
workload plan, the Markdown tables, the server lifecycle against a fake server, and the GGUF
converter wrapper against a fake llama.cpp tree."""
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from benchmarks import compare, estimates, peers, report_md
from benchmarks.workloads import WORKLOADS, plan_workloads, warmup_for
from pdserve.bench import servers


def test_plan_scales_only_the_slow_baselines_on_the_big_model():
    full = {w.name: w for w in plan_workloads("0.5b", "engine", quick=False)}
    hf = {w.name: w for w in plan_workloads("0.5b", "hf", quick=False)}
    assert full["c32"].num_prompts == 64 and full["c32"].concurrency == 32
    assert hf["c32"].num_prompts < full["c32"].num_prompts
    assert (hf["c32"].input_len, hf["c32"].concurrency) == (full["c32"].input_len, full["c32"].concurrency)
    assert plan_workloads("0.5b", "vllm", quick=False) == list(full.values())
    assert plan_workloads("tiny", "nocache", quick=True) == WORKLOADS["quick"]
    assert [w.name for w in plan_workloads("tiny", "engine", False, only=["c1"])] == ["c1"]


def test_estimate_scales_past_runs_by_rounds_and_tokens():
    c32 = WORKLOADS["0.5b"][0]  # 64 requests, 32 at a time, 128 out
    past = [dict(model="0.5b", system="engine", spec=c32, seconds=100.0, ready_s=10.0, source="r/0.5b/c32/engine.json"),
            dict(model="0.5b", system="hf", spec=replace(c32, num_prompts=4), seconds=80.0, ready_s=4.0,
                 source="r/0.5b/c32/hf.json")]
    assert estimates.work(c32, "engine") == 2 * 128 and estimates.work(c32, "hf") == 64 * 128
    est, source = estimates.estimate_s("0.5b", "engine", [c32, replace(c32, output_len=64)], past)
    warm = warmup_for("engine")
    assert est == pytest.approx(100 + 50 + 100 * estimates.work(warm, "engine") / 256 + 10 + 6)
    assert source == "r"
    est, _ = estimates.estimate_s("0.5b", "hf", [replace(c32, num_prompts=2)], past)
    assert est == pytest.approx(40 + 80 * 8 / (4 * 128) + 4 + 6)  # one warm-up request of 8 tokens
    assert estimates.estimate_s("tiny", "hf", [c32], past) is None


def test_dry_run_prints_the_plan_and_an_estimate():
    out = subprocess.run([sys.executable, "-m", "benchmarks.compare", "--dry-run", "--models", "tiny", "--skip-peers"],
                         capture_output=True, text=True, check=True, timeout=120, cwd=compare.REPO).stdout
    assert out.count("pdserve serve") == len(compare.OURS) and "--dataset-name long-short" in out
    assert "# tiny / engine:" in out


def test_bench_args_name_every_length():
    ls = next(w for w in WORKLOADS["tiny"] if w.dataset == "long-short")
    args = ls.bench_args()
    assert args[args.index("--long-input-len") + 1] == str(ls.long_len)
    assert args[args.index("--max-concurrency") + 1] == str(ls.concurrency)


def test_summary_metrics_detects_single_chunk_streams():
    res = {"completed": 2, "failed": 0, "itls": [[], []], "output_lens": [8, 8], "errors": ["", ""]}
    assert compare.summary_metrics(res)["mean_chunks_per_request"] == 1
    res["itls"] = [[0.1] * 7, [0.1] * 7]
    assert compare.summary_metrics(res)["mean_chunks_per_request"] == 8


def metrics(tok_s, ttft, tpot, chunks=64.0):
    return {"completed": 4, "failed": 0, "output_throughput": tok_s, "request_throughput": 1.0,
            "mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p99_ttft_ms": ttft, "mean_tpot_ms": tpot,
            "p99_tpot_ms": tpot, "mean_itl_ms": tpot, "mean_chunks_per_request": chunks}


def test_table_has_ratios_failures_and_scaled_rows():
    base = WORKLOADS["0.5b"][0]
    spec = vars(base)
    records = [
        dict(system="engine", status="ok", workload_spec=spec, metrics=metrics(50.0, 100.0, 20.0), busy_cores_before=0.1),
        dict(system="vllm", status="ok", workload_spec=spec, metrics=metrics(100.0, 50.0, 10.0), busy_cores_before=0.1),
        dict(system="hf", status="ok", workload_spec=dict(spec, num_prompts=4),
             metrics=metrics(5.0, 1000.0, 0.0, chunks=1.0), busy_cores_before=0.1),
        dict(system="llama-server", status="start failed", workload_spec=spec,
             error="start llama-server: exited with status 1\nsome log line"),
    ]
    text = "\n".join(report_md.workload_table(records, base))
    assert "| vllm | 4 / 0 | 100.0 |" in text and "| 2.00× | 0.50× | 0.50× |" in text
    assert "hf † ‡" in text and "n/a" in text  # scaled down, and one chunk: no TPOT
    assert "**start failed**" in text and "exited with status 1" in text


def test_rewriting_the_doc_keeps_hand_written_sections(tmp_path):
    summary = dict(machine={"cores": 2}, started="today", duration_s=60.0, args={"quick": False}, command="compare.py",
                   loadavg_start=0.1, loadavg_end=0.2, models={}, workloads={}, runs=[], plots={},
                   out_dir=str(tmp_path), summary_path=str(tmp_path / "summary.json"))
    doc = tmp_path / "BENCHMARKS.md"
    report_md.write_doc(str(doc), summary)
    doc.write_text(doc.read_text() + "\n" + report_md.KEEP_MARKER + "\n## Reading\n\nby hand\n")
    report_md.write_doc(str(doc), dict(summary, started="tomorrow"))
    text = doc.read_text()
    assert "tomorrow" in text and "today" not in text
    assert text.count(report_md.KEEP_MARKER) == 1 and text.endswith("## Reading\n\nby hand\n")


FAKE_SERVER = textwrap.dedent('''
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    started = time.monotonic()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            ok = self.path == "/health" and time.monotonic() - started > 0.5
            self.send_response(200 if ok else 503)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["max_tokens"]
            for i in range(n):
                ev = {"choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}]}
                self.wfile.write(f"data: {json.dumps(ev)}\\n\\n".encode())
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\\n\\ndata: [DONE]\\n\\n".encode())

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


def test_server_waits_for_health_answers_and_stops(tmp_path):
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SERVER)
    port = servers.free_port()
    server = servers.Server("fake", [sys.executable, str(script), str(port)], port, str(tmp_path / "fake.log"))
    with server.start(timeout=30):
        pid = server.proc.pid
        assert server.ready_s >= 0.5
        got = servers.check_completion(server.base_url, "m", [1, 2, 3], max_tokens=4)
        assert got["usage"]["completion_tokens"] == 4 and got["text_events"] == 4 and got["done"]
    assert server.proc is None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole group is gone


def test_server_that_exits_is_an_error_with_its_log(tmp_path):
    port = servers.free_port()
    cmd = [sys.executable, "-c", "import sys; print('bad flag --foo'); sys.exit(3)"]
    server = servers.Server("broken", cmd, port, str(tmp_path / "broken.log"))
    with pytest.raises(servers.PeerError, match=r"(?s)exited with status 3.*bad flag --foo"):
        server.start(timeout=30)


def test_convert_wrapper_declares_the_pre_tokenizer(tmp_path):
    """The wrapper replaces the hash lookup on the tree's TextModel before the script runs,
    without touching the tree."""
    (tmp_path / "conversion").mkdir()
    (tmp_path / "conversion" / "__init__.py").write_text("")
    base = "class TextModel:\n    def get_vocab_base_pre(self, tokenizer):\n        raise NotImplementedError('not recognized')\n"
    (tmp_path / "conversion" / "base.py").write_text(base)
    (tmp_path / "convert_hf_to_gguf.py").write_text(
        "import sys\nfrom conversion.base import TextModel\nprint(TextModel().get_vocab_base_pre(None), sys.argv[1:])\n")
    out = subprocess.run([sys.executable, "-c", peers.CONVERT_WRAPPER, str(tmp_path), "qwen2", "MODEL", "--outtype", "f32"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "qwen2 ['MODEL', '--outtype', 'f32']"
    assert (tmp_path / "conversion" / "base.py").read_text() == base


def test_checkpoint_key_changes_when_the_checkpoint_does(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    k1 = peers.checkpoint_key(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert peers.checkpoint_key(str(tmp_path)) != k1


def test_the_doc_is_rewritten_from_a_summary_with_short_lines(tmp_path):
    """--from-summary runs nothing; every line of the page (commands included) stays readable."""
    summary = dict(machine={"cores": 2}, started="today", duration_s=60.0, args={"quick": False},
                   command="python -m benchmarks.compare", loadavg_start=0.1, loadavg_end=0.2, models={},
                   workloads={}, plots={}, out_dir=str(tmp_path), summary_path=str(tmp_path / "summary.json"),
                   runs=[{"server_cmd": ["vllm", "serve"] + ["--flag-with-a-long-name"] * 40, "server_env": {"A": "1"}}])
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    doc = tmp_path / "B.md"
    assert compare.main(["--from-summary", str(path), "--doc", str(doc)]) == 0
    lines = doc.read_text().splitlines()
    first = lines[lines.index("```", lines.index("## Commands")) + 1]
    assert first.startswith("A=1 vllm serve --flag-with-a-long-name") and first.endswith(" \\")
    assert max(map(len, lines)) <= 300
    assert sum(ln.count("--flag-with-a-long-name") for ln in lines) == 40
