"""The soak at test size: 200 mixed requests, a fifth of the clients leaving early, a KV cache
small enough to preempt often. No timing thresholds: the machine is shared."""
from benchmarks import soak


def test_soak_loses_nothing_and_frees_everything(tiny_llama, tmp_path):
    s = soak.run_soak(tiny_llama, num_requests=200, concurrency=32, log_dir=str(tmp_path))
    assert s["failures"] == [] and s["ok"]
    # the run exercised what it claims to
    assert s["client_aborts"] > 0 and s["preemptions"] >= 10
    assert 0 < s["seeded"] < s["requests"] and 0 < s["streamed"] < s["requests"] and 0 < s["chat"] < s["requests"]
    # every request its client kept: a finish reason, and the same output as alone
    assert s["errors"] == 0 and s["unfinished"] == 0
    assert s["completed"] + s["client_aborts"] == s["requests"]
    assert s["verified"] == s["completed"] and s["mismatches"] == 0
    # idle: nothing running or waiting, no KV block held; memory back where it was
    assert not s["kv_leak"] and s["idle_after_load"] == {"num_requests_running": 0, "num_requests_waiting": 0,
                                                          "kv_cache_usage_perc": 0}
    assert abs(s["rss_kb"]["change_pct"]) <= 5
    assert s["engine_finished_by_reason"].get("error", 0) == 0


def test_only_a_near_tie_before_the_difference_excuses_it():
    tokens = [("ab", [-0.1, -3.0]), ("cd", [-1.0, -1.00001]), ("ef", [-0.5, -2.0])]
    assert soak.common_prefix("abcdef", "abcxyz") == 3
    assert soak.near_tie_before(tokens, 3)            # the tie is at the token where the texts part
    assert not soak.near_tie_before(tokens[:1] + tokens[2:], 3)
    far = [("x", [-0.1, -3.0])] * 20 + [("y", [-1.0, -1.0])]
    assert not soak.near_tie_before(far, 2)           # a tie long after the difference explains nothing
