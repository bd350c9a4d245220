"""The tokenizer of a GGUF file, built from its `tokenizer.*` metadata as an HF fast tokenizer.

Two tokenizer models (tokenizer.ggml.model):
- "gpt2", byte-level BPE: the vocabulary (in byte-level form), the merges and the token types come
  from the file; the pre-tokenizer is the one `tokenizer.ggml.pre` names, written as the regex and
  normalizer that family's HF tokenizer.json has (llama.cpp keeps the same regexes in
  llama-vocab.cpp).
- "llama", SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3): the pieces ("▁" for a space), their
  scores and types; the merges are recovered from the scores, characters missing from the
  vocabulary fall back to the byte pieces <0x00>..<0xFF>, and the space handling is the one the
  model's HF tokenizer has (see SPM_FORMS).
Any other model (SentencePiece Unigram "t5", WordPiece "bert", ...) is refused.

CONTROL tokens are special added tokens, USER_DEFINED ones plain added tokens; BOS is prepended
when tokenizer.ggml.add_bos_token says so (SentencePiece files without the flag get it, as
llama.cpp and transformers give it); UNUSED tokens (the converter's padding of the vocabulary) are
left out. Generation stops at the file's eos, eot and eom tokens and, as llama.cpp decides its
end-of-generation tokens, at any CONTROL token whose text is one of the usual end-of-turn markers
(END_OF_TURN)."""
import numpy as np
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders
from tokenizers.models import BPE

from pdserve.errors import CheckpointError
from pdserve.gguf.reader import GGUFFile

