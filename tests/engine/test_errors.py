"""Bad checkpoints and bad requests give one-line errors that say what is wrong."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from pdserve import LLM, SamplingParams
from pdserve.errors import CheckpointError, RequestError


@pytest.fixture
def ckpt(tiny_llama, tmp_path):
    """A writable copy of a good checkpoint, to break."""
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("breakage, expected", [
    (lambda d: os.remove(d / "config.json"), "config.json: missing"),
    (lambda d: (d / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    (lambda d: edit_config(d, architectures=["GPT2LMHeadModel"]), "unsupported architecture ['GPT2LMHeadModel']"),
    (lambda d: edit_config(d, architectures=["CustomForCausalLM"], auto_map={"AutoModel": "x.Model"}),
     "runs no code from checkpoints"),
    (lambda d: os.remove(d / "model.safetensors"), "model.safetensors: missing"),
    (lambda d: os.remove(d / "tokenizer.json"), "tokenizer.json"),
    (lambda d: edit_config(d, intermediate_size=96), "implies"),
    (lambda d: edit_config(d, num_hidden_layers=3), "missing tensor 'model.layers.2"),
    (lambda d: edit_config(d, num_key_value_heads=3), "not a multiple"),
    (lambda d: edit_config(d, rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}),
     "'proportional' is not supported"),
    (lambda d: edit_config(d, rope_parameters={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
     "short_factor must be 8 positive numbers"),
    (lambda d: edit_config(d, rope_parameters={"rope_type": "yarn"}), "'yarn' needs 'factor'"),
])
def test_bad_checkpoint(ckpt, breakage, expected):
    breakage(ckpt)
    with pytest.raises(CheckpointError) as e:
        LLM(str(ckpt))
    msg = str(e.value)
    assert expected in msg and "\n" not in msg


def test_shape_error_names_tensor_and_file(ckpt):
    edit_config(ckpt, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' "
                                              r"has shape"):
        LLM(str(ckpt))


def test_cli_prints_one_line(ckpt):
    os.remove(ckpt / "model.safetensors")
    r = subprocess.run([sys.executable, "-m", "pdserve", "generate", "hello", "--model", str(ckpt)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.safetensors: missing" in lines[0], r.stderr


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_model_len=128, num_kv_blocks=6, block_size=16)


@pytest.mark.parametrize("prompt, params, param, text", [
    ("", SamplingParams(), "prompt", "empty"),
    ([], SamplingParams(), "prompt", "empty"),
    ([5, 10**6], SamplingParams(), "prompt", "outside the vocabulary"),
    ([5] * 128, SamplingParams(), "prompt", "maximum context length is 128"),
    ([5] * 100, SamplingParams(max_tokens=40), "max_tokens", "100 tokens) + max_tokens (40) = 140"),
    ([5] * 60, SamplingParams(max_tokens=40), "max_tokens", "whole KV cache (96 tokens)"),
])
def test_bad_request_is_refused_before_admission(llm, prompt, params, param, text):
    with pytest.raises(RequestError) as e:
        llm.generate([prompt], params)
    assert e.value.param == param and text in str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_admits_none(llm):
    with pytest.raises(RequestError):
        llm.generate([[5, 6], [7] * 500], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.block_manager.check_all_free()
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_generate_cli(tiny_llama):
    r = subprocess.run([sys.executable, "-m", "pdserve", "generate", "Once upon", "a time", "--model", tiny_llama,
                        "--max-tokens", "5", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == ["Once upon", "a time"]
    assert all(len(row["token_ids"]) == 5 and row["finish_reason"] == "length" for row in rows)
