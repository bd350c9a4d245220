"""Tokenizer for a HF checkpoint directory, and streaming detokenization.

We read the same files `transformers.AutoTokenizer` reads (tokenizer.json through the
`tokenizers` library, tokenizer_config.json, chat_template.jinja, generation_config.json)
and reproduce its behaviour for fast tokenizers: ids from `encode` and text from `decode`
are the ones transformers gives, and chat templates render in a sandboxed jinja2
environment with the helpers HF templates expect.
"""
import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder

from pdserve.checkpoint_files import checkpoint_file, read_json_object
from pdserve.errors import CheckpointError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as serialized AddedTokens.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_from_config(value) -> str | None:
    # Either a string or a list of named templates ({"name": ..., "template": ...}); we use "default".
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return None


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    # The same environment settings as transformers, so templates from the Hub render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Encode/decode and chat templating for one checkpoint directory.

    vocab_size counts every id the tokenizer knows (base vocabulary plus added tokens); a
    model's embedding may be larger, and ids beyond the tokenizer decode to nothing.
    """

    def __init__(self, backend: _RustTokenizer, config: dict, generation_config: dict, chat_template: str | None):
        self._tok = backend
        self.chat_template = chat_template
        self.special_tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
        # transformers registers named special tokens missing from the vocabulary as added tokens.
        missing = [t for t in self.special_tokens.values() if t is not None and backend.token_to_id(t) is None]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        # transformers' legacy cleanup, which it only applies to non-BPE tokenizers
        self._cleanup = self.clean_up_spaces and type(backend.model).__name__ != "BPE"
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._max_token_chars: int | None = None
        self.bos_token_id = self.token_to_id(self.special_tokens["bos_token"])
        self.pad_token_id = self.token_to_id(self.special_tokens["pad_token"])
        self.unk_token_id = self.token_to_id(self.special_tokens["unk_token"])
        eos = generation_config.get("eos_token_id")
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        tok_eos = self.token_to_id(self.special_tokens["eos_token"])
        self.eos_token_ids = list(dict.fromkeys([int(i) for i in eos] + ([tok_eos] if tok_eos is not None else [])))
        self._template = None
        self._byte_pieces: dict[bool, _BytePieces] = {}

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """The tokenizer of an HF checkpoint directory, or of a GGUF model (from its metadata)."""
        from pdserve.gguf import gguf_file
        gguf = gguf_file(path)
        if gguf is not None:
            from pdserve.gguf.reader import open_gguf
            from pdserve.gguf.tokenizer import build_tokenizer
            return cls(*build_tokenizer(open_gguf(gguf)))
        tok_file = checkpoint_file(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise CheckpointError(f"{tok_file}: file not found (a HF fast tokenizer is required)")
        try:
            backend = _RustTokenizer.from_file(tok_file)
        except Exception as e:
            raise CheckpointError(f"{tok_file}: cannot load tokenizer ({str(e).splitlines()[0]})") from None
        config = read_json_object(checkpoint_file(path, "tokenizer_config.json")) or {}
        gen_config = read_json_object(checkpoint_file(path, "generation_config.json")) or {}
        template = _chat_template_from_config(config.get("chat_template"))
        jinja_file = checkpoint_file(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):  # transformers prefers the separate file when both exist
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return cls(backend, config, gen_config, template)

    # ---- ids <-> text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # tokenizer.json's post-processor decides which BOS/EOS are added: transformers 5 ignores
        # add_bos_token/add_eos_token in tokenizer_config.json whenever tokenizer.json exists.
        if len(text) > 4096:   # encode_batch releases the GIL while it works; encode holds it
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: a text of c characters has at least
        c / max_token_chars tokens (vocabulary entries are byte-level or SentencePiece strings
        at least as long as the text they decode to)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))
        return self._max_token_chars

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # The backend silently drops ids it does not know (as transformers does); negative ids would overflow.
        text = self._tok.decode([i for i in ids if i >= 0], skip_special_tokens=skip_special_tokens)
        if self._cleanup:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def backend_json(self) -> str:
        """tokenizer.json's text as loaded (with the special tokens added above): for libraries
        that build their own view of the vocabulary (llguidance)."""
        return self._tok.to_str()

    def byte_pieces(self, skip_special_tokens: bool = True) -> "_BytePieces | None":
        """{id: bytes} such that decode(ids) == b"".join(pieces[i] for i in ids).decode("utf-8",
        "replace"), where decode() is exactly that: a plain ByteLevel decoder (one lossy UTF-8
        conversion of all the tokens' bytes) and no cleanup after it. None for other tokenizers."""
        if self._cleanup or not isinstance(self._tok.decoder, ByteLevelDecoder):
            return None
        if skip_special_tokens not in self._byte_pieces:
            self._byte_pieces[skip_special_tokens] = _BytePieces(self._tok, skip_special_tokens)
        return self._byte_pieces[skip_special_tokens]

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id) if token_id >= 0 else None

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    # ---- chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render messages ({"role", "content"}) to a prompt string.

        Without a chat template the fallback is "<role>: <content>\\n" per message, then
        "assistant:" when add_generation_prompt. Extra kwargs (tools, documents, ...) are
        passed to the template. Template errors raise ValueError.
        """
        if self.chat_template is None:
            text = "".join(f"{m.get('role', '')}: {m.get('content', '')}\n" for m in messages)
            return text + ("assistant:" if add_generation_prompt else "")
        try:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            variables = {k: v for k, v in self.special_tokens.items() if v is not None}
            variables.update(kwargs)
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Prompt ids for a chat, as transformers' apply_chat_template(tokenize=True) gives them.

        The template writes any BOS itself, so the rendered text is encoded without special
        tokens; the plain fallback has no BOS in its text, so it gets the usual ones.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=self.chat_template is None)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, which tokenizers' ByteLevel uses: character -> the byte it
    stands for. Printable bytes stand for themselves; the other 68 are shifted to U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(shifted)}


_BYTE_OF_CHAR = _byte_level_alphabet()


class _BytePieces(dict):
    """id -> the bytes tokenizers' ByteLevel decoder makes of that token: its characters mapped
    back through the byte-level alphabet, or its own UTF-8 when one of them is not in it (an
    added token's text); b"" where decode() drops the id (an unknown or negative id, or a special
    token while skipping them, which decode() recognizes by its text). Every id of the vocabulary
    is filled up front: a lookup in a step must not cost a conversion. Others on first lookup."""

    def __init__(self, backend: _RustTokenizer, skip_special_tokens: bool):
        super().__init__()
        self.backend = backend
        self.skipped = ({t.content for t in backend.get_added_tokens_decoder().values() if t.special}
                        if skip_special_tokens else set())
        for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
            self[token_id] = self._piece(token_id)

    def _piece(self, token_id: int) -> bytes:
        token = self.backend.id_to_token(token_id) if token_id >= 0 else None
        if token is None or token in self.skipped:
            return b""
        try:
            return bytes(map(_BYTE_OF_CHAR.__getitem__, token))
        except KeyError:
            return token.encode()

    def __missing__(self, token_id: int) -> bytes:
        self[token_id] = piece = self._piece(token_id)
        return piece


class IncrementalDetokenizer:
    """Streams text for generated ids; never emits half a UTF-8 character.

    Each step decodes a short window ending at the newest token twice, without and with the
    tokens not yet emitted, and emits the difference. The window starts a few tokens back so
    that decoders which depend on the previous token (e.g. a leading-space rule) see it.
    While the decoded text ends in U+FFFD, the last character is incomplete and is held back.

    Byte-level tokenizers (GPT-2, Llama 3, Qwen; Tokenizer.byte_pieces) get the same text from
    bytes, without decoding (~0.25 us a token instead of ~2.5): there decode() is one lossy UTF-8
    conversion of all the tokens' bytes, and the window only ever moves past text that ended in
    a complete character, after which the conversion starts afresh. So the longer window's text
    is the shorter one's plus the conversion of the bytes of the tokens not yet emitted: it is
    longer exactly when there are such bytes, the delta is their conversion, and the left
    context plays no part. Python's "replace" and Rust's from_utf8_lossy both substitute
    maximal subparts (tests/test_tokenizer.py compares them).
    """

    CONTEXT = 5  # prompt tokens kept as left context for the first window
    # one per request, touched every step: slots, not a dict
    __slots__ = ("tokenizer", "skip_special_tokens", "_pieces", "_pending", "ids", "read_offset")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._pieces = tokenizer.byte_pieces(skip_special_tokens)
        self._pending = b""   # with byte pieces: the bytes of the ids not yet emitted
        self.ids = list(prompt_ids[-self.CONTEXT:])   # the window: the emitted ids it starts with, then the held ones
        # A prompt cut inside a character (possible with raw token-id prompts) must not merge with
        # the generated bytes: decode(generated ids) would not merge them either.
        if self._pieces is None and self._decode(self.ids).endswith("\ufffd"):
            self.ids = []
        self.read_offset = len(self.ids)  # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated id; returns the newly completed text (may be "")."""
        if self._pieces is not None:   # (inlined: this runs per token and stream in every step)
            pending = self._pending + self._pieces[token_id]
            if pending:
                new_text = pending.decode("utf-8", "replace")
                if not new_text.endswith("\ufffd"):   # whole characters: emit (no id window here)
                    self._pending = b""
                    return new_text
            self._pending = pending
            return ""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[:self.read_offset])
        new_text = self._decode(self.ids)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return self._emit(new_text[len(prefix_text):])

    def _emit(self, delta: str) -> str:
        # The next window starts at the ids this delta came from; drop the ids left of it.
        del self.ids[:self.read_offset]
        self.read_offset = len(self.ids)
        self._pending = b""
        return delta

    def flush(self) -> str:
        """Text still held back when generation ends (e.g. an invalid byte sequence, shown as U+FFFD)."""
        if self._pieces is not None:
            return self._emit(self._pending.decode("utf-8", "replace"))
        prefix_text = self._decode(self.ids[:self.read_offset])
        new_text = self._decode(self.ids)
        return self._emit(new_text[len(prefix_text):])
