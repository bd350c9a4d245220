"""pdserve.tokenizer against transformers.AutoTokenizer, and the streaming detokenizer."""
import json
import os
import random
import shutil

import pytest
import transformers

from pdserve.errors import CheckpointError
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

ARCHS = ["llama", "qwen2", "mistral", "opt"]
TEXTS = [
    "Hello world", " leading space", "Once upon a time, there was a cat named Pip.",
    "Café déjà vu — naïve façade, Zürich, Łódź", "你好，世界！今天天气很好。 こんにちは 안녕하세요",
    "Emoji 🙂🎉 family 👨‍👩‍👧 flags 🇫🇷", "numbers 12345 and 3.14159, 1,000,000", "tabs\tand\nnewlines\n\n  spaces   ",
    "<|im_start|>user\nhi<|im_end|>", "<s> and </s> and <pad> inside text", "e\u0301 combining vs \u00e9 (NFC)",
    "don't I'll we're THEY'VE", "", " ", "\n", "x" * 300, "Ω≈ç√∫˜µ≤≥÷ ∑ x² ≤ ∞ €5 £3",
]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, make_tiny):
    path = make_tiny(request.param)
    return request.param, path, Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


def test_encode_matches_transformers(pair):
    _, _, ours, hf = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, special) == hf(text, add_special_tokens=special).input_ids, (text, special)


def test_decode_matches_transformers(pair):
    _, _, ours, hf = pair
    rng = random.Random(0)
    samples = [ours.encode(t) for t in TEXTS]
    # Random ids, including special tokens and ids the tokenizer does not know (a model's
    # embedding can be larger than its tokenizer): transformers drops unknown ids.
    samples += [[rng.randrange(ours.vocab_size + 50) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    for ids in samples:
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_special_tokens_follow_family_conventions(pair):
    arch, path, ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in ours.eos_token_ids
    with open(os.path.join(path, "generation_config.json")) as f:
        gen_eos = json.load(f)["eos_token_id"]
    for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
        assert i in ours.eos_token_ids
    first = ours.encode("Hi")[0]
    if arch == "opt":  # OPT prepends </s> (id 2), which is also its EOS
        assert first == 2 == ours.bos_token_id and ours.eos_token_ids == [2]
    elif arch in ("llama", "mistral"):
        assert first == ours.bos_token_id == ours.token_to_id("<s>")
    else:  # qwen2 adds nothing and ends with <|endoftext|>; chat turns end with <|im_end|>
        assert ours.bos_token_id is None and ours.encode("Hi") == ours.encode("Hi", add_special_tokens=False)
        assert set(ours.eos_token_ids) == {ours.token_to_id("<|endoftext|>"), ours.token_to_id("<|im_end|>")}


MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Héllo 🙂, what is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "Thanks!"},
]


def test_chat_template_matches_transformers(pair):
    _, _, ours, hf = pair
    if ours.chat_template is None:
        pytest.skip("this family has no chat template")
    for gen in (True, False):
        text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == text
        ids = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=gen)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        assert ours.encode_chat(MESSAGES, add_generation_prompt=gen) == ids


def test_chat_fallback_without_template(tiny_opt):
    tok = Tokenizer.from_dir(tiny_opt)
    assert tok.chat_template is None
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert tok.apply_chat_template(msgs) == "user: Hi\nassistant: Hello\nassistant:"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "user: Hi\nassistant: Hello\n"
    assert tok.encode_chat(msgs)[0] == tok.bos_token_id


def copy_checkpoint_tokenizer(src: str, dst) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        shutil.copy(os.path.join(src, name), dst)
    return str(dst)


def edit_config(path: str, **changes):
    file = os.path.join(path, "tokenizer_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)


def test_template_helpers_and_jinja_file(tiny_llama, tmp_path):
    path = copy_checkpoint_tokenizer(tiny_llama, tmp_path / "tok")
    # chat_template.jinja wins over tokenizer_config's template, as in transformers.
    source = ("{% for m in messages %}{{ m['content'] | tojson }}|{{ strftime_now('%Y') | length }}{% endfor %}"
              "{% if add_generation_prompt %}{{ eos_token }}{% endif %}")
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(source)
    ours, hf = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "user", "content": 'say "héllo" <b>'}]
    expected = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(msgs) == expected == '"say \\"héllo\\" <b>"|4</s>'


def test_template_errors_are_value_errors(tiny_llama, tmp_path):
    path = copy_checkpoint_tokenizer(tiny_llama, tmp_path / "tok")
    edit_config(path, chat_template="{{ raise_exception('only user messages, please') }}")
    with pytest.raises(ValueError, match="only user messages, please"):
        Tokenizer.from_dir(path).apply_chat_template(MESSAGES)
    edit_config(path, chat_template="{% for m in messages %}")  # syntax error
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer.from_dir(path).apply_chat_template(MESSAGES)
    # The sandbox refuses attribute escapes.
    edit_config(path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError):
        Tokenizer.from_dir(path).apply_chat_template(MESSAGES)


def test_tokenizer_json_decides_special_tokens(tiny_llama, tmp_path):
    # transformers 5 ignores add_bos_token/add_eos_token in tokenizer_config.json when a
    # tokenizer.json exists (its post-processor decides); we must agree.
    path = copy_checkpoint_tokenizer(tiny_llama, tmp_path / "tok")
    edit_config(path, add_bos_token=False, add_eos_token=True)
    ours, hf = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    for text in TEXTS[:5]:
        assert ours.encode(text) == hf(text).input_ids
        assert ours.encode(text)[0] == ours.bos_token_id


