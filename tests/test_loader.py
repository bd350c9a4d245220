"""The loader fills merged linears (q/k/v, gate/up) from the separate HF tensors, and a missing or
misshapen shard is named by its checkpoint name."""
import io
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.loader import load_model


def _load(path):
    return load_model(ModelConfig.from_dir(str(path)), torch.float32, "cpu")


@pytest.mark.parametrize("arch", ["qwen2", "opt"])
def test_shards_land_in_their_rows(arch, tiny_qwen2, tiny_opt):
    path = {"qwen2": tiny_qwen2, "opt": tiny_opt}[arch]
    tensors = load_file(f"{path}/model.safetensors")
    model = _load(path)
    prefix = "model.layers.0" if arch == "qwen2" else "model.decoder.layers.0"
    attn = model.get_submodule(prefix + ".self_attn")
    want = [tensors[f"{prefix}.self_attn.{n}_proj.{p}"]
            for p in ("weight", "bias") for n in "qkv"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat(want[:3]))
    assert torch.equal(attn.qkv_proj.bias, torch.cat(want[3:]))
    if arch == "qwen2":
        mlp = model.get_submodule(prefix + ".mlp")
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([tensors[f"{prefix}.mlp.gate_proj.weight"],
                                                               tensors[f"{prefix}.mlp.up_proj.weight"]]))


def _edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    edit(tensors)
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_shard_is_named(tiny_qwen2, tmp_path):
    path = _edited_copy(tiny_qwen2, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.self_attn.k_proj.weight'"):
        _load(path)


def test_misshapen_shard_is_named(tiny_qwen2, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]
    path = _edited_copy(tiny_qwen2, tmp_path / "m", edit)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.up_proj.weight' has shape"):
        _load(path)


@pytest.mark.parametrize("terminal", [False, True])
def test_the_loading_bar_shows_only_on_a_terminal(make_tiny, monkeypatch, terminal):
    # tqdm's carriage returns would fill a server log written to a file
    path = make_tiny("llama", num_hidden_layers=6)   # over the 50 tensors that get a bar
    err = io.StringIO()
    monkeypatch.setattr(err, "isatty", lambda: terminal)
    monkeypatch.setattr(sys, "stderr", err)
    _load(path)
    assert ("\r" in err.getvalue()) == terminal, repr(err.getvalue()[:200])


def test_layer_windows_follow_transformers_rules(make_tiny, tmp_path):
    """Which layers slide: the config's layer_types, else Qwen2's max_window_layers (the
    transformers-4 spelling has no layer_types), else every layer (Mistral)."""
    import json
    import shutil
    from pdserve.config import ModelConfig
    qwen = make_tiny("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert ModelConfig.from_dir(qwen).layer_windows == [None, 16]
    old = tmp_path / "qwen2-tf4"
    shutil.copytree(qwen, old)
    raw = json.loads((old / "config.json").read_text())
    del raw["layer_types"]
    (old / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_dir(str(old)).layer_windows == [None, 16]
    raw["use_sliding_window"] = False
    (old / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_dir(str(old)).layer_windows == [None, None]
    assert ModelConfig.from_dir(make_tiny("mistral", sliding_window=16)).layer_windows == [16, 16]