# the word-splitting regexes of HF's tokenizer.json for each llama.cpp pre-tokenizer name
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# name -> (regex or None for GPT-2's own ByteLevel split, NFC normalisation)
PRE_TOKENIZERS = {
    "llama-bpe": (LLAMA3_REGEX, False), "llama3": (LLAMA3_REGEX, False), "smaug-bpe": (LLAMA3_REGEX, False),
    "qwen2": (QWEN2_REGEX, True),
    "gpt-2": (None, False), "default": (None, False),
}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6   # llama.cpp's token types
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
               "<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def build_tokenizer(f: GGUFFile) -> tuple[RustTokenizer, dict, dict, str | None]:
    """(backend, tokenizer_config, generation_config, chat_template), as Tokenizer's constructor takes them."""
    model = f.get("tokenizer.ggml.model")
    if model not in BUILDERS:
        raise CheckpointError(f"{f.path}: tokenizer model {model!r} is not supported (supported: gpt2, "
                              "byte-level BPE; llama, SentencePiece BPE)")
    tokens = f.string_array("tokenizer.ggml.tokens")
    types = f.int_array("tokenizer.ggml.token_type")
    if tokens is None:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.tokens is missing")
    if types is not None and len(types) != len(tokens):
        raise CheckpointError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    build, add_bos_default = BUILDERS[model]
    backend = build(f, tokens, types)

    def text(key):
        i = f.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos, eos = text("bos"), text("eos")
    add_bos = f.get("tokenizer.ggml.add_bos_token", add_bos_default)
    add_eos = f.get("tokenizer.ggml.add_eos_token", False)
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise CheckpointError(f"{f.path}: BOS/EOS is to be added (tokenizer.ggml.add_bos/eos_token, or a "
                              "SentencePiece file's default) but its token id is missing")
    if add_bos or add_eos:
        backend.post_processor = bos_eos_processor(backend, bos if add_bos else None, eos if add_eos else None)
    config = {"bos_token": bos, "eos_token": eos, "unk_token": text("unknown"), "pad_token": text("padding"),
              "clean_up_tokenization_spaces": False}
    stops = [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if types is not None:
        stops += [i for i, t in enumerate(tokens) if t in END_OF_TURN and int(types[i]) == CONTROL]
    generation = {"eos_token_id": list(dict.fromkeys(i for i in stops if isinstance(i, int)))}
    return backend, config, generation, f.get("tokenizer.chat_template")


def bos_eos_processor(backend: RustTokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """BOS before and EOS after each sequence, those of the two that are given."""
    single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
    pair = single + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else [])
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(t for t in (bos, eos) if t)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def byte_level_backend(f: GGUFFile, tokens: list[str], types) -> RustTokenizer:
    """"gpt2": byte-level BPE with the file's merges and the pre-tokenizer tokenizer.ggml.pre names."""
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{f.path}: pre-tokenizer {pre!r} is not supported "
                              f"(supported: {', '.join(PRE_TOKENIZERS)})")
    merges = f.string_array("tokenizer.ggml.merges")
    if merges is None:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.merges is missing")
    try:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = RustTokenizer(BPE(model_vocab(tokens, types), pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:
        raise CheckpointError(f"{f.path}: its vocabulary does not make a BPE tokenizer ({e})") from None
    regex, nfc = PRE_TOKENIZERS[pre]
    if nfc:
        backend.normalizer = normalizers.NFC()
    if regex is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    add_vocabulary_tokens(backend, tokens, types, special=(CONTROL,))
    return backend


def add_vocabulary_tokens(backend: RustTokenizer, tokens: list[str], types, special: tuple[int, ...],
                          rstrip: frozenset[str] = frozenset()) -> None:
    """The file's added tokens, matched whole in the text before the model splits it: the token
    types in `special` as special tokens (left out of decode(skip_special_tokens=True)),
    USER_DEFINED ones as plain ones; those in `rstrip` also take the whitespace after them."""
    if types is None:
        return
    added = [AddedToken(tokens[i], special=int(types[i]) in special, normalized=False, rstrip=tokens[i] in rstrip)
             for i in range(len(tokens)) if int(types[i]) in special + (USER_DEFINED,)]
    backend.add_tokens(added)   # already in the vocabulary: they keep their ids


def model_vocab(tokens: list[str], types) -> dict[str, int]:
    """token -> id without the UNUSED tokens: those are the converter's padding of the vocabulary to
    the embedding's rows ([PAD1500], ...), not the tokenizer's; ids beyond it decode to nothing, as
    in transformers."""
    return {t: i for i, t in enumerate(tokens) if types is None or int(types[i]) != UNUSED}


# ---------------------------------------------------------------- SentencePiece BPE

SPACE = "\u2581"   # "▁": SentencePiece's spelling of a space inside a piece
BYTE_PIECES = frozenset(f"<0x{b:02X}>" for b in range(256))


def metaspace_form(prefix: bool):
    """transformers' LlamaTokenizer (Llama 2, Mistral, and what transformers reads a llama GGUF
    as): spaces become "▁" and, with the space prefix, one "▁" goes before the text unless it
    already starts with a space, and only at the start of the text, not after a special token;
    decoding drops that one leading space again."""
    pre = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False)
    return None, pre, spm_decoder(strip_prefix=prefix)


def prepend_form(prefix: bool):
    """Phi-3's tokenizer.json (transformers reads it as it is): the prefix comes from a normalizer,
    so it goes before every stretch of text (after special tokens too) and also before text that
    already starts with a space."""
    if not prefix:
        return None
    norm = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    return norm, None, spm_decoder(strip_prefix=True)


def gemma_form(prefix: bool):
    """transformers' GemmaTokenizer: spaces become "▁", no prefix."""
    if prefix:
        return None
    pre = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    return normalizers.Replace(" ", SPACE), pre, spm_decoder(strip_prefix=False)


def spm_decoder(strip_prefix: bool):
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip_prefix else []))


def phi3_rstrip(tokens: list[str], types) -> frozenset[str]:
    """Phi-3's added tokens that take the whitespace after them in its tokenizer.json: its chat
    tokens (<|user|>, <|end|>, ...) and </s>, not <unk>, <s> or <|endoftext|>. A GGUF does not
    record it; llama.cpp sets the same by name."""
    kept = {"<unk>", "<s>", "<|endoftext|>"}
    return frozenset(t for t, kind in zip(tokens, types) if (kind == CONTROL and t not in kept) or t == "</s>")


# How each architecture's HF tokenizer treats spaces, and which of its added tokens strip the
# whitespace after them: a GGUF records neither, so (as transformers' GGUF reader does) the
# architecture decides. Every other architecture: metaspace_form, nothing stripped.
SPM_FORMS = {"phi3": (prepend_form, phi3_rstrip), "gemma": (gemma_form, None), "gemma2": (gemma_form, None),
             "gemma3": (gemma_form, None)}


