"""--step-log writes one JSON line per engine step, consistent with /metrics."""
import json

import httpx


def test_step_log_lines_match_the_step_metrics(server):
    before = server.metrics()["pdserve:step_num_seqs_count"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 6,
                                                         "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    m = server.wait_for(lambda m: m["pdserve:step_num_seqs_count"] >= before + 6)
    with open(server.step_log) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == m["pdserve:step_num_seqs_count"]
    assert sum(row["num_decode_tokens"] for row in rows) == m["pdserve:step_decode_tokens_sum"]
    assert all(row["duration"] >= row["forward_time"] > 0 and row["num_seqs"] >= 1 for row in rows)
    assert {row["pid"] for row in rows} == {server.proc.pid}   # engines sharing a log tell their lines apart
