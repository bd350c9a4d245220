"""Constrained decoding: a request's grammar (a JSON schema, any JSON object, a regex, a list of
choices, a Lark or GBNF grammar) as a mask over the next token, through llguidance.

Each constrained sequence holds an llguidance matcher. In every step the sampler asks the
matchers of its constrained rows for their masks (one after another, each timed), sets the
disallowed logits of those rows to -inf, samples, and feeds each sampled token back to its
matcher. Grammars are compiled once per spec: new sequences get a copy of a cached matcher.
llguidance was picked over xgrammar by measured per-token mask cost on CPU (see docs/API.md).
"""
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance as llg
import numpy as np
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from pdserve.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Compact JSON, no free whitespace: a model (a random one in the tests) cannot pad forever.
JSON_OPTIONS = {"whitespace_flexible": False}
# What one matcher may cost, as llguidance counts it (its docs' speeds: ~14k lexer fuel and ~20k
# Earley items per ms; its defaults are 200k and 50k): one mask computation stays within ~5 ms,
# and a grammar that needs more fails its own request (GrammarFailed) instead of slowing every
# step. The grammars of the tests and benchmarks need under 3k fuel and 1.3k items a step.
# verbose_errors off: an error names the limit, not the grammar (a 150 KB schema per log line).
LIMITS = {"step_lexer_fuel": 50_000, "step_max_items": 20_000, "max_items_in_row": 2_000,
          "initial_lexer_fuel": 1_000_000, "max_lexer_states": 50_000, "max_grammar_size": 500_000}
ERROR_CHARS = 300   # llguidance's messages, quoted in errors and logs, are cut to this
# What one sequence's mask may cost in a step, in CPU time of the thread computing it (load does
# not inflate it). LIMITS count Earley items, not the work per item: an ambiguous grammar's items
# each cost more as its text grows (`x: "a" | x x | x x x` took 110 ms a mask at 300 tokens, under
# LIMITS), so the time itself is bounded too. A usual mask takes 0.03-0.2 ms; the worst of 10k-value
# enums, 1,500-branch anyOfs and 450 optional pattern properties took 0.5 ms.
STEP_CPU_BUDGET_S = 0.02


def short(message: str) -> str:
    """An llguidance message as one bounded line."""
    line = " ".join(message.replace("<non-verbose/>", "").split())
    return line if len(line) <= ERROR_CHARS else line[:ERROR_CHARS - 3] + "..."


class GrammarFailed(RequestError):
    """A request's grammar failed while it generated (a limit of LIMITS, STEP_CPU_BUDGET_S, ...):
    that request fails alone, and its client is told why."""
    code = "grammar_failed"


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request constrains its output to. `value`: the schema as JSON text (json), the
    regex, the choices as a JSON list (choice), or the grammar's text; `param` is the request
    field it came from, which an error names."""
    kind: str
    value: str = ""
    param: str = "response_format"

    def grammar(self) -> str:
        """llguidance's grammar text; ValueError if the spec cannot be one."""
        if self.kind == "json":
            return llg.LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            choices = json.loads(self.value)
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if self.kind == "grammar":
            return llg.LLMatcher.grammar_from_lark(any_to_lark(self.value))
        raise ValueError(f"unknown grammar kind {self.kind!r}")


