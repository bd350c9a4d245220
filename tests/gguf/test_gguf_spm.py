"""A GGUF with a SentencePiece tokenizer (tokenizer.ggml.model "llama": Llama 2, Mistral, Gemma,
Phi-3) tokenizes as the HF checkpoint it came from, made as users make it: a SentencePiece BPE
model trained with the `sentencepiece` package on the repo's corpus, its tokenizer.model and the
fast tokenizer transformers converts from it put into a tiny Llama checkpoint, and that converted
by llama.cpp's convert_hf_to_gguf.py (which reads tokenizer.model: _set_vocab_sentencepiece).
With the space prefix (Llama 2 / Mistral style) and without it (add_prefix_space false in
tokenizer_config.json, which the converter writes as tokenizer.ggml.add_space_prefix false, as
Gemma's files have it)."""
import io
import json
import os
import shutil
import sys

import pytest

from benchmarks import peers
from pdserve import LLM, SamplingParams
from pdserve.errors import CheckpointError
from pdserve.gguf.reader import GGUFFile
from pdserve.tokenizer import Tokenizer
from tests.gguf.conftest import PEERS_DIR
from tests.gguf.test_gguf_errors import rewrite
from tests.gguf.test_gguf_model import TEXT
from tests.helpers import corpus_prompts, hf_greedy
from tools.make_model import CHATML_BOS, GEMMA_TEMPLATE, corpus_texts

SPM_VOCAB = 1500   # the tiny models' embeddings have 1536 rows: the converter pads with UNUSED tokens
CONTROL = ["<|im_start|>", "<|im_end|>"]
# how each family trains its tokenizer.model: Llama's <unk>/<s>/</s> at 0-2 and a space prefix;
# Gemma's <pad>/<eos>/<bos>/<unk> at 0-3, no prefix, and pieces of 2 and 4 spaces as user-defined
# (which the converter writes with real spaces); each with its chat markers as control pieces and
# one more user-defined piece
SPM_STYLES = {
    "llama": dict(control_symbols=CONTROL, user_defined_symbols=["[TOOL]"], unk_id=0, bos_id=1, eos_id=2,
                  pad_id=-1),
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
GEMMA_TEXTS = TEXTS + ["<start_of_turn>user\n hi<end_of_turn>\n<bos>", "a  b    c      d\t\te"]


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


def spm_checkpoint(model_dir: str, spm_model: str, out: str, tokenizer_class, end_of_turn: str, **kwargs) -> str:
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
    update_json(os.path.join(out, "generation_config.json"), bos_token_id=tok.bos_token_id,
                eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(end_of_turn)])
    return out


def update_json(path: str, **values) -> None:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data | values, f, indent=2, ensure_ascii=False)


def convert(model_dir: str) -> str:
    return peers.convert_to_gguf(PEERS_DIR, model_dir, "f32", out=os.path.join(model_dir, "..", "model.gguf"),
                                 python=sys.executable)


@pytest.fixture(scope="session")
def make_spm_gguf(make_tiny, llama_tree, spm_model, tmp_path_factory):
    """make_spm_gguf(add_prefix_space) -> (tiny Llama HF checkpoint, its F32 GGUF)"""
    from transformers import LlamaTokenizerFast
    made = {}

    def make(prefix: bool) -> tuple[str, str]:
        if prefix not in made:
            out = str(tmp_path_factory.mktemp("spm-llama") / "hf")
            model_dir = spm_checkpoint(make_tiny("llama"), spm_model("llama"), out, LlamaTokenizerFast, "<|im_end|>",
                                       chat_template=CHATML_BOS, **({} if prefix else {"add_prefix_space": False}))
            made[prefix] = model_dir, convert(model_dir)
        return made[prefix]
    return make


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-space-prefix"])
def converted(request, make_spm_gguf):
    """(HF checkpoint, its GGUF, add_prefix_space)"""
    return *make_spm_gguf(request.param), request.param


def test_the_converter_wrote_a_sentencepiece_vocabulary(converted):
    _, gguf, prefix = converted
    f = GGUFFile(gguf)
    assert f.get("tokenizer.ggml.model") == "llama"
    assert f.get("tokenizer.ggml.add_space_prefix", True) is prefix
    types = dict(zip(f.string_array("tokenizer.ggml.tokens"), f.int_array("tokenizer.ggml.token_type")))
    assert (types["<s>"], types["<|im_start|>"], types["[TOOL]"], types["<0x0A>"]) == (3, 3, 4, 6)
    assert types["[PAD1535]"] == 5 and f.float_array("tokenizer.ggml.scores") is not None


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
    model_dir, gguf, prefix = converted
    ours, ref = Tokenizer.from_dir(gguf), Tokenizer.from_dir(model_dir)
    # the texts exercise what they should: byte fallback, both kinds of added token
    ids = ours.encode(" ".join(TEXTS))
    assert {ours.token_to_id(t) for t in ("<0xEA>", "<0xF0>", "<|im_start|>", "[TOOL]", "<s>")} <= set(ids)
    assert_same_tokenizer(ours, ref)
    assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(model_dir))
    if prefix:   # transformers' GGUF reader leaves out tokenizer.ggml.add_space_prefix (always "first")
        hf_gguf = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
        assert_same_tokenizer(ours, hf_gguf)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.all_special_ids, ours.vocab_size) == \
        (ref.bos_token_id, ref.eos_token_ids, ref.all_special_ids, ref.vocab_size)
    assert ours.special_tokens == ref.special_tokens
    chat = [{"role": "user", "content": " Hello there"}, {"role": "assistant", "content": "Hi!"}]
    assert ours.encode_chat(chat) == ref.encode_chat(chat)


