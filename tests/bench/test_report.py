"""`pdserve report`: PNGs from result JSON files and a step log (files checked, not pixels)."""
import json

import pytest

from pdserve.bench.bench_metrics import RequestResult, compute_metrics
from pdserve.bench.report import latency_samples
from pdserve.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def result(label, rate="inf", concurrency=None, slow=1.0):
    rs = [RequestResult(prompt_len=16, output_tokens=4, ttft=0.05 * slow * (i + 1), itl=[0.01 * slow] * 3,
                        latency=0.05 * slow * (i + 1) + 0.03 * slow, success=True,
                        slo_ms={"ttft": 200.0, "tpot": 20.0}) for i in range(8)]
    rs.append(RequestResult(prompt_len=16, error="HTTP 503: queue full"))
    return {"label": label, "request_rate": rate, "max_concurrency": concurrency, **compute_metrics(rs, 2.0 * slow)}


def test_latency_samples_rebuild_e2el_and_tpot_from_vllm_keys():
    s = latency_samples(result("x"))
    assert len(s["ttft"]) == 8   # the failed request is left out
    assert s["e2el"][0] == pytest.approx(80.0) and s["tpot"][0] == pytest.approx(10.0)
    assert len(s["itl"]) == 24
    assert latency_samples({"completed": 3, "mean_ttft_ms": 1.0}) is None   # no per-request data


def test_latency_samples_split_by_kind():
    rs = [RequestResult(prompt_len=8, output_tokens=2, ttft=t, itl=[0.01], latency=t + 0.01, success=True, kind=k)
          for t, k in [(0.5, "long"), (0.1, "short"), (0.2, "short")]]
    res = compute_metrics(rs, 1.0)
    assert latency_samples(res, "long")["ttft"] == pytest.approx([500.0])
    assert latency_samples(res, "short")["ttft"] == pytest.approx([100.0, 200.0])
    assert len(latency_samples(res)["ttft"]) == 3


def is_png(path):
    return path.exists() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def test_report_writes_every_plot(tmp_path, capsys):
    files = []
    for i, (label, rate, conc) in enumerate([("pdserve", 2, None), ("pdserve", 4, None), ("pdserve", 8, None),
                                              ("vllm", 2, None), ("vllm", 8, None),
                                              ("pdserve", "inf", 1), ("pdserve", "inf", 4)]):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(result(label, rate, conc, slow=1 + i / 3)))
        files.append(str(path))
    steps = tmp_path / "steps.jsonl"
    t = 100.0
    with open(steps, "w") as f:
        for i in range(60):
            prefill = 256 if i % 20 == 0 else 0
            row = {"start_time": t, "duration": 0.01 + prefill / 1e4, "num_seqs": 1 + i % 7,
                   "num_prefill_tokens": prefill, "num_decode_tokens": i % 7, "num_preemptions": int(i == 30),
                   "forward_time": 0.008 + prefill / 1e4}
            f.write(json.dumps(row) + "\n")
            t += row["duration"] + (1.0 if i == 40 else 0.001)   # one idle second
    out = tmp_path / "plots"
    assert main(["report", *files, "--step-log", str(steps), "--out", str(out)]) == 0
    for name in ("latency_cdf.png", "latency_vs_rate.png", "attainment_vs_rate.png", "throughput_vs_concurrency.png",
                 "step_timeline.png"):
        assert is_png(out / name), name
    assert "wrote" in capsys.readouterr().out


def test_report_skips_sweeps_it_has_no_points_for(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(result("solo")))
    assert main(["report", str(path), "--out", str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["latency_cdf.png"]
    assert main(["report"]) == 2
