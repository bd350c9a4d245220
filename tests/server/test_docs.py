"""Every curl example in docs/API.md and README.md works as written (pointed at the test server's port)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DOC = os.path.join(ROOT, "docs", "API.md")
README = os.path.join(ROOT, "README.md")


def curl_examples(path: str) -> list[str]:
    with open(path) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    commands = []
    for block in blocks:
        if "pdserve serve" in block or "curl " not in block:   # starts a server / installs: not runnable here
            continue
        expect_error = "# -> 4" in block
        # one command per `curl`, with its continuation lines; comments are expected output
        for cmd in re.split(r"\n(?=curl )", "\n".join(l for l in block.splitlines() if not l.startswith("#"))):
            if cmd.strip():
                commands.append((cmd.strip(), expect_error))
    return commands


EXAMPLES = curl_examples(DOC) + curl_examples(README)


@pytest.mark.parametrize("doc", [DOC, README])
def test_the_docs_have_examples_for_every_endpoint(doc):
    text = " ".join(cmd for cmd, _ in curl_examples(doc))
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/basic_generate", "/generate ",
                 "/generate_stream", "/tokenize", "/detokenize", "/health", "/version", "/metrics"):
        assert "127.0.0.1:8000" + path.strip() in text, path


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
@pytest.mark.parametrize("cmd,expect_error", EXAMPLES, ids=[f"{i}" for i in range(len(EXAMPLES))])
def test_curl_example_works(server, cmd, expect_error):
    cmd = cmd.replace("http://127.0.0.1:8000", server.url)
    out = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    # an error object (a Responses API body has "error": null when there is none)
    assert bool(re.search(r'"error":\s*\{', out.stdout)) == expect_error, out.stdout[:2000]


def test_python_client_example_works(server):
    with open(DOC) as f:   # the examples run in order, as one session: later ones use the first's client
        code = "\n".join(re.findall(r"```python\n(.*?)```", f.read(), re.S))
    code = code.replace("http://127.0.0.1:8000", server.url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout) > 10
