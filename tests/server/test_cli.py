"""What a new user meets first: one-line errors (exit 2) for bad flags, files and devices, the
model as a positional argument, the port checked before the model loads, --version, defaults
in --help, colour only on a terminal, the capacity line in the startup log."""
import argparse
import os
import socket
import subprocess
import sys

import httpx
import pytest
import torch

from pdserve.entrypoints import serve_args


def pdserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(out: subprocess.CompletedProcess, *words: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and 1 <= len(lines) <= 2, out.stderr   # the error, and a --help hint
    assert lines[0].startswith("pdserve"), lines
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("args,words", [
    (["serve", "--max-body-bytes", "-1"], ["--max-body-bytes", ">= 1"]),
    (["serve", "--max-waiting", "many"], ["--max-waiting", "many"]),
    (["serve", "--port", "99999"], ["--port"]),
    (["serve", "--no-such-flag"], ["--no-such-flag"]),
    (["report", "missing.json"], ["missing.json"]),
    (["serve", "--model", "/nonexistent/dir"], ["/nonexistent/dir"]),
    (["serve", "--ray", "--disaggregate"], ["--ray", "--disaggregate"]),
    (["--bogus"], ["--bogus"]),
    (["--bogus", "serve"], ["--bogus"]),
])
def test_bad_input_is_one_line(args, words):
    assert_one_line_error(pdserve(*args), *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line(tiny_llama):
    assert_one_line_error(pdserve("serve", tiny_llama, "--device", "cuda"), "cuda")


def test_max_model_len_beyond_the_model_is_refused(tiny_llama):
    assert_one_line_error(pdserve("serve", tiny_llama, "--max-model-len", "100000"), "100000", "1024")


def test_a_taken_port_is_reported_before_the_model_loads(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = pdserve("serve", tiny_llama, "--port", str(taken.getsockname()[1]))
    assert_one_line_error(out, "cannot listen", "in use")
    assert "loading" not in out.stderr


def test_version():
    from pdserve import __version__
    out = pdserve("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"pdserve {__version__}"


def test_help_shows_every_default():
    parser = argparse.ArgumentParser()
    serve_args.add_arguments(parser)
    for action in parser._actions:
        if action.default not in (None, argparse.SUPPRESS, False) and action.help != argparse.SUPPRESS:
            assert "default" in (action.help or ""), action.option_strings
    out = pdserve("serve", "--help").stdout
    for flag in ("--block-size", "--max-num-batched-tokens", "--max-num-seqs", "--seed"):
        assert flag in out
    assert "(default: 16)" in out and "(default: 512)" in out and "(default: 64)" in out


def test_model_as_positional_argument_and_the_startup_log(start_server, tiny_llama):
    server = start_server(None, tiny_llama)   # `pdserve serve DIR`, vLLM's habit
    r = httpx.get(server.url + "/v1/models").json()
    assert r["data"][0]["id"] == os.path.basename(tiny_llama)
    log = server.log()
    for words in ("dtype float32", "threads", "KV cache", "sequences at the full 1024 tokens", "memory"):
        assert words in log, (words, log[-2000:])
    out = pdserve("serve", tiny_llama, "--model", tiny_llama + "-other")
    assert_one_line_error(out, "two models")


def test_generate_prints_colour_only_on_a_terminal(tiny_llama):
    out = pdserve("generate", "Hello", "--model", tiny_llama, "--max-tokens", "3")
    assert out.returncode == 0 and out.stdout.startswith("Hello") and "\033[" not in out.stdout


def test_a_command_whose_extra_is_missing_says_which_to_install(monkeypatch, capsys):
    """`pip install pdserve` has no httpx or transformers: bench and the hf backend name their extra."""
    import sys

    from pdserve.cli import main as cli_main
    for name in [m for m in sys.modules if m == "httpx" or m.startswith(("httpx.", "pdserve.bench"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "httpx", None)   # importing it now raises ModuleNotFoundError
    assert cli_main(["bench", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pdserve[bench]" in err and "httpx" in err
