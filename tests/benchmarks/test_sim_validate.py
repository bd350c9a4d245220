"""benchmarks/sim_validate.py: the deployments' step logs and the 1P1D hand-off's KV flags, on
made-up metrics and logs."""
import json

import pytest

from benchmarks import sim_hops as hops, sim_validate as sv


def metrics(n, pull_s, nbytes, proxy_prefill, prefill_ttft, proxy_decode, decode_ttft, decode_tpot):
    """Totals of n requests as handoff_metrics scrapes them (per-request means given)."""
    h = lambda name, mean: {f"{name}_sum": n * mean, f"{name}_count": n}   # noqa: E731
    return {"proxy": {**h("pdserve:proxy_prefill_seconds", proxy_prefill),
                      **h("pdserve:proxy_decode_ttft_seconds", proxy_decode)},
            "prefill": h(hops.TTFT, prefill_ttft),
            "decode": {**h(hops.TTFT, decode_ttft), **h(hops.TPOT, decode_tpot), "pdserve:kv_transfers_total": n,
                       "pdserve:kv_transfer_seconds_total": n * pull_s, "pdserve:kv_transfer_bytes_total": n * nbytes}}


def test_handoff_is_the_pull_the_proxys_calls_and_the_decode_admission():
    before = metrics(2, 0.5, 1e6, 9.0, 9.0, 9.0, 9.0, 0.5)   # the warm-up: left out of the run's means
    after = {w: {k: before[w][k] + v for k, v in m.items()}
             for w, m in metrics(10, 0.003, 1e6, 0.050, 0.040, 0.030, 0.020, 0.004).items()}
    h = hops.handoff(before, after, link_gb_s=1.0)
    # 1 MB at 1 GB/s is 1 ms of the 3 ms pull; the calls took 10 + 10 ms beyond the workers' TTFT;
    # the decode worker's TTFT is 20 ms: 3 ms pull, 4 ms step, 13 ms admission
    assert h["requests"] == 10 and h["bandwidth_gb_s"] == pytest.approx(1.0)
    assert h["pull_latency_ms"] == pytest.approx(2.0)
    assert h["proxy_overhead_ms"] == pytest.approx(20.0)
    assert h["decode_admission_ms"] == pytest.approx(13.0)
    assert h["latency_ms"] == pytest.approx(35.0)
    # a link measured slower than the run's own pulls: their rate, no fixed part
    slow = hops.handoff(before, after, link_gb_s=0.1)
    assert slow["bandwidth_gb_s"] == pytest.approx(1e6 / 0.003 / 1e9) and slow["pull_latency_ms"] == 0.0
    assert hops.handoff(before, before, 1.0) is None   # no requests in between


def test_deployments_step_logs_and_their_fits(tmp_path):
    one = sv.DEPLOYMENTS["1p1d"]
    path = str(tmp_path / "run-steps.jsonl")
    logs = one.step_logs(path)
    assert logs == [str(tmp_path / "run-steps.prefill.jsonl"), str(tmp_path / "run-steps.decode.jsonl")]
    assert sv.DEPLOYMENTS["ray2"].step_logs(path) == [path]   # the replicas share it (each line has its pid)
    line = json.dumps({"start_time": 0, "duration": 0.01, "num_seqs": 1, "num_prefill_tokens": 9,
                       "num_decode_tokens": 0})
    (tmp_path / "run-steps.prefill.jsonl").write_text((line + "\n") * 3)
    assert sv.steps_flags(logs, one.roles) == ["--step-log", *logs]   # too few prefill steps: one model
    (tmp_path / "run-steps.prefill.jsonl").write_text((line + "\n") * 4)
    assert sv.steps_flags(logs, one.roles) == ["--step-log", logs[1], "--prefill-step-log", logs[0]]
    assert sv.steps_flags([path], ()) == ["--step-log", path]
