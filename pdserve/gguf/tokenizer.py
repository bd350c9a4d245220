"""The tokenizer of a GGUF file, built from its `tokenizer.*` metadata as an HF fast tokenizer.

The vocabulary (tokenizer.ggml.tokens, in byte-level form), the merges and the token types come
from the file; the pre-tokenizer is the one `tokenizer.ggml.pre` names, written as the regex and
normalizer that family's HF tokenizer.json has (llama.cpp keeps the same regexes in
llama-vocab.cpp); CONTROL tokens are special added tokens, USER_DEFINED ones plain added tokens;
BOS is prepended when tokenizer.ggml.add_bos_token says so; UNUSED tokens (the converter's
padding of the vocabulary) are left out. Generation stops at the file's eos,
eot and eom tokens and, as llama.cpp decides its end-of-generation tokens, at any CONTROL token
whose text is one of the usual end-of-turn markers (END_OF_TURN)."""
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
CONTROL, USER_DEFINED, UNUSED = 3, 4, 5   # llama.cpp's token types
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
               "<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def build_tokenizer(f: GGUFFile) -> tuple[RustTokenizer, dict, dict, str | None]:
    """(backend, tokenizer_config, generation_config, chat_template), as Tokenizer's constructor takes them."""
    model = f.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"{f.path}: tokenizer model {model!r} is not supported (supported: gpt2, "
                              "byte-level BPE)")
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{f.path}: pre-tokenizer {pre!r} is not supported "
                              f"(supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = f.string_array("tokenizer.ggml.tokens")
    merges = f.string_array("tokenizer.ggml.merges")
    types = f.int_array("tokenizer.ggml.token_type")
    if tokens is None or merges is None:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    if types is not None and len(types) != len(tokens):
        raise CheckpointError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    # UNUSED tokens are the converter's padding of the vocabulary to the embedding's rows
    # ([PAD1500], ...): not the tokenizer's; ids beyond it decode to nothing, as in transformers
    vocab = {t: i for i, t in enumerate(tokens) if types is None or int(types[i]) != UNUSED}
    try:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = RustTokenizer(BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
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
    if types is not None:
        added = [AddedToken(tokens[i], special=int(types[i]) == CONTROL, normalized=False)
                 for i in range(len(tokens)) if int(types[i]) in (CONTROL, USER_DEFINED)]
        backend.add_tokens(added)   # already in the vocabulary: they keep their ids

    def text(key):
        i = f.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos, eos = text("bos"), text("eos")
    add_bos, add_eos = f.get("tokenizer.ggml.add_bos_token", False), f.get("tokenizer.ggml.add_eos_token", False)
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise CheckpointError(f"{f.path}: tokenizer.ggml.add_bos/eos_token is set but the token id is missing")
    if add_bos or add_eos:
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
        specials = [(t, vocab[t]) for t in dict.fromkeys(x for x, on in ((bos, add_bos), (eos, add_eos)) if on)]
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    config = {"bos_token": bos, "eos_token": eos, "unk_token": text("unknown"), "pad_token": text("padding"),
              "clean_up_tokenization_spaces": False}
    stops = [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if types is not None:
        stops += [i for i, t in enumerate(tokens) if t in END_OF_TURN and int(types[i]) == CONTROL]
    generation = {"eos_token_id": list(dict.fromkeys(i for i in stops if isinstance(i, int)))}
    return backend, config, generation, f.get("tokenizer.chat_template")
