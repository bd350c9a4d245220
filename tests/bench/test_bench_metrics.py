"""The metric arithmetic of `pdserve bench` on made-up timestamps (vLLM's definitions)."""
import numpy as np
import pytest

from pdserve.bench.bench_metrics import (RequestResult, compute_metrics, objectives_for, parse_goodput, parse_slo_mix,
                                         stats_ms)


def ok(ttft, itl, tokens, prompt_len=10, kind=None):
    return RequestResult(prompt_len=prompt_len, output_tokens=tokens, ttft=ttft, itl=list(itl),
                         latency=ttft + sum(itl), success=True, kind=kind)


def failed(error="HTTP 500: boom", prompt_len=7):
    return RequestResult(prompt_len=prompt_len, error=error)


def test_tpot_excludes_the_first_token_and_uses_the_server_token_count():
    # 3 chunks carried 5 tokens: TPOT divides the time after the first chunk by tokens - 1
    r = ok(0.100, [0.020, 0.030], tokens=5)
    assert r.tpot == pytest.approx(0.050 / 4)
    assert ok(0.1, [], tokens=1).tpot is None   # one token: no TPOT at all
    assert failed().tpot is None


def test_metrics_of_a_mixed_run():
    results = [ok(0.100, [0.020, 0.030, 0.050], tokens=4, prompt_len=12),
               ok(0.050, [], tokens=1, prompt_len=8),
               failed()]
    m = compute_metrics(results, duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (20, 5)   # the failed one adds nothing
    assert m["request_throughput"] == 1.0
    assert m["output_throughput"] == 2.5 and m["total_token_throughput"] == 12.5
    assert m["request_goodput"] is None   # no SLOs given
    # TTFT and E2EL over the two successes only
    assert m["mean_ttft_ms"] == pytest.approx(75.0) and m["median_ttft_ms"] == pytest.approx(75.0)
    assert m["mean_e2el_ms"] == pytest.approx((200 + 50) / 2)
    # TPOT only from the request with more than one token: 100 ms over 3 tokens after the first
    assert m["mean_tpot_ms"] == pytest.approx(100 / 3) and m["p99_tpot_ms"] == pytest.approx(100 / 3)
    # ITL pooled over requests; percentiles interpolate linearly (numpy's default, as vLLM)
    assert m["mean_itl_ms"] == pytest.approx(100 / 3)
    assert m["median_itl_ms"] == pytest.approx(30.0)
    assert m["p90_itl_ms"] == pytest.approx(30 + 0.8 * 20)
    assert m["p99_itl_ms"] == pytest.approx(30 + 0.98 * 20)
    # per-request lists keep every request, in send order, failures included with their error
    assert m["input_lens"] == [12, 8, 7]
    assert m["output_lens"] == [4, 1, 0]
    assert m["ttfts"] == [0.100, 0.050, 0.0]
    assert m["itls"] == [[0.020, 0.030, 0.050], [], []]
    assert m["errors"] == ["", "", "HTTP 500: boom"]


def test_goodput_counts_only_requests_meeting_every_slo():
    fast_first = ok(0.050, [0.100, 0.100], tokens=3)    # TTFT 50 ms, TPOT 100 ms, E2EL 250 ms
    fast_decode = ok(0.300, [0.010, 0.010], tokens=3)   # TTFT 300 ms, TPOT 10 ms, E2EL 320 ms
    one_token = ok(0.080, [], tokens=1)                 # TPOT counts as 0, as in vLLM
    results = [fast_first, fast_decode, one_token, failed()]
    good = lambda slos: compute_metrics(results, 1.0, parse_goodput(slos))["request_goodput"]
    assert good(["ttft:100"]) == 2            # fast_first, one_token
    assert good(["tpot:20"]) == 2             # fast_decode, one_token
    assert good(["ttft:100", "tpot:20"]) == 1  # must meet both: only one_token
    assert good(["e2el:300"]) == 2            # fast_first (250), one_token (80)
    assert good(["ttft:1000", "tpot:1000", "e2el:1000"]) == 3   # never the failed one
    assert compute_metrics(results, 4.0, {"ttft": 100.0})["request_goodput"] == 0.5   # per second


def test_all_failed_gives_zero_statistics_and_keeps_the_errors():
    m = compute_metrics([failed("ConnectError: refused"), failed("HTTP 400: too long")], 1.0)
    assert (m["completed"], m["failed"]) == (0, 2)
    assert m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0 and m["total_output_tokens"] == 0
    assert m["errors"] == ["ConnectError: refused", "HTTP 400: too long"]


def test_kinds_get_their_own_statistics():
    results = [ok(0.01, [0.010] * 4, 5, kind="short"), ok(0.01, [0.200] * 4, 5, kind="short"),
               ok(0.50, [0.010] * 4, 5, kind="long"), failed()]
    m = compute_metrics(results, 1.0)
    assert m["short_completed"] == 2 and m["long_completed"] == 1
    assert m["short_median_itl_ms"] == pytest.approx(105.0)
    assert m["short_p99_itl_ms"] == pytest.approx(200.0)
    assert m["long_mean_ttft_ms"] == pytest.approx(500.0)
    assert m["request_kinds"] == ["short", "short", "long", None]
    assert "request_kinds" not in compute_metrics(results[3:], 1.0)


def test_percentiles_match_numpy():
    v = list(np.arange(1, 101) / 1000)   # 1..100 ms
    s = stats_ms("x", v)
    assert s["median_x_ms"] == pytest.approx(50.5)
    assert s["p90_x_ms"] == pytest.approx(90.1)
    assert s["p99_x_ms"] == pytest.approx(99.01)
    assert s["mean_x_ms"] == pytest.approx(50.5)
    assert s["std_x_ms"] == pytest.approx(np.std(np.arange(1, 101)))


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:-1", "tpot:fast"])
def test_parse_goodput_rejects_bad_pairs(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_goodput(None) == {}


def test_parse_slo_mix_and_lookup():
    mix = parse_slo_mix(["short:2000:150:0", "long:30000:1000:1", "*:5000:500"])
    assert mix["short"] == {"ttft": 2000.0, "tpot": 150.0, "priority": 0}
    assert mix["long"]["priority"] == 1 and mix["*"]["priority"] == 0
    assert objectives_for(mix, "long") is mix["long"] and objectives_for(mix, None) is mix["*"]
    assert objectives_for(parse_slo_mix(["short:1:1"]), "long") is None


@pytest.mark.parametrize("bad", ["short", "short:1", "short:x:1", ":1:1", "short:0:5", "short:1:1:high"])
def test_parse_slo_mix_rejects(bad):
    with pytest.raises(ValueError, match="--slo-mix"):
        parse_slo_mix([bad])


def test_attainment_by_each_requests_own_targets():
    tight, loose = {"ttft": 100.0, "tpot": 10.0}, {"ttft": 5000.0, "tpot": 500.0}
    rs = [ok(0.05, [0.005] * 4, 5, kind="short"),    # meets tight
          ok(0.50, [0.005] * 4, 5, kind="short"),    # TTFT 500 ms misses tight
          ok(0.05, [0.050] * 4, 5, kind="short"),    # TPOT 50 ms misses tight
          ok(2.00, [0.200] * 4, 5, kind="long"),     # meets loose
          failed()]                                   # refused or failed: a miss
    for r, slo in zip(rs, [tight, tight, tight, loose, loose]):
        r.slo_ms = slo
    rs[-1].kind = "long"
    res = compute_metrics(rs + [ok(9.0, [], 1)], duration=2.0)   # one sent without targets: not counted
    assert res["slo_ttft_attainment"] == pytest.approx(3 / 5) and res["slo_tpot_attainment"] == pytest.approx(3 / 5)
    assert res["slo_attainment"] == pytest.approx(2 / 5) and res["slo_goodput"] == pytest.approx(1.0)
    assert res["short_slo_attainment"] == pytest.approx(1 / 3) and res["long_slo_attainment"] == pytest.approx(1 / 2)
    assert "slo_attainment" not in compute_metrics([ok(0.1, [], 1)], duration=1.0)