def sentencepiece_backend(f: GGUFFile, tokens: list[str], types) -> RustTokenizer:
    """"llama": SentencePiece BPE with byte fallback, its merges recovered from the scores."""
    scores = f.float_array("tokenizer.ggml.scores")
    check_spm_vocabulary(f, tokens, types, scores)
    form, rstrip = SPM_FORMS.get(f.architecture, (metaspace_form, None))
    prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
    pipeline = form(prefix)
    if pipeline is None:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.add_space_prefix={prefix} is not what a "
                              f"{f.architecture} tokenizer has")
    if form is gemma_form:
        tokens, types = gemma_spaces(tokens, types)
        ranks = np.arange(len(tokens))   # Gemma's scores do not follow its merge order; the order in the file does
    else:
        ranks = -scores
    spaced = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED and " " in t]
    if spaced:
        # the converter writes a user-defined piece's "▁" as a space: whether the HF tokenizer
        # matches it against spaces or "▁" is lost
        raise CheckpointError(f"{f.path}: user-defined tokens with spaces ({spaced[0]!r}) are not supported")
    vocab = model_vocab(tokens, types)
    if len(vocab) != sum(int(kind) != UNUSED for kind in types):
        raise CheckpointError(f"{f.path}: the SentencePiece vocabulary has a token twice")
    backend = RustTokenizer(BPE(vocab, spm_merges(tokens, types, ranks, vocab), fuse_unk=True, byte_fallback=True))
    backend.normalizer, backend.pre_tokenizer, backend.decoder = pipeline
    # the unknown piece is a special token too, as transformers makes it
    add_vocabulary_tokens(backend, tokens, types, special=(CONTROL, UNKNOWN),
                          rstrip=rstrip(tokens, types) if rstrip else frozenset())
    return backend


def check_spm_vocabulary(f: GGUFFile, tokens: list[str], types, scores) -> None:
    """Refuses, in one line, a vocabulary the SentencePiece form would not tokenize exactly as the
    model's own tokenizer."""
    if types is None or scores is None or len(scores) != len(tokens):
        raise CheckpointError(f"{f.path}: a SentencePiece vocabulary needs tokenizer.ggml.scores and "
                              "tokenizer.ggml.token_type, one per token")
    odd = sorted({int(t) for t in types} - {NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE})
    if odd:
        raise CheckpointError(f"{f.path}: SentencePiece token types {odd} are not supported")
    if not BYTE_PIECES <= {t for t, kind in zip(tokens, types) if kind == BYTE}:
        # without all 256 byte pieces a character outside the vocabulary would become <unk> or be
        # dropped, differently in each implementation
        raise CheckpointError(f"{f.path}: the SentencePiece vocabulary lacks some of the byte pieces <0x00>..<0xFF>")


def spm_merges(tokens: list[str], types, ranks, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a normal piece into two
    pieces of the vocabulary, best piece first. SentencePiece (and llama.cpp's SPM tokenizer) joins
    the adjacent pair whose joined piece is best; HF's BPE applies the best-ranked merge, so ranking
    the merges by their piece gives the same pieces. A piece's own splits go in id order, as
    transformers writes them when it converts a tokenizer.model."""
    merges = []
    for i in sorted((i for i, kind in enumerate(types) if kind == NORMAL), key=lambda i: (ranks[i], i)):
        piece = tokens[i]
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        merges += sorted(((a, b) for a, b in splits if a in vocab and b in vocab),
                         key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
    return merges


def gemma_spaces(tokens: list[str], types) -> tuple[list[str], object]:
    """Gemma's pieces of two or more spaces are user-defined in its tokenizer.model, and the
    converter writes their "▁" as spaces; GemmaTokenizer has them as ordinary pieces of "▁"s,
    which BPE reaches through the merges (transformers' GGUF reader respells them the same way)."""
    tokens, types = list(tokens), types.copy()
    for i, t in enumerate(tokens):
        if t and not t.strip(" ") and types[i] == USER_DEFINED:
            tokens[i], types[i] = SPACE * len(t), NORMAL
    return tokens, types


# tokenizer.ggml.model -> (backend builder, whether BOS is added when the file does not say)
BUILDERS = {"gpt2": (byte_level_backend, False), "llama": (sentencepiece_backend, True)}
