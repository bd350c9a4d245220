"""The Responses API's output items, built from chat's answer fields: a finished message's
`reasoning_content`, `content` and `tool_calls` (message_deltas), or a stream's deltas of the
same, become a `reasoning` item, a `message` with one `output_text` part and `function_call`
items, with the stream events that build them (OutputBuilder)."""
import copy
import uuid


def message_deltas(message: dict) -> list[dict]:
    """A finished message's fields as the deltas a stream of it would have given, in order."""
    deltas = [{"reasoning_content": message["reasoning_content"]}] if message.get("reasoning_content") else []
    if message.get("content"):
        deltas.append({"content": message["content"]})
    return deltas + [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(message.get("tool_calls") or [])]


class OutputBuilder:
    """Chat-style deltas ({"reasoning_content"}, {"content"}, {"tool_calls": [...]}) -> the
    Responses API's output items, and the stream events that build them (without their
    sequence numbers). One item is open at a time: text of another kind, or a new call, closes it."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: int | None = None          # output index of the item being written
        self._calls: dict[int, int] = {}       # chat tool-call index -> output index

    def feed(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def finish(self, status: str = "completed") -> list[dict]:
        """Close the open item: "completed", or "incomplete" when max_output_tokens cut it."""
        return self._close(status)

    def _add(self, item: dict) -> list[dict]:
        events = self._close()
        self.items.append(item)
        self._open = len(self.items) - 1
        return events + [{"type": "response.output_item.added", "output_index": self._open,
                          "item": copy.deepcopy(item)}]

    def _where(self) -> dict:
        return {"item_id": self.items[self._open]["id"], "output_index": self._open}

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self.items[self._open]["type"] != kind:
            if kind == "message":
                item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            events += self._add(item)
            item["content"].append(part)
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                           "part": dict(part)})
        self.items[self._open]["content"][0]["text"] += text
        if kind == "message":
            return events + [{"type": "response.output_text.delta", **self._where(), "content_index": 0,
                              "delta": text, "logprobs": []}]
        return events + [{"type": "response.reasoning_text.delta", **self._where(), "content_index": 0, "delta": text}]

    def _call(self, call: dict) -> list[dict]:
        fn = call.get("function") or {}
        events = []
        if call.get("id"):   # a new call
            events += self._add({"id": new_id("fc"), "type": "function_call", "call_id": call["id"],
                                 "name": fn.get("name", ""), "arguments": "", "status": "in_progress"})
            self._calls[call["index"]] = self._open
        elif self._calls.get(call["index"]) != self._open:
            return []   # arguments of a call that is no longer open: never made by the chat streams
        if fn.get("arguments"):
            self.items[self._open]["arguments"] += fn["arguments"]
            events.append({"type": "response.function_call_arguments.delta", **self._where(),
                           "delta": fn["arguments"]})
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        if self._open is None:
            return []
        item, where = self.items[self._open], self._where()
        events = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                events.append({"type": "response.output_text.done", **where, "content_index": 0,
                               "text": part["text"], "logprobs": []})
            else:
                events.append({"type": "response.reasoning_text.done", **where, "content_index": 0,
                               "text": part["text"]})
            events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)})
        else:
            events.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                           "arguments": item["arguments"]})
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": self._open, "item": copy.deepcopy(item)})
        self._open = None
        return events


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
