"""benchmarks/disagg.py: the step-log analysis and the summary, on made-up logs and results."""
import json

from benchmarks import disagg


def step(start, duration, prefill, decode):
    return {"start_time": start, "duration": duration, "num_prefill_tokens": prefill, "num_decode_tokens": decode}


def test_colocated_points_are_the_decoding_steps_with_their_own_prefill_tokens():
    steps = [step(0, 0.01, 512, 0), step(1, 0.05, 256, 4), step(2, 0.002, 0, 4)]
    assert disagg.colocated_points(steps) == [(256, 0.05), (0, 0.002)]


def test_disaggregated_points_take_the_prefill_step_running_at_each_decode_steps_midpoint():
    prefill = [step(10.0, 1.0, 512, 0), step(12.0, 0.5, 64, 0)]
    decode = [step(10.2, 0.1, 1, 4),    # midpoint 10.25: inside the 512-token step
              step(11.5, 0.1, 0, 4),    # 11.55: between prefill steps
              step(12.4, 0.2, 0, 4),    # 12.5: the end of the 64-token step
              step(13.0, 0.1, 4, 0),    # no decodes: not a point
              step(9.0, 0.1, 0, 4)]     # before any prefill step
    assert disagg.disaggregated_points(decode, prefill) == [(512, 0.1), (0, 0.1), (64, 0.2), (0, 0.1)]


def test_step_table_bins_by_concurrent_prefill_tokens():
    points = [(0, 0.001), (0, 0.003), (16, 0.004), (600, 0.02)]
    rows = {r["prefill_tokens"]: r for r in disagg.step_table(points)}
    assert list(rows) == ["0", "1-32", "33-128", "129-256", "257-512", ">=513"]
    assert rows["0"]["steps"] == 2 and abs(rows["0"]["median_ms"] - 2.0) < 1e-9
    assert rows["1-32"]["steps"] == 1 and rows["33-128"]["steps"] == 0 and rows["33-128"]["median_ms"] is None
    assert abs(rows[">=513"]["p90_ms"] - 20.0) < 1e-9


def test_summarize_takes_the_short_requests_numbers():
    res = {"ttfts": [0.1, 0.3, 2.0], "itls": [[0.01, 0.03], [0.02], [0.5]], "output_lens": [3, 2, 2],
           "errors": ["", "", ""], "request_kinds": ["short", "short", "long"], "completed": 3, "failed": 0,
           "output_throughput": 12.5, "request_goodput": 0.5, "long_mean_ttft_ms": 2000.0}
    m = disagg.summarize(res)
    assert abs(m["short_median_itl_ms"] - 20.0) < 1e-9 and abs(m["short_mean_ttft_ms"] - 200.0) < 1e-9
    assert m["output_throughput"] == 12.5 and m["request_goodput"] == 0.5 and m["long_mean_ttft_ms"] == 2000.0


def test_the_dry_run_prints_both_systems_on_the_same_cores(capsys, tmp_path):
    assert disagg.main(["--dry-run", "--quick", "--prefill-cores", "0", "--decode-cores", "1",
                        "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    servers = [line for line in out if not line.startswith("    ")]
    assert servers[0].startswith("taskset -c 0-1 ") and servers[0].endswith("--threads 2")
    assert "--disaggregate --prefill-cores 0 --decode-cores 1" in servers[1]
    benches = [line for line in out if line.startswith("    ")]
    assert len(benches) == 4 and sum("--goodput ttft:1000 tpot:100" in b for b in benches) == 2
    assert all("--max-concurrency" not in b for b in benches if "--request-rate" in b)
    assert not list(tmp_path.iterdir())   # a dry run writes nothing


def test_table_and_plot_from_records(tmp_path):
    records = [{"system": s, "runs": [{"workload": "long-short", "metrics": {
        "short_median_itl_ms": 2.0, "short_p99_itl_ms": p99, "short_mean_ttft_ms": 50.0, "short_p99_ttft_ms": 90.0,
        "output_throughput": 100.0, "request_goodput": 1.5, "failed": 0}}],
        "step_points": pts, "step_table": disagg.step_table(pts)}
        for s, p99, pts in (("colocated", 40.0, [(0, 0.002), (300, 0.03)]),
                            ("disaggregated", 3.0, [(0, 0.002), (300, 0.0025)]))]
    text = disagg.table(records)
    assert "colocated" in text and "40.0" in text and "257-512" in text
    path = disagg.plot(records, str(tmp_path / "steps.png"), "test")
    assert (tmp_path / "steps.png").stat().st_size > 1000 and path.endswith("steps.png")
    json.dumps(records)   # the summary file takes them as they are
