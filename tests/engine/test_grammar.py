"""Constrained decoding in the engine: every constrained output matches its grammar whatever the
model (random weights here), greedy or sampled, batched with free requests; constrained rows
never take the fused argmax path; logits past the tokenizer's vocabulary are masked; a grammar too
complex for the per-step limits is refused, or fails its own request alone, in one short line."""
import json
import logging
import re

import jsonschema
import pytest
from pdserve.engine import grammar
from pdserve.engine.grammar import GrammarFailed, GrammarSpec
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import RequestError
from pdserve.sampling_params import SamplingParams
from tests.helpers import finish_all

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "score": {"type": "number"},
    "active": {"type": "boolean"},
    "tags": {"type": "array", "maxItems": 3,
             "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 6},
                                                        "v": {"type": "integer", "maximum": 99}},
                       "required": ["k", "v"], "additionalProperties": False}}},
    "required": ["name", "age", "score", "active", "tags"], "additionalProperties": False}
JSON = GrammarSpec("json", json.dumps(SCHEMA))


def run(engine, requests) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    finals = finish_all(engine)
    engine.block_manager.check_all_free()
    return finals


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(tiny_llama, max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=256, block_size=16)


def test_outputs_match_their_grammar_greedy_and_sampled_among_free_requests(engine):
    specs = {"json": JSON, "object": GrammarSpec("json_object"), "regex": GrammarSpec("regex", r"[a-z]{2,5}-[0-9]{3}"),
             "choice": GrammarSpec("choice", json.dumps(["red", "green", "dark blue"])),
             "grammar": GrammarSpec("grammar", 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/')}
    reqs = []
    for temp in (0.0, 0.7, 1.5):
        for name, spec in specs.items():
            for j in range(2):
                reqs.append((f"{name}-{temp}-{j}", f"Story {j}:", SamplingParams(
                    max_tokens=300, temperature=temp, seed=j, grammar=spec)))
        reqs.append((f"free-{temp}", "Story:", SamplingParams(max_tokens=30, temperature=temp, ignore_eos=True)))
    finals = run(engine, reqs)
    for rid, out in finals.items():
        kind = rid.split("-")[0]
        if kind == "free":
            assert out.finish_reason == "length"
            continue
        if kind == "object":   # unbounded (a key may run on): it ends in time, or is cut at max_tokens
            assert out.text.startswith("{")
            if out.finish_reason == "stop":
                assert isinstance(json.loads(out.text), dict)
            continue
        assert out.finish_reason == "stop", (rid, out.text)
        if kind == "json":
            jsonschema.validate(json.loads(out.text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", out.text), out.text
        elif kind == "choice":
            assert out.text in ("red", "green", "dark blue")
        else:
            assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", out.text), out.text


def test_a_greedy_constrained_row_never_takes_the_fused_argmax(engine, monkeypatch):
    backend = engine.runner.backend
    assert backend.fused_argmax   # the path exists for this model: it must not be taken
    calls = []
    real = backend.argmax
    monkeypatch.setattr(backend, "argmax", lambda model, h: calls.append(1) or real(model, h))
    finals = run(engine, [("c", "Hi", SamplingParams(max_tokens=200, temperature=0, grammar=JSON))])
    jsonschema.validate(json.loads(finals["c"].text), SCHEMA)
    assert not calls
    run(engine, [("free", "Hi", SamplingParams(max_tokens=3, temperature=0))])
    assert calls   # and a free greedy batch still takes it


def test_logits_past_the_tokenizer_vocabulary_are_masked(engine, monkeypatch):
    n = engine.tokenizer.vocab_size
    assert engine.model_config.vocab_size > n
    real = engine.runner.model.compute_logits

    def padding_wins(hidden):
        logits = real(hidden).clone()
        logits[:, n:] += 1e4   # the padding rows would win every argmax
        return logits
    monkeypatch.setattr(engine.runner.model, "compute_logits", padding_wins)
    finals = run(engine, [(f"c{t}", "Hi", SamplingParams(max_tokens=200, temperature=t, seed=1, grammar=JSON))
                          for t in (0.0, 1.0)])
    for out in finals.values():
        assert all(t < n for t in out.token_ids)
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_bad_grammar_is_refused_naming_its_field(engine):
    for spec in (GrammarSpec("json", json.dumps({"type": "nonsense"}), "guided_json"),
                 GrammarSpec("regex", "(unclosed", "structured_outputs"),
                 GrammarSpec("grammar", "start: undefined_rule", "guided_grammar"),
                 GrammarSpec("grammar", "\u00f5\u00fb\x87\t", "guided_grammar")):   # neither lark nor GBNF
        with pytest.raises(RequestError) as e:
            engine.processor.grammars.check(spec)
        assert e.value.param == spec.param
    assert not engine.seqs


def test_compiled_grammars_are_cached_by_spec(engine):
    grammars = engine.processor.grammars
    a = grammars._pristine(JSON)
    assert grammars._pristine(GrammarSpec("json", json.dumps(SCHEMA))) is a
    assert grammars.matcher(JSON) is not a   # each sequence its own copy


def test_a_matcher_error_fails_only_its_request(engine):
    engine.add_request("bad", "Hi", SamplingParams(max_tokens=50, temperature=0, grammar=JSON))
    engine.add_request("good", "Hi", SamplingParams(max_tokens=200, temperature=0.5, grammar=JSON))
    engine.add_request("free", "Hi", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    # a token the grammar refuses (a padding id) puts the matcher in error, as a bug would
    assert not engine.seqs["bad"].matcher.consume_token(engine.model_config.vocab_size - 1)
    finals = run(engine, [])
    assert {r: o.finish_reason for r, o in finals.items()} == {"bad": "error", "good": "stop", "free": "length"}
    jsonschema.validate(json.loads(finals["good"].text), SCHEMA)


def test_rows_the_grammar_forces_skip_the_lm_head(engine, monkeypatch):
    calls = []
    real = engine.runner.model.compute_logits
    monkeypatch.setattr(engine.runner.model, "compute_logits", lambda h: calls.append(h.shape[0]) or real(h))
    only = GrammarSpec("choice", json.dumps(["the one and only answer"]))
    finals = run(engine, [("f", "Hi", SamplingParams(max_tokens=50, temperature=1.0, seed=0, grammar=only))])
    assert finals["f"].text == "the one and only answer" and finals["f"].finish_reason == "stop"
    assert calls == []   # every step was forced: no logits at all
    # with logprobs the logits are needed (and a forced token has all the mass)
    calls.clear()
    finals = run(engine, [("l", "Hi", SamplingParams(max_tokens=50, temperature=0, logprobs=1, grammar=only))])
    out = finals["l"]
    assert out.text == "the one and only answer" and len(calls) == len(out.token_ids)
    assert all(lp is not None for lp in out.logprobs)


def hostile_schema() -> dict:
    """issue 38's: 2,000 optional properties with a pattern each (~170 KB); after "{" any of them
    may come, more than llguidance's per-row limit."""
    return {"type": "object", "properties": {
        f"field_{i:04d}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 13 + 8}}}-[0-9A-F]{{4}}(x|y{i})*$"}
        for i in range(2000)}}


def many_fields(n: int) -> dict:
    return {"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(n)}}


# Its first mask (an object or an array) is fine; both open 600 optional keys at once, too many
# for a step: it passes admission and fails while generating.
LATE = {"anyOf": [many_fields(600), {"type": "array", "minItems": 1, "items": many_fields(600)}]}


def test_a_grammar_too_complex_for_the_step_limits_is_refused_in_one_short_line(engine):
    spec = GrammarSpec("json", json.dumps(hostile_schema()), "response_format")
    assert len(spec.value) > 150_000
    for _ in range(2):   # the second time from the cache
        with pytest.raises(RequestError) as e:
            engine.processor.grammars.check(spec)
        message = str(e.value)
        assert e.value.param == "response_format" and "too complex" in message
        assert len(message) < 400 and "\n" not in message and "field_0" not in message


def test_a_grammar_that_fails_while_generating_fails_its_requests_alone_saying_why(engine, caplog):
    late = GrammarSpec("json", json.dumps(LATE), "guided_json")
    engine.processor.grammars.check(late)   # admitted
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = run(engine, [("free", "Hi", free)])["free"].token_ids
    with caplog.at_level(logging.INFO):
        finals = run(engine, [(f"late-{i}", "Hi", SamplingParams(max_tokens=50, temperature=1.0, seed=i, grammar=late))
                              for i in range(8)] + [("free", "Hi", free)])
    assert finals["free"].token_ids == alone and finals["free"].finish_reason == "length"
    for i in range(8):
        out = finals[f"late-{i}"]
        assert out.finish_reason == "error" and isinstance(out.error, GrammarFailed), out
        assert out.error.param == "guided_json" and "items" in str(out.error) and len(str(out.error)) < 500
    assert 0 < len(caplog.text) < 8 * 600   # a short line per failed request: never the grammar


def test_a_request_whose_mask_costs_more_than_the_step_budget_fails_alone(engine, monkeypatch):
    # Ambiguous: each "a" may end any of the x's before it, so a mask's work grows with the text
    # (~tokens^2.5) while the Earley items stay within LIMITS. The budget is CPU time of the mask
    # thread (load does not count); 2 ms here is reached in under 150 tokens even on a machine
    # several times faster than this one, and 400 leave a wide margin.
    monkeypatch.setattr(grammar, "STEP_CPU_BUDGET_S", 0.002)
    ambiguous = GrammarSpec("grammar", 'start: x\nx: "a" | x x | x x x', "guided_grammar")
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = run(engine, [("free", "Hi", free)])["free"].token_ids
    finals = run(engine, [("slow", "Hi", SamplingParams(max_tokens=400, min_tokens=400, temperature=0,
                                                        grammar=ambiguous)),
                          ("free", "Hi", free),
                          ("json", "Hi", SamplingParams(max_tokens=200, temperature=0, grammar=JSON))])
    assert finals["free"].token_ids == alone
    jsonschema.validate(json.loads(finals["json"].text), SCHEMA)   # a usual grammar stays far below it
    slow = finals["slow"]
    assert slow.finish_reason == "error" and isinstance(slow.error, GrammarFailed), slow
    assert "budget" in str(slow.error) and slow.error.param == "guided_grammar"
    assert 0 < len(slow.token_ids) < 400
