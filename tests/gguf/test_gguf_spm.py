"""A GGUF with a SentencePiece tokenizer (tokenizer.ggml.model "llama": Llama 2, Mistral, Gemma,
Phi-3) tokenizes as the HF checkpoint it came from, and serves as it does, made as users make
it: a SentencePiece BPE model trained with the `sentencepiece` package on the repo's corpus in the
family's style, its tokenizer.model and the tokenizer files transformers makes of it put into a
tiny checkpoint, and that converted by llama.cpp's convert_hf_to_gguf.py (which reads the
tokenizer.model: _set_vocab_sentencepiece, or Phi-3's own reader; the pre-tokenizer name the
conversion wrapper forces is never asked for). Llama with the space prefix and without it
(add_prefix_space false in tokenizer_config.json, which the converter writes as
tokenizer.ggml.add_space_prefix false), Gemma 3 (no prefix, pieces of spaces) and Phi-3 (the
prefix from a normalizer, chat tokens that strip the whitespace after them)."""
import io
import json
import os
import shutil
import sys

import pytest
import torch

from benchmarks import peers
from pdserve import LLM, SamplingParams
from pdserve.errors import CheckpointError
from pdserve.gguf.reader import GGUFFile
from pdserve.tokenizer import Tokenizer
from tests.gguf.conftest import PEERS_DIR
from tests.gguf.test_gguf_errors import rewrite
from tests.gguf.test_gguf_model import ARCHS, TEXT
from tests.helpers import corpus_prompts, hf_greedy
from tools.make_model import CHATML_BOS, GEMMA_TEMPLATE, PHI3_TEMPLATE, corpus_texts

SPM_VOCAB = 1500   # the tiny models' embeddings have 1536 rows: the converter pads with UNUSED tokens
CONTROL = ["<|im_start|>", "<|im_end|>"]
# how each family trains its tokenizer.model: Llama's <unk>/<s>/</s> at 0-2 and a space prefix;
# Gemma's <pad>/<eos>/<bos>/<unk> at 0-3, no prefix, and pieces of 2 and 4 spaces as user-defined
# (which the converter writes with real spaces); Llama's and Gemma's with their chat markers as
# control pieces; each with one more user-defined piece
SPM_STYLES = {
    "llama": dict(control_symbols=CONTROL, user_defined_symbols=["[TOOL]"], unk_id=0, bos_id=1, eos_id=2,
                  pad_id=-1),
    # Phi-3's tokenizer.model is Llama 2's; its chat tokens are added after it (phi3_tokenizer)
    "phi3": dict(user_defined_symbols=["[TOOL]"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
    "gemma": dict(control_symbols=["<start_of_turn>", "<end_of_turn>"],
                  user_defined_symbols=["\u2581\u2581", "\u2581" * 4, "[TOOL]"], add_dummy_prefix=False,
                  pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
                  unk_piece="<unk>"),
}
# leading spaces, newlines, special and user-defined tokens inside text, characters the
# vocabulary lacks (byte fallback: "ꙮ", "𝔘", "🦜"), the empty string
TEXTS = [TEXT, " ".join(corpus_texts())[:20000], "", " ", "  hi", "   two  spaces ", "\n", "\n\nhi\n \n",
         "ꙮ 𝔘nicode ꙮꙮ 🦜", "<|im_start|>user\n hi there<|im_end|>\n<|im_start|>assistant\n",
         "x[TOOL]y [TOOL] z", "<s> hi</s>", "<unk>", "▁hi ▁", "<0x41>"]


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory):
    """spm_model(style) -> a tokenizer.model: SentencePiece BPE with byte fallback in SPM_STYLES' style."""
    made = {}

    def train(style: str) -> str:
        import sentencepiece as spm
        if style not in made:
            texts = [t for t in corpus_texts(max_story_chars=400_000) if t.strip()]
            out = io.BytesIO()
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(texts), model_writer=out, model_type="bpe", vocab_size=SPM_VOCAB,
                byte_fallback=True, character_coverage=0.999, remove_extra_whitespaces=False,
                normalization_rule_name="identity", split_digits=True, allow_whitespace_only_pieces=True,
                max_sentence_length=100_000, num_threads=2, minloglevel=2, **SPM_STYLES[style])
            made[style] = tmp_path_factory.mktemp("spm") / "tokenizer.model"
            made[style].write_bytes(out.getvalue())
        return str(made[style])
    return train


