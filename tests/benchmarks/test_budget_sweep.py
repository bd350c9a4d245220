"""benchmarks/budget_sweep.py without a server: the per-kind numbers from a bench result's
per-request arrays, the recommended budget, and the plan it prints."""
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import budget_sweep


def result(rows, throughput=100.0):
    """A long-short result as `pdserve bench --output` writes it, from (kind, ttft s, itls s, error)."""
    return {"ttfts": [r[1] for r in rows], "itls": [r[2] for r in rows],
            "output_lens": [0 if r[3] else len(r[2]) + 1 for r in rows], "errors": [r[3] for r in rows],
            "request_kinds": [r[0] for r in rows], "failed": sum(bool(r[3]) for r in rows),
            "output_throughput": throughput}


def test_summary_splits_by_kind_and_pools_the_short_gaps():
    short_gaps = [[0.010, 0.010, 0.012], [0.010, 0.050]]  # pooled: 10, 10, 12, 10, 50 ms
    res = result([("short", 0.1, short_gaps[0], ""), ("long", 2.0, [0.5, 0.01], ""),
                  ("short", 0.3, short_gaps[1], ""), ("long", 4.0, [], "HTTP 500: boom"),
                  ("short", 9.9, [], "ReadTimeout")], throughput=42.0)
    m = budget_sweep.summarize(res)
    pooled = np.array([10, 10, 12, 10, 50.0])
    assert (m["short_completed"], m["long_completed"], m["failed"]) == (2, 1, 2)
    assert m["short_median_itl_ms"] == pytest.approx(10.0)
    assert m["short_p99_itl_ms"] == pytest.approx(np.percentile(pooled, 99))  # 48.48: the long step is not pooled in
    assert m["short_itl_p99_over_median"] == pytest.approx(4.848)
    assert not m["meets_target"]
    assert m["short_mean_ttft_ms"] == pytest.approx(200.0)  # failed requests count nowhere
    assert m["short_p99_ttft_ms"] == pytest.approx(298.0)
    assert m["long_mean_ttft_ms"] == pytest.approx(2000.0)
    assert m["output_throughput"] == 42.0


def test_steady_gaps_meet_the_target():
    m = budget_sweep.summarize(result([("short", 0.1, [0.01] * 50 + [0.019], ""), ("long", 1.0, [0.01], "")]))
    assert m["short_itl_p99_over_median"] <= 2.0 and m["meets_target"]


def test_a_result_without_kinds_is_refused():
    res = result([("short", 0.1, [0.01], "")])
    del res["request_kinds"]
    with pytest.raises(ValueError, match="long-short"):
        budget_sweep.summarize(res)


def test_recommend_takes_the_fastest_budget_meeting_the_target_else_the_nearest():
    def row(budget, ratio, tput):
        return {"budget": budget, "metrics": {"short_itl_p99_over_median": ratio, "meets_target": ratio <= 2,
                                              "output_throughput": tput}}
    rows = [row(32, 1.5, 50.0), row(128, 1.9, 80.0), row(512, 6.0, 90.0), {"budget": 1024, "status": "start failed"}]
    assert budget_sweep.recommend(rows)["budget"] == 128
    assert budget_sweep.recommend([row(32, 2.5, 50.0), row(512, 6.0, 90.0)])["budget"] == 32
    assert budget_sweep.recommend([]) is None


def test_dry_run_prints_one_server_per_budget():
    out = subprocess.run([sys.executable, "-m", "benchmarks.budget_sweep", "--dry-run", "--quick",
                          "--budgets", "64,16"], capture_output=True, text=True, check=True, timeout=120, cwd=REPO).stdout
    lines = out.splitlines()
    budgets = [ln.split("--max-num-batched-tokens ")[1].split()[0] for ln in lines if "pdserve serve" in ln]
    assert budgets == ["16", "64"]
    assert sum("--dataset-name long-short" in ln for ln in lines) == 2


def test_aggregate_takes_medians_over_rounds_per_point():
    def run(budget, cap, ratio, tput):
        return {"budget": budget, "cap": cap, "status": "ok",
                "metrics": {"short_itl_p99_over_median": ratio, "meets_target": ratio <= 2, "output_throughput": tput}}
    rows = [run(512, 0, 20.0, 20.0), run(512, 32, 1.5, 18.0), run(512, 0, 30.0, 22.0), run(512, 32, 2.5, 19.0),
            run(512, 32, 1.9, 30.0), {"budget": 512, "cap": 64, "status": "start failed"}]
    points = budget_sweep.aggregate(rows)
    assert [(p["budget"], p["cap"], p["rounds"]) for p in points] == [(512, 0, 2), (512, 32, 3), (512, 64, 0)]
    assert points[0]["metrics"]["short_itl_p99_over_median"] == 25.0 and not points[0]["metrics"]["meets_target"]
    assert points[1]["metrics"]["short_itl_p99_over_median"] == 1.9 and points[1]["metrics"]["meets_target"]
    assert points[1]["metrics"]["output_throughput"] == 19.0
    assert points[2]["status"] == "start failed" and "metrics" not in points[2]
    assert budget_sweep.recommend(points)["cap"] == 32
    text = budget_sweep.table(points)
    assert "off" in text.splitlines()[1] and "start failed" in text.splitlines()[3]


def test_c32_summary_keeps_the_bench_aggregates():
    res = {"completed": 64, "failed": 0, "output_throughput": 88.5, "mean_ttft_ms": 9000.0, "median_ttft_ms": 8000.0,
           "p99_ttft_ms": 19000.0, "median_itl_ms": 250.0, "p99_itl_ms": 2100.0, "median_tpot_ms": 300.0, "x": 1}
    m = budget_sweep.summarize_c32(res)
    assert m["output_throughput"] == 88.5 and m["p99_ttft_ms"] == 19000.0 and "x" not in m
    assert "88.5" in budget_sweep.table(budget_sweep.aggregate([{"budget": 512, "cap": 0, "status": "ok",
                                                                  "metrics": m}]), "c32")


def test_dry_run_crosses_budgets_and_caps_and_names_the_results():
    out = subprocess.run([sys.executable, "-m", "benchmarks.budget_sweep", "--dry-run", "--quick",
                          "--budgets", "512", "--caps", "32,0", "--bench", "c32", "--name", "t"],
                         capture_output=True, text=True, check=True, timeout=120, cwd=REPO).stdout
    serves = [ln for ln in out.splitlines() if "pdserve serve" in ln]
    assert [ln.split("--max-prefill-tokens-with-decodes ")[1].split()[0] for ln in serves] == ["0", "32"]
    benches = [ln for ln in out.splitlines() if "pdserve bench" in ln]
    assert all("--dataset-name random" in ln and "budget_sweep/quick-t/" in ln for ln in benches)
    assert benches[1].split("--output ")[1].split()[0].endswith("b512-cap32.json")


@pytest.mark.parametrize("flag", [["--caps", "-1"], ["--caps", "x"], ["--rounds", "0"], ["--name", "a/b"]])
def test_bad_sweep_arguments_are_refused(flag):
    r = subprocess.run([sys.executable, "-m", "benchmarks.budget_sweep", "--dry-run", "--quick", *flag],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "error:" in r.stderr
