"""The load generator's parts without a server: arrivals, stream parsing, and failures being counted."""
import argparse
import json
import math
import os
import socket

import numpy as np
import pytest

from pdserve.bench import report, serve_bench
from pdserve.bench.client import StreamRecorder, arrival_offsets
from pdserve.cli import main


def test_arrivals_have_mean_gap_one_over_rate():
    for burstiness in (1.0, 0.25, 4.0):
        t = arrival_offsets(20001, rate=4.0, burstiness=burstiness, seed=0)
        gaps = np.diff(t)
        assert t[0] == 0 and (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(0.25, rel=0.03)
        # Gamma with shape k: coefficient of variation 1/sqrt(k); 1 is Poisson
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_are_seeded():
    assert arrival_offsets(10, 2.0, 1.0, 5) == arrival_offsets(10, 2.0, 1.0, 5)
    assert arrival_offsets(10, 2.0, 1.0, 5) != arrival_offsets(10, 2.0, 1.0, 6)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(7, float("inf"), 1.0, 0) == [0.0] * 7
    assert len(arrival_offsets(1, 3.0, 1.0, 0)) == 1
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 1.0, 0)


def chunk(text="x", finish=None, usage=None, choices=True):
    event = {"id": "cmpl-1", "choices": [{"index": 0, "text": text, "finish_reason": finish}] if choices else []}
    if usage:
        event["usage"] = usage
    return "data: " + json.dumps(event)


def feed(rec, timed_lines):
    for t, line in timed_lines:
        if not rec.feed(line, t):
            break
    return rec


def test_stream_timings_come_from_token_chunks_and_counts_from_usage():
    rec = feed(StreamRecorder(sent=1.0), [
        (1.10, chunk("Once")), (1.10, ""), (1.12, ": ping"),
        (1.15, chunk("")),                      # a token whose text is empty still counts
        (1.30, chunk(" upon", finish="length")),
        (1.31, chunk(usage={"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}, choices=False)),
        (1.32, "data: [DONE]"), (9.99, chunk("after done"))])
    r = rec.result(prompt_len=None)
    assert r.success and r.error == ""
    assert r.ttft == pytest.approx(0.10) and r.latency == pytest.approx(0.30)   # usage chunk is not a token
    assert r.itl == pytest.approx([0.05, 0.15])
    assert (r.output_tokens, r.prompt_len) == (5, 9)   # the server's count, not the 3 chunks
    assert r.text == "Once upon"   # what --save-detailed writes


@pytest.mark.parametrize("lines, message", [
    ([chunk("a"), 'data: {"error": {"message": "engine died", "type": "server_error"}}'], "engine died"),
    ([chunk("a", finish="error")], "finish_reason: error"),
    ([chunk("a"), "data: [DONE]"], "include_usage"),
    ([chunk(usage={"completion_tokens": 0}, choices=False), "data: [DONE]"], "without a token"),
    (["data: {not json"], "unparsable"),
])
def test_stream_failures_keep_their_reason(lines, message):
    r = feed(StreamRecorder(sent=0.0), [(0.1 * i, line) for i, line in enumerate(lines, 1)]).result(prompt_len=4)
    assert not r.success and message in r.error and r.prompt_len == 4


def test_unreachable_server_counts_every_request_as_failed(tmp_path):
    with socket.socket() as s:   # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}) + "\n" for _ in range(3)))
    out = tmp_path / "r.json"
    rc = main(["bench", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--dataset-path", str(prompts),
               "--output", str(out), "--disable-tqdm"])
    res = json.loads(out.read_text())
    assert rc == 1 and (res["completed"], res["failed"]) == (0, 3)
    assert all(e.startswith("ConnectError") for e in res["errors"])
    assert res["input_lens"] == [3, 3, 3] and res["output_lens"] == [0, 0, 0]


def test_no_server_is_one_line_naming_the_url(capsys):
    with socket.socket() as s:   # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"]) == 2   # asks /v1/models
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"http://127.0.0.1:{port}" in err and "ConnectError" in err, err


def test_setup_errors_exit_2_before_sending(tmp_path, capsys):
    assert main(["bench", "--goodput", "latency:5", "--model", "m"]) == 2
    assert "--goodput" in capsys.readouterr().err
    assert main(["bench", "--dataset-path", str(tmp_path / "missing.jsonl"), "--model", "m"]) == 2
    assert main(["bench", "--max-concurrency", "0", "--model", "m", "--vocab-size", "10"]) == 2
    assert "--max-concurrency must be at least 1" in capsys.readouterr().err


def test_every_flag_is_documented():
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "BENCH_TOOL.md")).read()
    for module in (serve_bench, report):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        flags = [f for a in parser._actions for f in a.option_strings if f.startswith("--") and f != "--help"]
        assert [f for f in flags if f"`{f}`" not in doc] == [], module.__name__
