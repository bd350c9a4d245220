"""`pdserve bench` against a live tiny server: the JSON is complete and its token counts are
the server's own (checked against the /metrics counters), and `pdserve report` draws the run."""
import json
import subprocess
import sys

import httpx
import pytest

GEN, PROMPT = "pdserve:generation_tokens_total", "pdserve:prompt_tokens_total"
KEYS = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
        "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts",
        "itls", "errors"] + [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                              for s in ("mean", "median", "p90", "p99")]


def bench(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "pdserve", "bench", "--disable-tqdm", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    return p


def counters(server) -> tuple[float, float]:
    """Token counters of an idle server (tests run one at a time, so idle means nobody else's
    tokens can land between our two readings)."""
    m = server.wait_for(lambda m: m["pdserve:num_requests_running"] == m["pdserve:num_requests_waiting"] == 0)
    return m[GEN], m[PROMPT]


def test_random_run_matches_the_server_usage(server, tmp_path):
    gen0, prompt0 = counters(server)
    out = tmp_path / "r.json"
    p = bench("--base-url", server.url, "--num-prompts", "8", "--random-input-len", "24",
              "--random-output-len", "6", "--random-range-ratio", "0.5", "--request-rate", "40",
              "--max-concurrency", "3", "--seed", "11", "--goodput", "ttft:60000", "e2el:60000",
              "--label", "tiny", "--output", str(out), "--plot", str(tmp_path / "plots"))
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert not [k for k in KEYS if k not in res]
    assert (res["completed"], res["failed"], res["num_prompts"]) == (8, 0, 8)
    assert res["errors"] == [""] * 8 and res["label"] == "tiny"
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])   # SLOs of a minute: all good
    # lengths as asked (range ratio 0.5); ignore_eos makes every output run to its max_tokens
    assert all(12 <= n <= 36 for n in res["input_lens"]) and all(3 <= n <= 9 for n in res["output_lens"])
    assert sum(res["input_lens"]) == res["total_input_tokens"] and sum(res["output_lens"]) == res["total_output_tokens"]
    # the server counted exactly the tokens the JSON reports
    server.wait_for(lambda m: m[GEN] - gen0 >= res["total_output_tokens"])
    gen1, prompt1 = counters(server)
    assert (gen1 - gen0, prompt1 - prompt0) == (res["total_output_tokens"], res["total_input_tokens"])
    assert all(t > 0 for t in res["ttfts"])
    assert all(len(itl) <= n - 1 for itl, n in zip(res["itls"], res["output_lens"]))   # a chunk has >= 1 token
    assert res["p99_e2el_ms"] >= res["median_e2el_ms"] >= res["median_ttft_ms"] > 0
    assert (tmp_path / "plots" / "latency_cdf.png").exists()

    plots = tmp_path / "report"
    r = subprocess.run([sys.executable, "-m", "pdserve", "report", str(out), "--step-log", server.step_log,
                        "--out", str(plots)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert all((plots / n).read_bytes()[:4] == b"\x89PNG" for n in ("latency_cdf.png", "step_timeline.png"))


def test_file_prompts_and_a_failing_request(server, tmp_path):
    text = "Once upon a time"
    text_len = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["count"]
    rows = [{"prompt": [5, 6, 7, 8, 9], "max_tokens": 3}, {"prompt": text, "max_tokens": 4},
            {"prompt": [5] * 1000, "max_tokens": 100},   # over the 1024-token context: refused with a 400
            {"prompt": [10, 11, 12]}]                     # max_tokens from --random-output-len
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    gen0, prompt0 = counters(server)
    out = tmp_path / "f.json"
    bench("--base-url", server.url, "--dataset-path", str(path), "--ignore-eos", "--random-output-len", "2",
          "--num-warmups", "1", "--output", str(out))
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"]) == (3, 1) and res["completed"] + res["failed"] == len(rows)
    assert res["input_lens"] == [5, text_len, 1000, 3]
    assert res["output_lens"] == [3, 4, 0, 2]
    assert res["errors"][2].startswith("HTTP 400") and "1000" in res["errors"][2]
    assert res["errors"][:2] == ["", ""] and res["errors"][3] == ""
    assert res["itls"][2] == [] and res["ttfts"][2] == 0.0
    # the warmup (the file's first prompt) was sent too, but is not in the results
    server.wait_for(lambda m: m[GEN] - gen0 >= 9 + 3)
    gen1, prompt1 = counters(server)
    assert (gen1 - gen0, prompt1 - prompt0) == (9 + 3, res["total_input_tokens"] + 5)


def test_multi_turn_run_sends_the_growing_history(server, tmp_path):
    out = tmp_path / "m.json"
    p = bench("--base-url", server.url, "--dataset-name", "multi-turn", "--num-prompts", "2", "--num-turns", "3",
              "--random-output-len", "12", "--max-concurrency", "2", "--seed", "5", "--output", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"]) == (6, 0) and res["output_lens"] == [12] * 6
    turns = res["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["completed"] == 2 for t in turns)
    # each turn's prompt holds the one before it and its answer, which the prefix cache then serves
    assert turns[0]["mean_prompt_tokens"] + 12 < turns[1]["mean_prompt_tokens"] < turns[2]["mean_prompt_tokens"]
    assert turns[2]["prefix_cache_hit_rate"] > 0.3 and res["prefix_cache_hit_rate"] > 0
    assert res["later_turns_median_ttft_ms"] > 0 and "Per turn" in p.stdout