def test_greedy_equals_transformers(converted):
    model_dir, gguf, _ = converted
    llm = LLM(gguf, dtype="float32", block_size=16)
    prompts = corpus_prompts(llm.tokenizer, lens=[5, 40], offset=500)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model_dir, prompt, 16)
    text = "Once upon a time"
    assert llm.tokenizer.encode(text) == Tokenizer.from_dir(model_dir).encode(text)


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
    model_dir, gguf = make_spm_gguf(True)
    ours = Tokenizer.from_dir(retyped(gguf, str(tmp_path / "unk.gguf"), "<unk>", 2))
    assert_same_tokenizer(ours, Tokenizer.from_dir(model_dir), ["<unk> hi <unk>", TEXT])
    assert ours.all_special_ids == Tokenizer.from_dir(model_dir).all_special_ids


def test_a_gemma_file_tokenizes_as_the_checkpoint(make_tiny, llama_tree, spm_model, tmp_path):
    """A tiny Gemma 3 with a Gemma-style tokenizer.model and the GemmaTokenizer transformers makes
    of it, converted by llama.cpp's Gemma 3 converter (which writes add_space_prefix false and the
    pieces of spaces with real spaces)."""
    from transformers import AutoTokenizer, GemmaTokenizerFast
    model_dir = spm_checkpoint(make_tiny("gemma3"), spm_model("gemma"), str(tmp_path / "hf"), GemmaTokenizerFast,
                               "<end_of_turn>", chat_template=GEMMA_TEMPLATE)
    gguf = convert(model_dir)
    f = GGUFFile(gguf)
    assert (f.architecture, f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.add_space_prefix")) == \
        ("gemma3", "llama", False)
    types = dict(zip(f.string_array("tokenizer.ggml.tokens"), f.int_array("tokenizer.ggml.token_type")))
    assert types["  "] == types["    "] == 4
    ours, ref = Tokenizer.from_dir(gguf), Tokenizer.from_dir(model_dir)
    assert {ours.token_to_id(t) for t in ("\u2581\u2581", "<0xF0>", "<start_of_turn>", "[TOOL]")} <= \
        set(ours.encode(" ".join(GEMMA_TEXTS)))
    # (not transformers' GGUF reader: it adds tokens the file does not have, <|im_start|> among them)
    assert_same_tokenizer(ours, ref, GEMMA_TEXTS)
    assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(model_dir), GEMMA_TEXTS)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.all_special_ids, ours.vocab_size, ours.special_tokens) == \
        (ref.bos_token_id, ref.eos_token_ids, ref.all_special_ids, ref.vocab_size, ref.special_tokens)
    chat = [{"role": "user", "content": " Hello  there"}]
    assert ours.encode_chat(chat) == ref.encode_chat(chat)


def test_phi3_space_handling(make_spm_gguf, tmp_path):
    """The vocabulary as a Phi-3 file. Phi-3's tokenizer.json (which transformers reads as it is)
    gets its space prefix from a normalizer, so before every stretch of text and before a leading
    space too, and its chat tokens and </s> take the whitespace after them (rstrip); its <unk>,
    <s> and <|endoftext|> do not. The reference is the checkpoint's tokenizer.json made so."""
    from tokenizers import Tokenizer as RustTokenizer
    model_dir, gguf = make_spm_gguf(True)
    ours = Tokenizer.from_dir(rewrite(gguf, str(tmp_path / "phi3.gguf"), arch="phi3"))
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    spec["pre_tokenizer"] = None
    for token in spec["added_tokens"]:
        token["rstrip"] = token["content"] in ("</s>", *CONTROL)
    ref = RustTokenizer.from_str(json.dumps(spec))
    for text in TEXTS + ["<|im_start|>  \n hi</s> \n<s> x"]:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special).ids
            assert ours.encode(text, add_special_tokens=special) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    llama = Tokenizer.from_dir(gguf)
    for text in ("  hi", "<|im_start|>user\n hi"):   # where the two differ
        assert ours.encode(text) != llama.encode(text)


@pytest.mark.parametrize("arch, prefix", [("gemma3", True), ("phi3", False)])
def test_a_space_prefix_the_architecture_does_not_have_is_refused(make_spm_gguf, tmp_path, arch, prefix):
    _, gguf = make_spm_gguf(False)
    path = rewrite(gguf, str(tmp_path / f"{arch}.gguf"), arch=arch, kv={"tokenizer.ggml.add_space_prefix": prefix})
    assert "add_space_prefix" in refusal(path)


def test_what_it_cannot_reproduce_is_refused(make_spm_gguf, tmp_path):
    _, gguf = make_spm_gguf(True)
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
