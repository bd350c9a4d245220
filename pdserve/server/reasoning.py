"""Reasoning parsers (--reasoning-parser, vLLM's names): a thinking model's output -> (reasoning,
answer). The thinking goes to `reasoning_content` (and `reasoning`, vLLM's newer name), the answer
to `content`; tool-call parsing and structured outputs apply to the answer only.

- qwen3: `<think>reasoning</think>answer`. The output starts in thinking when it opens with
  `<think>`, or when the prompt's generation turn already opened it (Qwen3 "Thinking-2507"
  templates); a generation turn that closed it (`enable_thinking: false` renders
  `<think>\\n\\n</think>\\n\\n`) means there is no thinking, and so does an output that does not
  start with `<think>` (the model did not think).
- deepseek_r1: the template's generation prompt opens `<think>`, so the output starts inside
  thinking (a leading `<think>` the model writes anyway is dropped) and `</think>` ends it; with
  no `</think>` the whole output is reasoning.
- gpt_oss: gpt-oss's harmony channels, rendered and parsed on token ids by openai-harmony
  (pdserve/server/harmony.py): a parser whose `harmony` is true also renders the prompt and finds
  the tool calls.

The names and `build` are in reasoning_parsers.py (the registry, above both kinds).

One state machine (ReasoningStream) splits a stream and a whole text alike, so a streamed answer
and a non-streamed one split the same way: a tag split across deltas is held back until it is
whole. The tags must be single tokens of the checkpoint (as vLLM requires); the engine starts a
request's grammar after the end tag's token (SamplingParams.grammar_after_token), the token
vLLM's structured-output manager waits for.

Reusable (the Responses API): `parser.split(text, state)` for a finished text,
`parser.stream(state)` for a stream, `parser.prompt_state(...)` from the generation prompt.
"""
from dataclasses import dataclass

from pdserve.errors import ConfigError

# Where the prompt leaves the model (prompt_state): thinking already ended, opened, or neither.
ENDED, OPEN, NONE = "ended", "open", "none"


