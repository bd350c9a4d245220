"""`python -m tools.widen_model`: a wider checkpoint of the same function (what the speculative
decoding benchmark's 0.5B-shaped model rests on)."""
import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open

from pdserve import LLM, SamplingParams
from tools.widen_model import main as widen_main
from tools.widen_model import unk_token_id, widen_dir

WIDE = dict(hidden=128, inter=384, layers=4)   # tiny llama: hidden 64, 4 heads of 16, 2 KV heads


@pytest.fixture(scope="module", params=["untied", "tied"])
def small(request, make_tiny):
    return make_tiny("llama", tie_word_embeddings=request.param == "tied")


@pytest.fixture(scope="module")
def widened(small, tmp_path_factory):
    with open(os.path.join(small, "config.json")) as f:
        vocab = json.load(f)["vocab_size"] + 100
    out = str(tmp_path_factory.mktemp("wide"))
    widen_dir(small, out, WIDE["hidden"], WIDE["inter"], WIDE["layers"], vocab)
    return out


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_wider_shapes(widened):
    with open(os.path.join(widened, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (128, 384, 4)
    assert cfg["num_attention_heads"] == 8 and cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    with safe_open(os.path.join(widened, "model.safetensors"), "pt") as f:
        assert tuple(f.get_tensor("model.layers.3.mlp.up_proj.weight").shape) == (384, 128)
        assert tuple(f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape) == (32, 128)
        # extra layers are identities, but their other matrices are random, as a model's are
        assert not f.get_tensor("model.layers.3.self_attn.o_proj.weight").any()
        assert f.get_tensor("model.layers.3.self_attn.q_proj.weight").std() > 0


def test_same_logits_as_the_small_model(small, widened):
    small_dir, (small, wide) = small, (load(small), load(widened))
    ids = torch.randint(3, small.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = small(ids).logits, wide(ids).logits
    v = small.config.vocab_size
    torch.testing.assert_close(b[..., :v], a, atol=2e-4, rtol=1e-4)
    # the extra vocabulary rows score as <unk>
    unk = unk_token_id(small_dir)
    assert torch.equal(b[..., v:], b[..., unk:unk + 1].expand_as(b[..., v:]))


def test_pdserve_greedy_tokens_equal(small, widened):
    prompts = ["Once upon a time", "The little dog ran to the"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    small = [o.token_ids for o in LLM(small).generate(prompts, params)]
    wide = [o.token_ids for o in LLM(widened).generate(prompts, params)]
    assert wide == small


def test_refuses_what_it_cannot_widen(tiny_llama, tiny_qwen2, tmp_path, capsys):
    with pytest.raises(ValueError, match="cannot widen"):
        widen_dir(tiny_llama, str(tmp_path / "a"), 32, 384, 4, 5000)   # narrower
    with pytest.raises(ValueError, match="not a multiple of head_dim"):
        widen_dir(tiny_llama, str(tmp_path / "b"), 120, 384, 4, 5000)
    with pytest.raises(SystemExit) as e:
        widen_main([tiny_qwen2, str(tmp_path / "c")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "written for Llama checkpoints" in err and len(err.strip().splitlines()) == 1
