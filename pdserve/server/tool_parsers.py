"""Tool-call parsers (--tool-call-parser): a model's answer -> (content, tool calls), in the
format its chat template teaches it.

- hermes (also qwen2.5: Hermes 2 Pro, Qwen2.5): `<tool_call>{"name": .., "arguments": {..}}</tool_call>`,
  any number, after optional text.
- llama3_json (Llama 3.1/3.2): the whole answer is one JSON object `{"name": .., "parameters": {..}}`
  (or several separated by ";"), optionally after `<|python_tag|>`.

Calls are (name, arguments as a JSON string). An answer that does not parse is content."""
import json
import re


class ToolParser:
    name = ""

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        raise NotImplementedError

    def content_prefix(self, text: str, finished: bool) -> int:
        """How much of `text` (the answer so far) is surely content, for streaming: text from
        where a tool call starts, or might be starting, is held back."""
        raise NotImplementedError


def _call(obj, args_key: str) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text):
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text, start):
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []   # not a well-formed call: it is all content
            calls.append(call)
        return text[:start].strip() or None, calls

    def content_prefix(self, text, finished):
        start = text.find(self.START)
        if start >= 0:
            return start
        if finished:
            return len(text)
        # a tail that could still grow into "<tool_call>" is held back
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text):
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        if not body.startswith("{"):
            return text, []
        calls, decoder, i = [], json.JSONDecoder(), 0
        try:
            while i < len(body):
                obj, i = decoder.raw_decode(body, i)
                call = _call(obj, "parameters")
                if call is None:
                    return text, []
                calls.append(call)
                while i < len(body) and body[i] in " \t\r\n;":
                    i += 1
        except json.JSONDecodeError:
            return text, []
        return None, calls

    def content_prefix(self, text, finished):
        body = text.lstrip()
        if finished:
            return len(text)
        # an answer that starts (or may start) as a call is held back whole
        if not body or body.startswith("{") or self.TAG.startswith(body[:len(self.TAG)]) or body.startswith(self.TAG):
            return 0
        return len(text)


PARSERS = {"hermes": HermesParser, "qwen2.5": HermesParser, "llama3_json": Llama3JsonParser}