class ReasoningParser:
    name = ""
    start = "<think>"
    end = "</think>"
    # whether an output that does not open with the start tag is thinking anyway (deepseek_r1)
    implicit_start = False
    # whether the parser renders the prompt and reads the output's token ids (gpt_oss: harmony.py)
    harmony = False

    def __init__(self, tokenizer):
        ids = {}
        for tag in (self.start, self.end):
            tid = tokenizer.token_to_id(tag)
            if tid is None or tokenizer.encode(tag, add_special_tokens=False) != [tid]:
                raise ConfigError(f"--reasoning-parser {self.name}: {tag!r} is not a single token of this "
                                  "checkpoint's tokenizer (a reasoning parser needs its think tags as tokens)")
            if tid in set(tokenizer.all_special_ids):
                raise ConfigError(f"--reasoning-parser {self.name}: this tokenizer marks {tag!r} as a special "
                                  "token, which decoding drops from the text")
            ids[tag] = tid
        self.start_id, self.end_id = ids[self.start], ids[self.end]

    def prompt_state(self, generation_prompt: str) -> str:
        """ENDED, OPEN or NONE: the last think tag in the text the template added for the
        assistant's turn (vLLM's is_reasoning_end over the prompt)."""
        i, j = generation_prompt.rfind(self.start), generation_prompt.rfind(self.end)
        if j > i:
            return ENDED
        return OPEN if i >= 0 else NONE

    def grammar_after_token(self, state: str) -> int | None:
        """The token after which a grammar starts constraining (None: from the first token)."""
        return None if state == ENDED else self.end_id

    def stream(self, state: str = NONE) -> "ReasoningStream":
        return ReasoningStream(self, state)

    def split(self, text: str, state: str = NONE) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output. reasoning is None when there was no
        thinking; content is None when thinking took all of it (vLLM's `content or None`)."""
        s = self.stream(state)
        s.feed(text, finished=True)
        return s.result()


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One output's text, delta by delta, split into reasoning and content. States: "start"
    (waiting to see whether the output opens with the start tag), "reasoning", "content"."""

    def __init__(self, parser: ReasoningParser, state: str = NONE):
        self.parser = parser
        self.buffer = ""          # text received but not yet classified (a possible partial tag)
        self.reasoning = None     # str once thinking began
        self.content = ""
        if state == ENDED:
            self.mode = "content"
        else:
            self.mode = "start"
            self.fallback = "reasoning" if state == OPEN or parser.implicit_start else "content"

    def feed(self, text: str, finished: bool = False) -> Delta:
        """The reasoning and content this text (and what was held back) makes now; with
        finished, nothing is held back."""
        self.buffer += text
        out = Delta()
        p = self.parser
        while True:
            if self.mode == "start":
                tag = p.start
                if self.buffer.startswith(tag):
                    self.buffer = self.buffer[len(tag):]
                    self._begin_reasoning()
                    continue
                if tag.startswith(self.buffer) and not finished:
                    return out   # "", or a prefix of the start tag: wait for more
                if self.fallback == "reasoning":
                    self._begin_reasoning()
                else:
                    self.mode = "content"
                continue
            if self.mode == "reasoning":
                i = self.buffer.find(p.end)
                if i >= 0:
                    piece, self.buffer = self.buffer[:i], self.buffer[i + len(p.end):]
                    self.mode = "content"
                else:
                    keep = 0 if finished else _partial_suffix(self.buffer, p.end)
                    piece, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                self.reasoning += piece
                out.reasoning += piece
                if self.mode == "reasoning":
                    return out
                continue
            # content
            out.content += self.buffer
            self.content += self.buffer
            self.buffer = ""
            return out

    def _begin_reasoning(self) -> None:
        self.mode = "reasoning"
        if self.reasoning is None:
            self.reasoning = ""

    def result(self) -> tuple[str | None, str | None]:
        if self.reasoning is None:
            return None, self.content
        return self.reasoning, self.content or None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (a tag still arriving)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# Template variables a request's chat_template_kwargs may not set: what the server itself passes
# (and the template's special tokens and helpers).
RESERVED_TEMPLATE_VARS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
    "tokenize", "return_dict", "raise_exception", "strftime_now", "bos_token", "eos_token", "unk_token",
    "pad_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens"})


def check_template_kwargs(kwargs: dict | None) -> dict:
    """A request's chat_template_kwargs, checked (RequestError naming the field)."""
    from pdserve.errors import RequestError
    if not kwargs:
        return {}
    for key in kwargs:
        if not key.isidentifier():
            raise RequestError(f"chat_template_kwargs: {key!r} is not a template variable name",
                               param="chat_template_kwargs")
        if key in RESERVED_TEMPLATE_VARS:
            raise RequestError(f"chat_template_kwargs: {key!r} is set by the server and cannot be overridden",
                               param="chat_template_kwargs")
    return dict(kwargs)


def chat_prompt_state(parser: ReasoningParser, tokenizer, messages: list[dict], **template_kwargs) -> str:
    """prompt_state of a chat: from the text the template adds for the assistant's turn (the
    render with add_generation_prompt minus the one without), so an earlier turn's `</think>`
    does not count; the whole prompt where the two renders do not share a prefix."""
    if parser.harmony:   # no chat template: the parser reads the answer's tokens from the start
        return parser.prompt_state("")
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
    base = tokenizer.apply_chat_template(messages, add_generation_prompt=False, **template_kwargs)
    return parser.prompt_state(full[len(base):] if full.startswith(base) else full)


def message_fields(reasoning: str | None) -> dict:
    """The reasoning of a message or delta under both names clients read: vLLM's `reasoning` and
    `reasoning_content` (DeepSeek's API, vLLM before 0.11)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}