class GrammarCompiler:
    """Grammar specs -> llguidance matchers for one tokenizer, cached by spec. Thread-safe: the
    server validates specs off the event loop while the engine thread makes matchers."""

    CACHE_SIZE = 256

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size        # the model's: logits may have rows the tokenizer lacks
        self._lltok = None
        self._cache: OrderedDict[GrammarSpec, llg.LLMatcher | RequestError] = OrderedDict()
        self._lock = threading.Lock()
        # compiles at once: at most half the cores (one here), so clients sending big schemas
        # together leave the engine its share (llguidance's limits do not bound a compile's time)
        self._compiling = threading.BoundedSemaphore(max(1, (os.cpu_count() or 2) // 2))
        # the last fill_masks call's matchers over STEP_CPU_BUDGET_S: id -> CPU seconds (their
        # requests fail in that step, so an id is not reused before the next call replaces this)
        self.overruns: dict[int, float] = {}

    @property
    def lltokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._lltok is None:   # ~0.5 s for a 32k vocabulary: once, on first use
                tok = self.tokenizer
                self._lltok = llg.LLTokenizer(tok.backend_json(), n_vocab=self.vocab_size,
                                              eos_token=list(tok.eos_token_ids) or None)
            return self._lltok

    def check(self, spec: GrammarSpec) -> None:
        """Compile (or find) the spec; RequestError naming spec.param if it is not a valid grammar."""
        self._pristine(spec)

    def matcher(self, spec: GrammarSpec) -> llg.LLMatcher:
        """A fresh matcher for one sequence."""
        return self._pristine(spec).deep_copy()

    def _pristine(self, spec: GrammarSpec) -> llg.LLMatcher:
        lltok = self.lltokenizer
        with self._lock:   # a hit never waits for another spec's compile
            m = self._cache.get(spec)
        if m is None:
            with self._compiling:
                with self._lock:   # compiled while this one waited?
                    m = self._cache.get(spec)
                if m is None:
                    try:
                        m = self._compile(spec, lltok)
                    except RequestError as e:
                        m = e   # cached too: a refused schema sent again costs no second compile
        with self._lock:
            self._cache[spec] = m   # (again): the most recently used
            self._cache.move_to_end(spec)
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        if isinstance(m, RequestError):
            raise RequestError(str(m), param=m.param)   # a new one each time: no traceback kept
        return m

    @staticmethod
    def _compile(spec: GrammarSpec, lltok: llg.LLTokenizer) -> llg.LLMatcher:
        """A matcher in its first state, its first mask computed (each copy starts from it: that
        mask cost one 2,000-property schema 25 ms, paid by every choice of every request in the
        engine's step before). RequestError if the spec is invalid, or too complex for LIMITS
        in its first mask or the first free one: the client's fault, refused before admission."""
        try:
            text = spec.grammar()
        except (ValueError, TypeError, GbnfToLarkError) as e:   # the GBNF converter's error is neither
            raise RequestError(f"{spec.param}: not a valid {spec.kind} ({short(str(e))})", param=spec.param) from None
        # drops the GIL while it compiles
        m = llg.LLMatcher(lltok, text, log_level=0, limits=llg.LLParserLimits(verbose_errors=False, **LIMITS))
        if m.is_error():
            raise RequestError(f"{spec.param}: unsupported or invalid {spec.kind}: {short(m.get_error())}",
                               param=spec.param)
        m.compute_bitmask()
        probe = m.deep_copy()   # past the forced start (e.g. "{"): where a schema's many branches open
        probe.consume_tokens(probe.compute_ff_tokens())
        probe.compute_bitmask()
        for x in (m, probe):
            if x.is_error():
                raise RequestError(f"{spec.param}: the {spec.kind} grammar is too complex for this server's "
                                   f"per-step limits: {short(x.get_error())}", param=spec.param)
        return m

    def fill_masks(self, matchers: list[llg.LLMatcher]) -> torch.Tensor:
        """The allowed-token bitmask of each matcher, (len, words) int32. Ids past the tokenizer's
        vocabulary (padding rows of the model's) have no text: never allowed
        (tests/engine/test_grammar.py). A matcher in error gets an empty mask, one over
        STEP_CPU_BUDGET_S goes into `overruns`: the caller fails their requests (failure()).
        One after another on this thread (the model runner's mask thread, beside the forward),
        so each is timed; a usual mask is 0.03-0.2 ms."""
        words = mask_words(self.vocab_size)
        masks = torch.empty((len(matchers), words), dtype=torch.int32)
        ptr, overruns = masks.data_ptr(), {}
        for i, m in enumerate(matchers):
            start = time.thread_time()
            m.unsafe_compute_mask_ptr(ptr + i * words * 4, words * 4)   # drops the GIL
            cost = time.thread_time() - start
            if cost > STEP_CPU_BUDGET_S:
                overruns[id(m)] = cost
        self.overruns = overruns
        return masks

    def failure(self, matcher: "llg.LLMatcher | None", spec: "GrammarSpec | None") -> GrammarFailed | None:
        """Why a sequence's step failed, if its grammar is the cause."""
        if matcher is None:
            return None
        cost = self.overruns.get(id(matcher))
        if cost is not None:
            why = (f"one token's mask took {cost * 1000:.0f} ms of CPU, over this server's per-step budget of "
                   f"{STEP_CPU_BUDGET_S * 1000:.0f} ms")
        elif matcher.is_error():
            why = f"over this server's per-step limits, or invalid: {short(matcher.get_error())}"
        else:
            return None
        return GrammarFailed(f"{spec.param}: the {spec.kind} grammar failed while generating: {why}",
                             param=spec.param)


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set logits[rows] to -inf wherever the row's bitmask has a 0."""
    V = logits.shape[-1]
    bits = np.unpackbits(masks.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :V]
    banned = (torch.from_numpy(bits) == 0).to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
    else:
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill_(banned, float("-inf"))


def forced_tokens(masks: torch.Tensor) -> list[int | None]:
    """Per row: the one token its mask allows, or None (zero or several allowed). In a JSON
    schema many steps are forced (keys, punctuation): those rows need no logits at all."""
    words = masks.numpy().view(np.uint32)
    counts = np.bitwise_count(words).sum(axis=1)
    out: list[int | None] = [None] * len(counts)
    for r in np.flatnonzero(counts == 1):
        w = int(np.flatnonzero(words[r])[0])
        out[r] = w * 32 + int(words[r, w]).bit_length() - 1
    return out
