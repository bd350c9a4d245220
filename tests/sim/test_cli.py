"""`pdserve simulate` end to end on the bundled model's config, and its one-line errors."""
import json

import pytest

from pdserve.cli import main
from pdserve.engine.cost_model import StepCostModel
from pdserve.sim.steplog import fit_step_log


@pytest.fixture
def cost_file(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"cost_model": StepCostModel((0.005, 1e-4, 1e-4, 0.0)).as_dict()}))
    return str(path)


def test_simulate_writes_bench_metrics(tmp_path, cost_file, capsys):
    out = tmp_path / "sim.json"
    rc = main(["simulate", "--cost-model", cost_file, "--num-prompts", "12", "--random-input-len", "32",
               "--random-output-len", "8", "--request-rate", "10", "--prefill-replicas", "1", "--decode-replicas", "2",
               "--goodput", "ttft:1000", "tpot:100", "--output", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["placement"] == "1P2D" and res["completed"] == 12 and res["total_output_tokens"] == 12 * 8
    for key in ("mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "output_throughput",
                "request_goodput"):
        assert res[key] > 0
    assert "1P2D" in capsys.readouterr().out


def test_search_on_the_cli(tmp_path, cost_file, capsys):
    out = tmp_path / "search.json"
    rc = main(["simulate", "--cost-model", cost_file, "--num-prompts", "6", "--random-input-len", "32",
               "--random-output-len", "8", "--search", "--machines", "1,2", "--search-span", "2",
               "--goodput", "ttft:500", "tpot:50", "--output", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["placement"] for r in res["search"]["1"]] == ["1x colocated"]
    assert sorted(r["placement"] for r in res["search"]["2"]) == ["1P1D", "2x colocated"]
    assert res["search"]["2"][0]["goodput_per_machine"] > 0
    assert "best:" in capsys.readouterr().out


def test_step_log_fit(tmp_path):
    """Steps of 10 ms + 1 ms a token, back to back with a 2 ms gap: the periods are fitted."""
    lines, t = [], 0.0
    for i in range(40):
        tokens = 1 + (i * 37) % 200
        duration = 0.010 + 0.001 * tokens
        lines.append(json.dumps({"start_time": t, "duration": duration, "num_seqs": 1, "num_prefill_tokens": tokens,
                                 "num_decode_tokens": 0, "num_preemptions": 0, "forward_time": duration}))
        t += duration + 0.002
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(lines) + "\n")
    model = fit_step_log(str(path))
    assert model.predict(100, 1, 0) == pytest.approx(0.012 + 0.1, rel=0.02)
    # a 50 ms wait before a step that decodes: the engine had work (a starved process), so it counts
    rows = [json.loads(line) for line in lines]
    for i, row in enumerate(rows):
        row["start_time"] += 0.048 * i
        row["num_decode_tokens"], row["num_seqs"] = 1, 2
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    assert fit_step_log(str(path)).predict(101, 2, 0) == pytest.approx(0.060 + 0.1, rel=0.02)
    path.write_text('{"start_time": 1}\n')
    with pytest.raises(ValueError, match="step-log"):
        fit_step_log(str(path))


def _steps(pid, t0, n, gap=0.010):
    """n back-to-back steps of 10 ms + 1 ms a token from t0, 10 ms apart, as `pid` logs them."""
    rows, t = [], t0
    for i in range(n):
        tokens = 1 + (i * 37 + pid) % 200
        duration = 0.010 + 0.001 * tokens
        rows.append({"start_time": t, "duration": duration, "num_seqs": 1, "num_prefill_tokens": tokens,
                     "num_decode_tokens": 0, "num_preemptions": 0, "forward_time": duration, "pid": pid})
        t += duration + gap
    return rows


def test_step_log_of_engines_sharing_a_file(tmp_path):
    """Two engines (Ray replicas) append to one log, their steps interleaved in time: each one's
    period is the gap to its own next step, not to the other's."""
    path = tmp_path / "steps.jsonl"
    rows = _steps(101, 0.0, 30) + _steps(202, 0.005, 30)
    path.write_text("\n".join(map(json.dumps, sorted(rows, key=lambda r: r["start_time"]))) + "\n")
    assert fit_step_log(str(path)).predict(100, 1, 0) == pytest.approx(0.020 + 0.1, rel=0.02)


def test_step_logs_of_two_workers_make_one_model(tmp_path):
    """A prefill and a decode worker's logs (`--step-log A B`): one model fitted on both, each
    file's gaps its own (the second worker's clock runs 5 ms into the first one's steps)."""
    a, b = tmp_path / "steps.prefill.jsonl", tmp_path / "steps.decode.jsonl"
    a.write_text("\n".join(map(json.dumps, _steps(1, 0.0, 3))) + "\n")
    b.write_text("\n".join(map(json.dumps, _steps(1, 0.005, 6))) + "\n")
    with pytest.raises(ValueError, match="3 steps"):
        fit_step_log(str(a))
    assert fit_step_log([str(a), str(b)]).predict(100, 1, 0) == pytest.approx(0.020 + 0.1, rel=0.02)


def test_simulate_fits_several_step_logs(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(map(json.dumps, _steps(1, 0.0, 6))) + "\n")
    b.write_text("\n".join(map(json.dumps, _steps(2, 0.0, 6))) + "\n")
    rc = main(["simulate", "--step-log", str(a), str(b), "--num-prompts", "4", "--random-input-len", "32",
               "--random-output-len", "4", "--replicas", "2", "--router", "prefix-aware"])
    assert rc == 0
    assert f"fitted on the steps in {a} {b}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    ([], "give one step-time model"),
    (["--gpu", "h100", "--cost-model", "x.json"], "--cost-model and --gpu"),
    (["--cost-model", "/nonexistent/cost.json"], "No such file or directory"),
    (["--gpu", "h100", "--goodput", "ttft"], "--goodput takes NAME:MS"),
    (["--gpu", "h100", "--prefill-replicas", "1"], "go together"),
    (["--gpu", "h100", "--search"], "--search needs --goodput"),
    (["--gpu", "h100", "--search", "--goodput", "ttft:10", "--machines", "2,x"], "--machines"),
    (["--gpu", "h100", "--request-rate", "0"], "must be positive"),
    (["--gpu", "h100", "--dataset-name", "multi-turn"], "--trace"),
    (["--gpu", "h100", "--trace", "TRACE"], "prompt_len must be an integer"),
    (["--gpu", "h100", "--mfu", "2"], "--mfu"),
    (["--gpu", "h100", "--replicas", "0"], "must be >= 1"),
    (["--cost-model", "BADJSON"], "not JSON"),
    (["--gpu", "h100", "--prefill-cost-model", "x.json"], "need --prefill-replicas"),
    (["--gpu", "h100", "--router-latency-ms", "-1"], "--router-latency-ms must be >= 0"),
    (["--gpu", "h100", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
     "does not model speculative decoding"),
    (["--gpu", "h100", "--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-cost-model", "x.json",
      "--prefill-step-log", "y.jsonl"], "not both"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival": 0, "prompt_len": "x", "output_len": 1}\n')
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    argv = [str(trace) if a == "TRACE" else str(bad) if a == "BADJSON" else a for a in argv]
    try:
        rc = main(["simulate", *argv])
    except SystemExit as e:   # argparse's own checks: the CLI's error line and a pointer to --help
        rc = e.code
    assert rc == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("pdserve simulate: error:") and message in lines[0], lines
    assert lines[1:] in ([], ["(see `pdserve simulate --help`)"])
