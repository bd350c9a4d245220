"""A GGUF file converted by llama.cpp from a tiny HF checkpoint serves as that checkpoint does:
the config pdserve builds from its metadata, its tokenizer and chat template, and (F32) its
logits and greedy tokens against transformers on the HF checkpoint."""
import json
import os
import shutil
import sys

import pytest
import torch

from benchmarks import peers
from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.tokenizer import Tokenizer
from tests.gguf.conftest import PEERS_DIR
from tests.helpers import chunked_logits, corpus_prompts, hf_greedy, hf_logits

# qwen3 without its windowed layer: llama.cpp's qwen3 has no sliding window, so its GGUF is the
# full-attention model (the converter writes no window)
# mistral: llama.cpp writes it as a llama (its tiny checkpoint has no window), served as Llama
# gemma3: what its GGUF can say: llama.cpp's converter writes no layer pattern, so its loader's
# (every 6th layer global) and the attention scale 1/sqrt(head size) (query_pre_attn_scalar = head_dim;
# the head size apart from hidden / heads, whose scale is the 27B model's)
ARCHS = {"qwen2": {}, "llama": {}, "qwen3": {"use_sliding_window": False}, "mistral": {}, "olmo2": {},
         "granite": {}, "gemma3": {"num_hidden_layers": 6, "sliding_window_pattern": 6, "head_dim": 32,
                                      "query_pre_attn_scalar": 32},
         "phi3": {"sliding_window": 16},
         # smollm3: llama.cpp's (every 4th layer without RoPE, no window)
         "smollm3": {"num_hidden_layers": 4, "no_rope_layer_interval": 4, "use_sliding_window": False,
                     "layer_types": None}}
# every position's logits; SmolLM3's NoPE layer drifts further over 120 positions (2.2e-4, the same
# served from its HF checkpoint)
ATOL = {"smollm3": 3e-4}
FIELDS = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "intermediate_size", "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps", "layer_windows")
TEXT = ("Once upon a time, there's 1234567 dogs!\n\n  Café naïve — 日本語, ÅÄÖ ñ; tabs\tand  spaces   "
        "<|im_start|>user\nhi<|im_end|>\n I'M HERE, you'll see. 3.14159 e=mc² 😀 \r\n end")


@pytest.fixture(scope="module", params=list(ARCHS))
def converted(request, make_gguf, make_tiny, tmp_path_factory):
    overrides = ARCHS[request.param]
    if request.param == "gemma3":
        # llama.cpp's converter cuts Gemma's embedding to the tokenizer's tokens (Gemma3Model.modify_tensors),
        # as real Gemma 3 files hold 262,144 of the checkpoint's 262,208 rows: a checkpoint without the spare rows
        from tokenizers import Tokenizer as RustTokenizer
        tok = RustTokenizer.from_file(os.path.join(make_tiny("gemma3", **overrides), "tokenizer.json"))
        overrides = {**overrides, "vocab_size": tok.get_vocab_size(with_added_tokens=True)}
    if request.param == "phi3":
        return phi4_style(make_tiny("phi3", **overrides), tmp_path_factory)
    return make_gguf(request.param, "f32", **overrides)


def phi4_style(model_dir: str, tmp_path_factory, outtype: str = "f32") -> tuple[str, str]:
    """A Phi-3 checkpoint whose tokenizer_config names GPT2Tokenizer, as Phi-4's does: llama.cpp's
    converter then writes its byte-level BPE vocabulary (a Phi-3-mini's tokenizer.model, which the
    tiny checkpoint lacks, would be SentencePiece), and its GGUF."""
    copy = str(tmp_path_factory.mktemp("phi4-style") / "ckpt")
    shutil.copytree(model_dir, copy)
    path = os.path.join(copy, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**config, "tokenizer_class": "GPT2Tokenizer"}, f)
    return copy, peers.convert_to_gguf(PEERS_DIR, copy, outtype, out=f"{copy}-{outtype}.gguf", python=sys.executable)


