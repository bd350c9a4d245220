"""Model files are read only from the directory given at start: no file a checkpoint names by
`..` or an absolute path, no symlink out of it, no hub, no remote code."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors import safe_open

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.loader import weight_files
from pdserve.tokenizer import Tokenizer

OUTSIDE = "outside the checkpoint directory"


@pytest.fixture
def ckpt(tiny_llama, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, d)
    return d


def shard_index(d, shard_name: str) -> None:
    """Replace model.safetensors by an index whose one shard is `shard_name`."""
    with safe_open(d / "model.safetensors", "pt") as f:
        names = list(f.keys())
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard_name for n in names}}))


@pytest.mark.parametrize("where", ["dotdot", "absolute"])
def test_a_shard_outside_the_directory_is_refused(ckpt, tmp_path, where):
    real = tmp_path / "elsewhere.safetensors"
    shutil.copy(ckpt / "model.safetensors", real)   # a loadable file: only the check can refuse it
    shard_index(ckpt, "../elsewhere.safetensors" if where == "dotdot" else str(real))
    with pytest.raises(CheckpointError, match=OUTSIDE):
        weight_files(str(ckpt))
    shard_index(ckpt, "model.safetensors")
    assert weight_files(str(ckpt)) == [str(ckpt / "model.safetensors")]


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json", "tokenizer.json",
                                  "generation_config.json", "config.json", "model.safetensors"])
def test_a_symlink_out_of_the_directory_is_refused(ckpt, tmp_path, name):
    # e.g. a template linked to a secret would render it into every chat prompt
    secret = tmp_path / "secret"
    if (ckpt / name).exists():
        shutil.move(ckpt / name, secret)
    else:
        secret.write_text("{{ 'the operator password' }}")
    os.symlink(secret, ckpt / name)
    with pytest.raises(CheckpointError, match=OUTSIDE) as e:
        LLM(str(ckpt))
    assert name in str(e.value) and "\n" not in str(e.value)


def test_symlinks_inside_the_directory_and_an_hf_cache_snapshot_load(ckpt, tmp_path):
    os.rename(ckpt / "tokenizer.json", ckpt / "tok.json")
    os.symlink("tok.json", ckpt / "tokenizer.json")   # relative, inside: fine
    assert Tokenizer.from_dir(str(ckpt)).vocab_size > 0
    # the Hugging Face cache layout: snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(os.listdir(ckpt))):
        if f == "tokenizer.json":
            continue
        shutil.copy(ckpt / f, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / ("tokenizer.json" if f == "tok.json" else f))
    out = LLM(str(snap)).generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_no_hub_and_no_transformers(tiny_llama):
    with pytest.raises(CheckpointError, match="not a directory"):
        ModelConfig.from_dir("Qwen/Qwen2.5-0.5B")   # a hub name is just a missing directory
    code = ("import sys; from pdserve import LLM; LLM(sys.argv[1]);"
            "print(sorted(m for m in ('transformers', 'huggingface_hub', 'requests') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, tiny_llama], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_remote_code_is_refused_in_one_line(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": ["CustomForCausalLM"],
                                                  "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}))
    for args in (["--model", str(ckpt)], ["--trust-remote-code"]):
        r = subprocess.run([sys.executable, "-m", "pdserve", "serve", *args, "--port", "1"],
                           capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "runs no code from checkpoints" in lines[0] or "never runs code from checkpoints" in lines[0]
        assert ("auto_map" if args[0] == "--model" else "--trust-remote-code is not supported") in lines[0]


def test_remote_code_of_a_built_in_architecture_is_never_run(tiny_llama, tmp_path, caplog):
    """Phi-3's checkpoints still carry the auto_map of before transformers had the family: a built-in
    architecture is served by pdserve's own class (as transformers does without trust_remote_code),
    with a warning; the checkpoint's code is never imported."""
    import logging
    import shutil
    from pdserve.config import ModelConfig
    ckpt = tmp_path / "with-auto-map"
    shutil.copytree(tiny_llama, ckpt)
    (ckpt / "modeling_x.py").write_text("raise SystemExit('remote code ran')\n")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}))
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        assert ModelConfig.from_dir(str(ckpt)).architecture == "LlamaForCausalLM"
    assert any("never runs" in r.getMessage() for r in caplog.records)
