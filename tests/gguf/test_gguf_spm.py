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
from tools.make_model import CHATML_BOS, corpus_texts

SPM_VOCAB = 1500   # the tiny Llama's embedding has 1536 rows: the converter pads with 36 UNUSED tokens
CONTROL = ["<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["[TOOL]"]
# leading spaces, newlines, special and user-defined tokens inside text, characters the
# vocabulary lacks (byte fallback: "ꙮ", "𝔘", "🦜"), the empty string
TEXTS = [TEXT, " ".join(corpus_texts())[:20000], "", " ", "  hi", "   two  spaces ", "\n", "\n\nhi\n \n",
         "ꙮ 𝔘nicode ꙮꙮ 🦜", "<|im_start|>user\n hi there<|im_end|>\n<|im_start|>assistant\n",
         "x[TOOL]y [TOOL] z", "<s> hi</s>", "<unk>", "▁hi ▁", "<0x41>"]


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory) -> str:
    """tokenizer.model: SentencePiece BPE with byte fallback, Llama's <unk>/<s>/</s> at 0-2, ChatML
    markers as control pieces and one user-defined piece."""
    import sentencepiece as spm
    texts = [t for t in corpus_texts(max_story_chars=400_000) if t.strip()]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=out, model_type="bpe", vocab_size=SPM_VOCAB,
        byte_fallback=True, character_coverage=0.999, remove_extra_whitespaces=False,
        normalization_rule_name="identity", split_digits=True, allow_whitespace_only_pieces=True,
        control_symbols=CONTROL, user_defined_symbols=USER_DEFINED, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        max_sentence_length=100_000, num_threads=2, minloglevel=2)
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(out.getvalue())
    return str(path)


def spm_checkpoint(model_dir: str, spm_model: str, out: str, add_prefix_space: bool) -> str:
    """A copy of the tiny checkpoint with the SentencePiece tokenizer: tokenizer.model, and
    tokenizer.json / tokenizer_config.json as transformers' LlamaTokenizer writes them."""
    from transformers import LlamaTokenizerFast
    shutil.copytree(model_dir, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(out, name))
    shutil.copy(spm_model, os.path.join(out, "tokenizer.model"))
    tok = LlamaTokenizerFast.from_pretrained(out, add_bos_token=True, chat_template=CHATML_BOS,
                                             **({} if add_prefix_space else {"add_prefix_space": False}))
    tok.save_pretrained(out)
    # Hub checkpoints list their added tokens in tokenizer_config.json (transformers 5 keeps them
    # in tokenizer.json only); the converter reads them there to mark user-defined pieces
    update_json(os.path.join(out, "tokenizer_config.json"), added_tokens_decoder={
        str(i): t.__getstate__() for i, t in tok.added_tokens_decoder.items()})
    update_json(os.path.join(out, "generation_config.json"),
                eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")])
    return out


def update_json(path: str, **values) -> None:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data | values, f, indent=2, ensure_ascii=False)


@pytest.fixture(scope="session")
def make_spm_gguf(make_tiny, llama_tree, spm_model, tmp_path_factory):
    """make_spm_gguf(add_prefix_space) -> (HF checkpoint, its F32 GGUF)"""
    made = {}

    def make(prefix: bool) -> tuple[str, str]:
        if prefix not in made:
            base = tmp_path_factory.mktemp("spm-llama")
            model_dir = spm_checkpoint(make_tiny("llama"), spm_model, str(base / "hf"), prefix)
            made[prefix] = model_dir, peers.convert_to_gguf(PEERS_DIR, model_dir, "f32", out=str(base / "model.gguf"),
                                                            python=sys.executable)
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


def test_gemma_space_handling(make_spm_gguf, spm_model, tmp_path):
    """The vocabulary as a Gemma file (no space prefix): transformers' GemmaTokenizer made from the
    same tokenizer.model is the reference."""
    from transformers import GemmaTokenizerFast
    _, gguf = make_spm_gguf(False)
    ours = Tokenizer.from_dir(rewrite(gguf, str(tmp_path / "gemma.gguf"), arch="gemma3"))
    src = tmp_path / "gemma-hf"
    src.mkdir()
    shutil.copy(spm_model, src / "tokenizer.model")
    ref = GemmaTokenizerFast.from_pretrained(str(src), bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


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