def test_config_equals_the_checkpoints(converted):
    model_dir, gguf = converted
    ours, ref = ModelConfig.from_dir(gguf), ModelConfig.from_dir(model_dir)
    assert ours.gguf_file == gguf
    for name in FIELDS:
        if name == "architecture" and ref.architecture == "MistralForCausalLM":
            assert ours.architecture == "LlamaForCausalLM"
            continue
        assert getattr(ours, name) == getattr(ref, name), name
    for name in ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"):
        assert ours.raw.get(name) == ref.raw.get(name), name
    for layer_type in dict.fromkeys(ref.layer_types) if ref.raw["model_type"] == "gemma3_text" else [None]:
        assert ours.rope_parameters(layer_type) == ref.rope_parameters(layer_type), layer_type
    for name in ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation"):
        assert ours.raw.get(name) == ref.raw.get(name), name
    assert ours.torch_dtype == "float32"


def test_tokenizer_and_template_equal_the_checkpoints(converted):
    from transformers import AutoTokenizer
    model_dir, gguf = converted
    ours, ref = Tokenizer.from_dir(gguf), Tokenizer.from_dir(model_dir)
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    # transformers' own GGUF tokenizer too, for the architectures it reads (not olmo2, granite)
    hf_gguf = (AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
               if ModelConfig.from_dir(gguf).raw["model_type"] in GGUF_SUPPORTED_ARCHITECTURES else ref)
    from tools.make_model import corpus_texts
    for text in (TEXT, " ".join(corpus_texts())[:20000], "", " ", "\n\n\n"):
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            assert hf_gguf.encode(text, add_special_tokens=special) == ids
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert ours.chat_template == ref.chat_template and ours.chat_template
    chat = [{"role": "user", "content": "Hello there"}]
    assert ours.encode_chat(chat) == ref.encode_chat(chat)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.all_special_ids) == \
        (ref.bos_token_id, ref.eos_token_ids, ref.all_special_ids)
    assert ours.vocab_size == ref.vocab_size


def test_f32_logits_and_greedy_equal_transformers(converted):
    model_dir, gguf = converted
    arch = ModelConfig.from_dir(model_dir).raw["model_type"]
    llm = LLM(gguf, dtype="float32", block_size=16)
    for prompt in corpus_prompts(llm.tokenizer, lens=[1, 17, 120]):
        ours = chunked_logits(llm.engine, prompt, chunk=len(prompt))
        torch.testing.assert_close(ours, hf_logits(model_dir, prompt), atol=ATOL.get(arch, 1e-4), rtol=0)
    prompts = corpus_prompts(llm.tokenizer, lens=[5, 40], offset=500)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model_dir, prompt, 16)


@pytest.mark.parametrize("outtype", ["f16", "bf16"])
def test_half_precision_files_hold_the_converters_values(make_gguf, outtype):
    """F16/BF16 tensors load as the file's values (the converter rounded them): equal to the
    checkpoint's weights rounded the same way."""
    from pdserve.loader import load_model
    from tests.helpers import hf_model
    model_dir, gguf = make_gguf("qwen2", outtype)
    model = load_model(ModelConfig.from_dir(gguf), torch.float32, "cpu")
    ref = hf_model(model_dir)
    dtype = torch.float16 if outtype == "f16" else torch.bfloat16
    ours = dict(model.named_parameters())
    for name, w in ref.named_parameters():
        if name.endswith("mlp.down_proj.weight") or name.endswith("self_attn.o_proj.weight"):
            assert torch.equal(ours[name], w.detach().to(dtype).float()), name


def test_a_directory_holding_one_gguf_is_that_model(converted, tmp_path):
    _, gguf = converted
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(gguf, d / "m.gguf")
    assert ModelConfig.from_dir(str(d)).gguf_file == str(d / "m.gguf")
    assert Tokenizer.from_dir(str(d)).encode(TEXT) == Tokenizer.from_dir(gguf).encode(TEXT)