def test_missing_or_broken_files(tiny_llama, tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))
    path = copy_checkpoint_tokenizer(tiny_llama, tmp_path / "tok")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json") as e:
        Tokenizer.from_dir(path)
    assert "\n" not in str(e.value)
    os.remove(os.path.join(path, "tokenizer_config.json"))  # optional: loads without it
    assert Tokenizer.from_dir(path).encode("Hi")


# ---------------------------------------------------------------- streaming


def stream(tok, prompt, ids, skip=True):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush()


def test_vocabulary_has_partial_characters(tiny_llama):
    # Otherwise the streaming tests below would not exercise the hold-back logic.
    tok = Tokenizer.from_dir(tiny_llama)
    partial = [i for i in range(tok.vocab_size) if tok.decode([i]).endswith("\ufffd")]
    assert len(partial) > 50


@pytest.mark.parametrize("arch", ARCHS)
def test_stream_of_valid_text_never_splits_characters(make_tiny, arch):
    tok = Tokenizer.from_dir(make_tiny(arch))
    prompt = tok.encode("Tell me: ")
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        deltas, tail = stream(tok, prompt, ids)
        assert "".join(deltas) == tok.decode(ids) and tail == ""
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("arch", ARCHS)
def test_stream_of_random_ids_equals_decode(make_tiny, arch):
    tok = Tokenizer.from_dir(make_tiny(arch))
    rng = random.Random(arch)
    multibyte = tok.encode("".join(TEXTS[3:6]), add_special_tokens=False)
    held_back = 0
    for trial in range(300):
        n = rng.randrange(1, 30)
        if trial % 3 == 0:  # any id, including specials and ids above the tokenizer's vocabulary
            ids = [rng.randrange(tok.vocab_size + 10) for _ in range(n)]
        else:  # pieces of multi-byte characters, shuffled and cut at odd places
            start = rng.randrange(len(multibyte))
            ids = multibyte[start:start + n] if trial % 3 == 1 else [rng.choice(multibyte) for _ in range(n)]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        for skip in (True, False):
            deltas, tail = stream(tok, prompt, ids, skip)
            assert "".join(deltas) + tail == tok.decode(ids, skip), (prompt, ids, skip)
            held_back += sum(d == "" for d in deltas)
    assert held_back > 100  # the hold-back path was taken


def test_stream_holds_incomplete_character(tiny_qwen2):
    tok = Tokenizer.from_dir(tiny_qwen2)
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # an emoji is several byte tokens in a tiny vocabulary
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    deltas = [detok.add(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🙂"


@pytest.mark.parametrize("arch", ARCHS)
def test_byte_pieces_decode_like_the_tokenizer(make_tiny, arch):
    # Byte-level tokenizers stream from each token's bytes: every id's bytes must convert to
    # exactly what decode() gives for it, special tokens skipped or not.
    tok = Tokenizer.from_dir(make_tiny(arch))
    for skip in (True, False):
        pieces = tok.byte_pieces(skip)
        assert pieces is not None   # all the tiny checkpoints have byte-level tokenizers
        for i in [*range(-2, tok.vocab_size + 3), 2**31]:
            assert pieces[i].decode("utf-8", "replace") == tok.decode([i], skip), (i, skip)


def test_python_and_rust_replace_invalid_utf8_alike():
    # The byte path converts with Python's "replace", decode() with Rust's from_utf8_lossy: both
    # must substitute U+FFFD for the same maximal subparts of every invalid sequence.
    from tokenizers.decoders import ByteLevel

    from pdserve.tokenizer import _BYTE_OF_CHAR
    char_of_byte = {b: c for c, b in _BYTE_OF_CHAR.items()}
    rust = ByteLevel()
    rng = random.Random(0)
    interesting = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1,
                   0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFE, 0xFF]
    cases = [bytes([a, b]) for a in range(256) for b in interesting]
    cases += [bytes(rng.choice(interesting) for _ in range(rng.randrange(1, 7))) for _ in range(20000)]
    cases += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 7))) for _ in range(5000)]
    batch = [[char_of_byte[b] for b in case] for case in cases]
    for case, token_chars in zip(cases, batch):
        assert case.decode("utf-8", "replace") == rust.decode(token_chars), case


@pytest.mark.parametrize("arch", ["qwen2", "opt"])
def test_byte_path_streams_what_the_decoding_path_streams(make_tiny, arch, monkeypatch):
    # The same ids through both ways of streaming give the same deltas, tail and text.
    tok = Tokenizer.from_dir(make_tiny(arch))
    rng = random.Random(arch)
    multibyte = tok.encode("".join(TEXTS[3:6]), add_special_tokens=False)
    specials = tok.all_special_ids
    cases = []
    for trial in range(300):
        n = rng.randrange(1, 30)
        pool = [rng.randrange(-2, tok.vocab_size + 10) for _ in range(5)] + specials + multibyte
        ids = [rng.choice(pool if trial % 2 else multibyte) for _ in range(n)]
        prompt = [rng.choice(multibyte + specials) for _ in range(rng.randrange(0, 8))]
        cases += [(prompt, ids, skip) for skip in (True, False)]
    fast = [stream(tok, *case) for case in cases]
    monkeypatch.setattr(tok, "byte_pieces", lambda skip_special_tokens=True: None)   # the decoding path
    assert [stream(tok, *case) for case in cases] == fast