def spm_checkpoint(model_dir: str, spm_model: str, out: str, tokenizer_class, end_of_turn: str | None,
                   **kwargs) -> str:
    """A copy of the tiny checkpoint with the SentencePiece tokenizer: tokenizer.model, and
    tokenizer.json / tokenizer_config.json as transformers' `tokenizer_class` writes them."""
    shutil.copytree(model_dir, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(out, name))
    shutil.copy(spm_model, os.path.join(out, "tokenizer.model"))
    tok = tokenizer_class.from_pretrained(out, add_bos_token=True, **kwargs)
    tok.save_pretrained(out)
    # Hub checkpoints list their added tokens in tokenizer_config.json (transformers 5 keeps them
    # in tokenizer.json only); the converter reads them there to mark user-defined pieces
    update_json(os.path.join(out, "tokenizer_config.json"), added_tokens_decoder={
        str(i): t.__getstate__() for i, t in tok.added_tokens_decoder.items()})
    eos = [tok.eos_token_id] + ([tok.convert_tokens_to_ids(end_of_turn)] if end_of_turn else [])
    update_json(os.path.join(out, "generation_config.json"), bos_token_id=tok.bos_token_id, eos_token_id=eos)
    # the converter takes the special ids config.json names (the byte-level tokenizer's until now)
    update_json(os.path.join(out, "config.json"), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    return out


def update_json(path: str, **values) -> None:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data | values, f, indent=2, ensure_ascii=False)


