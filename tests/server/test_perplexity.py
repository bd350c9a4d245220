"""`pdserve perplexity` against a real server equals transformers' perplexity guide computed on
the same checkpoint and tokens (fp32), with sliding windows; and docs/API.md's example runs."""
import json
import math
import os
import re
import subprocess
import sys

import httpx
import pytest
import torch

from pdserve.bench.perplexity import windows
from tests.helpers import hf_model
from tools.make_model import corpus_texts

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CONTEXT = 48


@pytest.fixture(scope="module")
def server(start_server, tiny_llama):
    return start_server(tiny_llama, "--dtype", "float32", "--max-model-len", str(CONTEXT),
                        "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "text.txt"
    path.write_text(" ".join(corpus_texts())[:700], encoding="utf-8")
    return str(path)


@torch.no_grad()
def hf_perplexity(path: str, ids: list[int], max_length: int, stride: int) -> tuple[float, int]:
    """transformers' perplexity guide (huggingface.co/docs/transformers/perplexity): mean NLL, tokens."""
    model, ids = hf_model(path), torch.tensor([ids])
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, ids.size(1), stride):
        end = min(begin + max_length, ids.size(1))
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        loss = model(input_ids, labels=target_ids).loss
        # the tokens the loss averages over: labels shift by one inside the model (the guide's
        # "valid tokens - batch size" is that count only for the first window)
        n = (target_ids[:, 1:] != -100).sum().item()
        nll_sum += loss.item() * n
        n_tokens += n
        prev_end = end
        if end == ids.size(1):
            break
    return nll_sum / n_tokens, n_tokens


def cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", "perplexity", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": os.path.abspath(ROOT)})


@pytest.mark.parametrize("max_length, stride", [(32, 8), (32, 32), (None, None)])
def test_perplexity_equals_transformers_guide(server, tiny_llama, text_file, max_length, stride):
    flags = [f for name, v in (("--max-length", max_length), ("--stride", stride)) if v for f in (name, str(v))]
    r = cli(text_file, "--base-url", server.url, "--json", *flags)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    ids = httpx.post(server.url + "/tokenize", json={"prompt": open(text_file).read()}).json()["tokens"]
    assert len(ids) > CONTEXT   # several windows
    if max_length is None:   # the server's context, less the one token a scored prompt leaves room for
        max_length, stride = CONTEXT - 1, (CONTEXT - 1) // 2
    assert (got["max_length"], got["stride"]) == (max_length, stride)
    nll, n = hf_perplexity(tiny_llama, ids, max_length, stride)
    assert got["tokens"] == n and got["windows"] == len(windows(len(ids), max_length, stride))
    assert abs(got["mean_nll"] - nll) < 1e-4
    assert got["perplexity"] == pytest.approx(math.exp(got["mean_nll"]))


def test_windows_score_each_token_once():
    for n, length, stride in [(10, 4, 2), (100, 16, 5), (17, 16, 16), (5, 8, 3), (33, 16, 16)]:
        spans = windows(n, length, stride)
        scored = [t for _, end, first in spans for t in range(first, end)]
        assert len(scored) == len(set(scored)) and all(end - begin <= length for begin, end, _ in spans)
        assert spans[-1][1] == n
        if stride < length:   # every token but the very first
            assert sorted(scored) == list(range(1, n))


def test_errors_are_one_line(server, text_file, tmp_path):
    r = cli(text_file, "--base-url", server.url, "--max-length", str(CONTEXT + 10))
    assert r.returncode == 2 and "maximum context length" in r.stderr and r.stderr.count("\n") == 1
    r = cli(text_file, "--base-url", server.url, "--max-length", "8", "--stride", "9")
    assert r.returncode == 2 and "--stride" in r.stderr
    r = cli(str(tmp_path / "missing.txt"), "--base-url", server.url)
    assert r.returncode == 2 and "missing.txt" in r.stderr


def test_the_docs_example_runs(server, tmp_path):
    doc = open(os.path.join(ROOT, "docs", "API.md")).read()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", doc, re.S) if "pdserve perplexity" in b)
    cmd = "\n".join(l for l in block.splitlines() if not l.startswith("#")).replace("http://127.0.0.1:8000", server.url)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": os.path.abspath(ROOT)}
    r = subprocess.run(["bash", "-c", f"set -e; {cmd}"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert re.search(r"perplexity:\s+\d", r.stdout) and re.search(r"tokens scored:\s+\d", r.stdout)
