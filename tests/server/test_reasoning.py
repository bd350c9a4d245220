"""Reasoning parsers (server/reasoning.py) over whole texts and streams: vLLM's cases for qwen3 and
deepseek_r1, where the prompt leaves the model (thinking open, closed, neither), tags split across
deltas anywhere, streamed == not streamed, and the startup checks on the tokenizer."""
import itertools

import pytest

from pdserve.errors import ConfigError, RequestError
from pdserve.server import reasoning
from pdserve.server.reasoning import ENDED, NONE, OPEN, check_template_kwargs
from pdserve.server.reasoning_parsers import build


class Tok:
    """The tokenizer surface the parsers read: added tokens with ids, everything else characters."""

    def __init__(self, added=("<think>", "</think>"), special=()):
        self.added = {t: 1000 + i for i, t in enumerate(added)}
        self.special = special

    def token_to_id(self, t):
        return self.added.get(t)

    def encode(self, text, add_special_tokens=True):
        return [self.added[text]] if text in self.added else [ord(c) for c in text]

    @property
    def all_special_ids(self):
        return [self.added[t] for t in self.special]


QWEN3 = build("qwen3", Tok())
R1 = build("deepseek_r1", Tok())

# (parser, prompt state, output, reasoning, content)
CASES = [
    # qwen3, as vLLM's tests have them
    (QWEN3, NONE, "<think>This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    (QWEN3, NONE, "This is the rest", None, "This is the rest"),
    (QWEN3, NONE, "<think>This is a reasoning section</think>", "This is a reasoning section", None),
    (QWEN3, NONE, "<think>This is a reasoning\nsection</think>This is the rest\nThat", "This is a reasoning\nsection",
     "This is the rest\nThat"),
    (QWEN3, NONE, "<think>\nthinking\n</think>\n\nanswer", "\nthinking\n", "\n\nanswer"),   # no stripping
    # cut before </think>: still thinking (vLLM's stream says so; its whole-text parse would call it content)
    (QWEN3, NONE, "<think>This is a reasoning section", "This is a reasoning section", None),
    # the template opened <think> (Qwen3 Thinking-2507): the output starts inside it
    (QWEN3, OPEN, "This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    (QWEN3, OPEN, "This is a reasoning section</think>", "This is a reasoning section", None),
    (QWEN3, OPEN, "<think>again</think>rest", "again", "rest"),
    # enable_thinking false: the prompt closed it, all is content, tags or not
    (QWEN3, ENDED, "plain answer", None, "plain answer"),
    (QWEN3, ENDED, "a</think>b", None, "a</think>b"),
    # an answer that merely mentions a tag later is content
    (QWEN3, NONE, "Use <think> tags", None, "Use <think> tags"),
    (QWEN3, NONE, "", None, ""),
    # deepseek_r1: thinking from the start, <think> optional, no </think>: all reasoning
    (R1, NONE, "<think>This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    (R1, OPEN, "This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    (R1, OPEN, "This is a reasoning section", "This is a reasoning section", None),
    (R1, OPEN, "</think>This is the rest", "", "This is the rest"),
    (R1, OPEN, "<think></think>", "", None),
    (R1, OPEN, "a</think>b</think>c", "a", "b</think>c"),
    (R1, ENDED, "just the answer", None, "just the answer"),
]


@pytest.mark.parametrize("parser, state, text, reasoning_text, content", CASES)
def test_split(parser, state, text, reasoning_text, content):
    assert parser.split(text, state) == (reasoning_text, content)


def _streamed(parser, state, pieces):
    s, r, c, kinds = parser.stream(state), [], "", []
    for k, piece in enumerate(pieces):
        d = s.feed(piece, finished=k == len(pieces) - 1)
        r.append(d.reasoning)
        c += d.content
        kinds += ["r"] * bool(d.reasoning) + ["c"] * bool(d.content)
    assert s.result() == parser.split("".join(pieces), state)
    return "".join(r), c, kinds


@pytest.mark.parametrize("parser, state, text, reasoning_text, content", CASES)
def test_stream_equals_split_however_the_text_is_cut(parser, state, text, reasoning_text, content):
    """Every cut into three deltas (tags split anywhere) and character by character: the deltas add
    up to the whole-text split, reasoning never after content, no tag text leaks into a delta."""
    cuts = [[text]] + [[text[:i], text[i:j], text[j:]] for i, j in itertools.combinations(range(len(text) + 1), 2)]
    cuts.append(list(text) + [""])
    for pieces in cuts:
        r, c, kinds = _streamed(parser, state, pieces)
        assert r == (reasoning_text or "")
        assert c == (content or "")
        assert kinds == sorted(kinds, key="rc".index), pieces   # all reasoning deltas come first


def test_a_partial_tag_is_held_back_only_while_it_can_still_be_one():
    s = QWEN3.stream(NONE)
    assert s.feed("<thi") == reasoning.Delta()            # maybe <think>
    assert s.feed("nk>abc</th") == reasoning.Delta("abc")  # </th... held
    assert s.feed("ere") == reasoning.Delta("</there")      # it was not </think>
    assert s.feed("</think>ok") == reasoning.Delta("", "ok")
    s = QWEN3.stream(NONE)
    assert s.feed("<tx") == reasoning.Delta("", "<tx")      # not <think>: the model did not think


def test_prompt_state_reads_the_generation_prompt():
    assert QWEN3.prompt_state("<|im_start|>assistant\n") == NONE
    assert QWEN3.prompt_state("<|im_start|>assistant\n<think>\n") == OPEN
    assert QWEN3.prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ENDED
    assert QWEN3.grammar_after_token(ENDED) is None
    assert QWEN3.grammar_after_token(OPEN) == QWEN3.grammar_after_token(NONE) == QWEN3.end_id == 1001


class ChatTok(Tok):
    """A Qwen3-like template: an earlier turn's thinking, and enable_thinking."""

    def apply_chat_template(self, messages, add_generation_prompt=True, enable_thinking=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n")
        return text


def test_chat_prompt_state_ignores_earlier_turns():
    tok = ChatTok()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>x</think>hello"},
                {"role": "user", "content": "again"}]
    assert reasoning.chat_prompt_state(QWEN3, tok, messages) == NONE   # the earlier </think> is not this turn's
    assert reasoning.chat_prompt_state(QWEN3, tok, messages, enable_thinking=False) == ENDED


def test_build_refuses_what_cannot_work_in_one_line():
    assert build(None, Tok()) is None
    with pytest.raises(ConfigError, match="choose from deepseek_r1, gpt_oss, qwen3"):
        build("granite", Tok())
    for tok, why in ((Tok(added=("<think>",)), "'</think>' is not a single token"),
                     (Tok(added=()), "'<think>' is not a single token"),
                     (Tok(special=("</think>",)), "special token")):
        with pytest.raises(ConfigError, match=why) as e:
            build("qwen3", tok)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs, ok", [
    ({"enable_thinking": False}, True), ({"thinking": True, "custom": [1, {"a": None}]}, True), (None, True),
    ({"messages": []}, False), ({"tools": []}, False), ({"add_generation_prompt": False}, False),
    ({"bos_token": "x"}, False), ({"raise_exception": 1}, False), ({"not a name": 1}, False)])
def test_template_kwargs(kwargs, ok):
    if ok:
        assert check_template_kwargs(kwargs) == (kwargs or {})
    else:
        with pytest.raises(RequestError) as e:
            check_template_kwargs(kwargs)
        assert e.value.param == "chat_template_kwargs"


def test_a_grammar_waiting_for_its_token_keeps_a_sequence_from_speculating():
    from pdserve.engine.sequence import Sequence
    from pdserve.sampling_params import SamplingParams
    from pdserve.spec_decode.speculator import eligible
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0), 0.0)
    seq.num_computed_tokens = 2
    assert eligible(seq)
    seq.pending_matcher = object()   # a draft past </think> would escape the grammar
    assert not eligible(seq)


@pytest.mark.parametrize("bad", [-1, "5", 2**31])
def test_grammar_after_token_is_a_token_id(bad):
    from pdserve.sampling_params import SamplingParams
    with pytest.raises(RequestError) as e:
        SamplingParams(grammar_after_token=bad)
    assert e.value.param == "grammar_after_token"