def phi3_tokenizer(out: str) -> None:
    """Phi-3's tokenizer files: its tokenizer.json gets the space prefix from a normalizer (so
    before every stretch of text, and before a leading space too), not Metaspace, and transformers
    reads it as it is; <|endoftext|> (EOS) and the chat tokens are added after the
    tokenizer.model's pieces, and the chat tokens and </s> (not special) take the whitespace after
    them (rstrip); <|endoftext|> also pads. As Phi-3-mini's files have them."""
    path = os.path.join(out, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    spec["pre_tokenizer"] = None
    for token in spec["added_tokens"]:
        if token["content"] == "</s>":
            token.update(special=False, rstrip=True)
    size = len(spec["model"]["vocab"])
    for i, token in enumerate(["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]):
        spec["added_tokens"].append(dict(id=size + i, content=token, single_word=False, lstrip=False,
                                         rstrip=token != "<|endoftext|>", normalized=False, special=True))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    update_json(os.path.join(out, "tokenizer_config.json"), eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                add_bos_token=False,
                tokenizer_class="LlamaTokenizer", added_tokens_decoder={
                    str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in spec["added_tokens"]})
    update_json(os.path.join(out, "generation_config.json"), eos_token_id=[size, size + 3])
    update_json(os.path.join(out, "config.json"), eos_token_id=size, pad_token_id=size)


# name -> (tiny model and its config overrides (gemma3's and phi3's: what their GGUF can say, as
# test_gguf_model.py makes them), tokenizer.model style, transformers' tokenizer class, its
# arguments, the end-of-turn token, a last edit of the tokenizer files)
SPM_CHECKPOINTS = {
    "llama": ("llama", {}, "llama", "LlamaTokenizerFast", dict(chat_template=CHATML_BOS), "<|im_end|>", None),
    "llama-no-prefix": ("llama", {}, "llama", "LlamaTokenizerFast",
                        dict(chat_template=CHATML_BOS, add_prefix_space=False), "<|im_end|>", None),
    "gemma3": ("gemma3", ARCHS["gemma3"], "gemma", "GemmaTokenizerFast", dict(chat_template=GEMMA_TEMPLATE),
               "<end_of_turn>", None),
    # gemma2: llama.cpp's converter takes only a tokenizer.model for it; its attention scale 1/sqrt(head size)
    "gemma2": ("gemma2", {"head_dim": 32, "query_pre_attn_scalar": 32}, "gemma", "GemmaTokenizerFast",
               dict(chat_template=GEMMA_TEMPLATE), "<end_of_turn>", None),
    "phi3": ("phi3", ARCHS["phi3"], "phi3", "LlamaTokenizerFast", dict(chat_template=PHI3_TEMPLATE), None,
             phi3_tokenizer),
}


@pytest.fixture(scope="session")
def make_spm_gguf(make_tiny, llama_tree, spm_model, tmp_path_factory):
    """make_spm_gguf(name of SPM_CHECKPOINTS) -> (tiny HF checkpoint, its F32 GGUF by llama.cpp's converter)"""
    import transformers
    made = {}

    def make(name: str) -> tuple[str, str]:
        if name not in made:
            arch, overrides, style, tokenizer_class, kwargs, end_of_turn, edit = SPM_CHECKPOINTS[name]
            out = str(tmp_path_factory.mktemp(f"spm-{name}") / "hf")
            model_dir = spm_checkpoint(make_tiny(arch, **overrides), spm_model(style), out,
                                       getattr(transformers, tokenizer_class), end_of_turn, **kwargs)
            if edit:
                edit(model_dir)
            made[name] = model_dir, peers.convert_to_gguf(PEERS_DIR, model_dir, "f32", out=f"{model_dir}.gguf",
                                                          python=sys.executable)
        return made[name]
    return make


@pytest.fixture(scope="module", params=list(SPM_CHECKPOINTS))
def converted(request, make_spm_gguf):
    """(name, HF checkpoint, its GGUF)"""
    return request.param, *make_spm_gguf(request.param)


# what llama.cpp's converter writes for each: the space prefix flag, and some tokens' types
WRITTEN = {"llama": (True, {"<s>": 3, "<|im_start|>": 3, "[TOOL]": 4, "<0x0A>": 6, "[PAD1535]": 5}),
           "llama-no-prefix": (False, {"<s>": 3, "<|im_start|>": 3, "[TOOL]": 4, "<0x0A>": 6, "[PAD1535]": 5}),
           "gemma3": (False, {"<bos>": 3, "<start_of_turn>": 3, "  ": 4, "    ": 4, "[TOOL]": 4, "<0x0A>": 6}),
           "gemma2": (False, {"<bos>": 3, "<start_of_turn>": 3, "  ": 4, "    ": 4, "[TOOL]": 4, "<0x0A>": 6}),
           "phi3": (True, {"<s>": 3, "</s>": 4, "<|end|>": 3, "[TOOL]": 4, "<0x0A>": 6, "[PAD1535]": 5})}
# beyond TEXTS: each family's chat markers amid text, with the whitespace Phi-3's strip
FAMILY_TEXTS = {"gemma3": ["<start_of_turn>user\n hi<end_of_turn>\n<bos>", "a  b    c      d\t\te"],
                "gemma2": ["<start_of_turn>user\n hi<end_of_turn>\n<bos>", "a  b    c      d\t\te"],
                "phi3": ["<|user|>\n hi<|end|>\n<|assistant|>  x</s> \n<s> y<|endoftext|> z", "</s>"]}


def test_the_converter_wrote_a_sentencepiece_vocabulary(converted):
    name, _, gguf = converted
    f = GGUFFile(gguf)
    prefix, types = WRITTEN[name]
    assert (f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.add_space_prefix", True)) == ("llama", prefix)
    written = dict(zip(f.string_array("tokenizer.ggml.tokens"), f.int_array("tokenizer.ggml.token_type")))
    assert {t: written[t] for t in types} == types
    assert f.float_array("tokenizer.ggml.scores") is not None


def assert_same_tokenizer(ours: Tokenizer, ref, texts=TEXTS):
    """ref: pdserve's or transformers' tokenizer of the HF checkpoint (the same encode/decode calls)."""
    for text in texts:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
        for i in ids:   # one piece at a time, as a stream decodes
            assert ours.decode([i], skip_special_tokens=False) == ref.decode([i], skip_special_tokens=False)


def test_tokenizer_equals_the_checkpoints(converted):
    from transformers import AutoTokenizer
    name, model_dir, gguf = converted
    ours, ref = Tokenizer.from_dir(gguf), Tokenizer.from_dir(model_dir)
    texts = TEXTS + FAMILY_TEXTS.get(name, [])
    # the texts exercise what they should: byte fallback, added tokens, the pieces of spaces
    wanted = {"llama": ["<|im_start|>", "<s>"], "llama-no-prefix": ["<|im_start|>", "<s>"],
              "gemma3": ["<start_of_turn>", "\u2581\u2581"], "gemma2": ["<start_of_turn>", "\u2581\u2581"],
              "phi3": ["<|user|>", "</s>"]}[name]
    assert {ours.token_to_id(t) for t in ["<0xEA>", "<0xF0>", "[TOOL]"] + wanted} <= set(ours.encode(" ".join(texts)))
    assert_same_tokenizer(ours, ref, texts)
    assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(model_dir), texts)
    if name == "llama":
        # transformers' GGUF reader: not without the space prefix (it leaves the flag out), nor
        # Gemma (it adds tokens the file does not have, <|im_start|> among them) or Phi-3 (no rstrip)
        hf_gguf = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
        assert_same_tokenizer(ours, hf_gguf, texts)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.all_special_ids, ours.vocab_size, ours.special_tokens) == \
        (ref.bos_token_id, ref.eos_token_ids, ref.all_special_ids, ref.vocab_size, ref.special_tokens)
    assert ours.chat_template == ref.chat_template
    chat = [{"role": "user", "content": " Hello  there"}, {"role": "assistant", "content": "Hi!"}]
    assert ours.encode_chat(chat) == ref.encode_chat(chat)


def test_greedy_equals_transformers(converted):
    """Text in, tokens out: the GGUF's tokenizer and weights against transformers on the checkpoint."""
    _, model_dir, gguf = converted
    llm = LLM(gguf, dtype="float32", block_size=16)
    ref = Tokenizer.from_dir(model_dir)
    story = ref.decode(corpus_prompts(ref, lens=[40], offset=500)[0])
    texts = [" Once upon a time", "<|im_start|>user\n  Café 🦜 ꙮ", story]
    outs = llm.generate(texts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for text, out in zip(texts, outs):
        assert out.prompt_token_ids == ref.encode(text)
        assert out.token_ids == hf_greedy(model_dir, ref.encode(text), 16)


def refusal(path: str) -> str:
    with pytest.raises(CheckpointError) as e:
        Tokenizer.from_dir(path)
    msg = str(e.value)
    assert "\n" not in msg and path in msg
    return msg


def retyped(gguf: str, dst: str, token: str, token_type: int) -> str:
    """The GGUF with one token's type changed."""
    f = GGUFFile(gguf)
    tokens, types = f.string_array("tokenizer.ggml.tokens"), f.int_array("tokenizer.ggml.token_type")
    types[tokens.index(token)] = token_type
    return rewrite(gguf, dst, kv={"tokenizer.ggml.token_type": [int(t) for t in types]})


def test_an_unknown_typed_unk_piece_is_special(make_spm_gguf, tmp_path):
    """Older converters and tokenizer.model-only checkpoints leave <unk> UNKNOWN (2), not CONTROL:
    transformers still has it as a special token (the unk token)."""
    model_dir, gguf = make_spm_gguf("llama")
    ours = Tokenizer.from_dir(retyped(gguf, str(tmp_path / "unk.gguf"), "<unk>", 2))
    assert_same_tokenizer(ours, Tokenizer.from_dir(model_dir), ["<unk> hi <unk>", TEXT])
    assert ours.all_special_ids == Tokenizer.from_dir(model_dir).all_special_ids


@pytest.mark.parametrize("arch, prefix", [("gemma3", True), ("phi3", False)])
def test_a_space_prefix_the_architecture_does_not_have_is_refused(make_spm_gguf, tmp_path, arch, prefix):
    _, gguf = make_spm_gguf("llama-no-prefix")
    path = rewrite(gguf, str(tmp_path / f"{arch}.gguf"), arch=arch, kv={"tokenizer.ggml.add_space_prefix": prefix})
    assert "add_space_prefix" in refusal(path)


def test_what_it_cannot_reproduce_is_refused(make_spm_gguf, tmp_path):
    _, gguf = make_spm_gguf("llama")
    # SentencePiece Unigram (T5) and WordPiece files: another algorithm, not built here
    for model in ("t5", "bert"):
        path = rewrite(gguf, str(tmp_path / f"{model}.gguf"), kv={"tokenizer.ggml.model": model})
        assert f"tokenizer model {model!r} is not supported" in refusal(path)
    f = GGUFFile(gguf)
    tokens = f.string_array("tokenizer.ggml.tokens")
    for old, new, reason in (("<0x41>", "<0x41 >", "byte pieces"), ("he", "\u2581a", "a token twice"),
                             ("[TOOL]", "[TO OL]", "user-defined tokens with spaces")):
        changed = [new if t == old else t for t in tokens]
        path = rewrite(gguf, str(tmp_path / f"{new}.gguf"), kv={"tokenizer.ggml.tokens": changed})
        assert reason in refusal(path)
    assert "token types [0]" in refusal(retyped(gguf, str(tmp_path / "undefined.gguf"), "he", 0))
    path = rewrite(gguf, str(tmp_path / "noscores.gguf"), kv={"tokenizer.ggml.scores": None})
    assert "tokenizer.ggml.scores" in refusal(path)


def test_gemma2_config_and_logits(make_spm_gguf):
    # Gemma 2 is read from GGUF only with its SentencePiece tokenizer (the converter takes no other):
    # its windows every other layer, both soft caps and the 1 + w norms, every position's logits
    from pdserve.config import ModelConfig
    from tests.helpers import chunked_logits, hf_logits
    model_dir, gguf = make_spm_gguf("gemma2")
    ours, ref = ModelConfig.from_dir(gguf), ModelConfig.from_dir(model_dir)
    for name in ("layer_windows", "head_dim", "num_kv_heads", "rms_norm_eps"):
        assert getattr(ours, name) == getattr(ref, name), name
    for name in ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping"):
        assert ours.raw[name] == ref.raw[name], name
    assert ours.rope_parameters() == ref.rope_parameters()
    llm = LLM(gguf, dtype="float32", block_size=16)
    for prompt in corpus_prompts(llm.tokenizer, lens=[1, 17, 120]):
        torch.testing.assert_close(chunked_logits(llm.engine, prompt, chunk=len(prompt)), hf_logits(model_dir, prompt),
                                   atol=1e-4, rtol=0)
