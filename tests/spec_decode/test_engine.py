"""What requests see with speculation on: several tokens per step, and stop conditions, logprobs,
streaming, the prefix cache and the scheduler's budget on accepted tokens only."""
import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.cost_model import StepCostModel
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.errors import ConfigError
from pdserve.sampling_params import SamplingParams
from pdserve.spec_decode.config import speculative_config
from pdserve.spec_decode.ngram import propose
from pdserve.spec_decode.speculator import Speculator
from tests.helpers import corpus_prompts, finish_all
from tests.spec_decode.test_exact import NoisyOracle

MAX = 24


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLMEngine(tiny_llama, block_size=4)


@pytest.fixture(scope="module")
def prompts(plain):
    return corpus_prompts(plain.tokenizer, lens=[6, 30])


def greedy(**kw):
    return SamplingParams(**{"max_tokens": MAX, "temperature": 0.0, "ignore_eos": True, **kw})


def outputs(engine, prompts, params, stream=False):
    """Final outputs by request id; with stream, also every output of every step."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    steps, finals = [], {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            steps.append(o)
            if o.finished:
                finals[o.request_id] = o
    engine.block_manager.check_all_free()
    return (finals, steps) if stream else finals


def speculating(tiny_llama, plain, prompts, params, **kw):
    """An engine whose drafts are plain greedy's tokens, some wrong (NoisyOracle)."""
    ref = {rid: o.token_ids for rid, o in outputs(plain, prompts, greedy()).items()}
    engine = LLMEngine(tiny_llama, block_size=4, num_speculative_tokens=3, **kw)
    engine.speculator.cost_model = None
    engine.speculator.proposer = NoisyOracle(ref, engine.model_config.vocab_size)
    return engine


def test_stops_max_tokens_logprobs_and_streaming(tiny_llama, plain, prompts):
    ref = outputs(plain, prompts, greedy(logprobs=2))
    stop_token = ref["1"].token_ids[9]
    text_stop = ref["0"].text[len(ref["0"].text) // 2:][:4]
    engine = speculating(tiny_llama, plain, prompts, greedy())
    finals, steps = outputs(engine, prompts, greedy(logprobs=2), stream=True)
    for rid, o in finals.items():
        assert o.token_ids == ref[rid].token_ids and o.text == ref[rid].text
        for ours, theirs in zip(o.logprobs, ref[rid].logprobs):
            assert ours.keys() == theirs.keys()
            assert all(abs(ours[t] - theirs[t]) < 1e-4 for t in ours)
        streamed = [t for s in steps if s.request_id == rid for t in s.new_token_ids]
        assert streamed == o.token_ids
        assert "".join(s.new_text for s in steps if s.request_id == rid) == o.text
    assert max(len(s.new_token_ids) for s in steps) > 1   # several tokens in one step
    assert engine.speculator.stats.num_accepted_tokens > 0
    for params, key in ((greedy(max_tokens=7), "length"), (greedy(stop_token_ids=[stop_token]), "stop"),
                        (greedy(stop=[text_stop]), "stop")):
        want = outputs(plain, prompts, params)
        got = outputs(engine, prompts, params)
        for rid in want:
            assert (got[rid].token_ids, got[rid].text, got[rid].finish_reason) == \
                (want[rid].token_ids, want[rid].text, want[rid].finish_reason)
        assert key in {o.finish_reason for o in got.values()}


def test_min_tokens_and_penalties_do_not_speculate_but_stay_exact(tiny_llama, plain, prompts):
    engine = speculating(tiny_llama, plain, prompts, greedy())
    for params in (greedy(min_tokens=MAX), greedy(repetition_penalty=1.3)):
        before = engine.speculator.stats.num_draft_tokens
        assert ({r: o.token_ids for r, o in outputs(engine, prompts, params).items()} ==
                {r: o.token_ids for r, o in outputs(plain, prompts, params).items()})
        assert engine.speculator.stats.num_draft_tokens == before


def test_prefix_cache_never_holds_rejected_drafts(tiny_llama, plain, prompts):
    """A prompt made of a speculated request's prompt and output hits its cached blocks; its
    continuation is plain greedy's, so no cached block held a rejected draft's K/V."""
    engine = speculating(tiny_llama, plain, prompts, greedy())
    first = outputs(engine, prompts, greedy())
    assert engine.speculator.stats.num_accepted_tokens < engine.speculator.stats.num_draft_tokens
    longer = [p + first[str(i)].token_ids for i, p in enumerate(prompts)]
    engine.speculator.proposer = NoisyOracle({}, 1)   # no drafts for these (no reference)
    engine.speculator.proposer.propose = lambda seqs, ks: [[] for _ in seqs]
    got = outputs(engine, longer, greedy(max_tokens=8))
    assert all(o.num_cached_tokens > 0 for o in got.values())
    want = outputs(plain, longer, greedy(max_tokens=8))
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}


def test_scheduler_cuts_drafts_to_the_budget_and_rollback_frees_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_batched_tokens=3, max_num_seqs=4)
    s = Sequence("a", list(range(7)), SamplingParams(max_tokens=20), 0.0)
    sched.add(s)
    sched.mark_computed(sched.schedule(0.0))
    while s.is_prefill:   # 7 prompt tokens in chunks of 3, then the sampled one
        sched.mark_computed(sched.schedule(0.0))
    s.token_ids.append(100)
    assert s.num_computed_tokens == 7
    s.draft.token_ids = [1, 2, 3]
    out = sched.schedule(0.0)
    assert out.num_tokens == [3] and s.draft.token_ids == [1, 2]   # the last token and two drafts
    assert len(s.block_table) == 3                                   # slots up to position 9
    spec = Speculator(speculative_config(3, None, None), None, bm)
    spec.verified(out, [(s, [1, 50], None)])   # draft 1 accepted, 2 rejected, 50 the target's own
    sched.mark_computed(out)
    assert s.num_computed_tokens == 9 and out.num_tokens == [2]
    assert len(s.block_table) == 3   # 10 tokens once 1 and 50 are appended: still 3 blocks
    assert spec.stats.num_drafts == 1 and spec.stats.num_draft_tokens == 2 and spec.stats.accepted_per_pos == [1, 0, 0]
    s.draft.token_ids = [1, 2, 3]
    out = sched.schedule(0.0)   # budget 3: the same cut; a rejection of both frees the extra block
    spec.verified(out, [(s, [60], None)])
    sched.mark_computed(out)
    assert s.num_computed_tokens == 10 and len(s.block_table) == 3


def test_adaptive_turns_down_with_low_acceptance_and_large_batches():
    cost = StepCostModel((0.010, 0.003, 0.0, 0.0))   # 10 ms a step + 3 ms a token
    spec = Speculator(speculative_config(4, None, None), None, None, cost)
    good, bad = (Sequence(n, list(range(50)), SamplingParams(max_tokens=100), 0.0) for n in "gb")
    good.draft.accepts, bad.draft.rejects = 20.0, 20.0
    assert spec._num_drafts([good, bad], [4, 4], decodes=1) == [4, 0]   # batch 1: drafts are cheap
    assert spec._num_drafts([good], [4], decodes=32) == [0]            # 32 decodes: a token costs 3.3 ms
    for _ in range(20):   # not proposing, its estimate drifts back to the prior and it probes again
        bad.draft.accepts *= 0.8
        bad.draft.rejects *= 0.8
    assert spec._num_drafts([bad], [4], decodes=1)[0] > 0


def test_ngram_lookup():
    assert propose([1, 2, 3, 9, 1, 2, 3], 2, 2, 3) == [9, 1]
    assert propose([1, 2, 3, 9, 7, 2, 3, 8, 2, 3], 3, 1, 2) == [8, 2, 3]   # the latest occurrence
    assert propose([1, 2, 3, 4], 2, 1, 3) == []
    assert propose([256, 1, 0, 0, 1], 2, 1, 1) == [0, 0]
    assert propose([256, 0, 5, 1], 2, 1, 1) == []   # bytes of 256, 0 contain those of 1: no token match


def test_speculative_config_errors():
    assert speculative_config(0, None, None) is None
    c = speculative_config(0, None, '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 2, 5)
    assert speculative_config(2, "/d", None).method == "draft_model"
    for args in [(0, "/d", None), (0, None, "{"), (0, None, '{"k": 1}'), (0, None, '{"method": "eagle"}'),
                 (99, None, None), (2, None, '{"prompt_lookup_min": 4, "prompt_lookup_max": 2}'),
                 (2, None, '{"method": "draft_model"}')]:
        with pytest.raises(ConfigError):
            speculative_config(*args)


def test_metrics_and_bench_acceptance_rate():
    from pdserve.bench.serve_bench import parse_spec_counters, spec_decode_delta
    from pdserve.engine.outputs import EngineStats
    from pdserve.server.metrics import ServerMetrics
    from pdserve.spec_decode.speculator import SpecStats
    m, spec = ServerMetrics(), SpecStats(3)
    before = parse_spec_counters(m.render().decode())
    spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, spec.accepted_per_pos = 4, 12, 5, [3, 2, 0]
    m.record_step(None, EngineStats(1, 0, 10, 10, spec_decode=spec), [])
    m.record_step(None, EngineStats(1, 0, 10, 10, spec_decode=spec), [])   # totals, not increments: once
    page = m.render().decode()
    assert 'pdserve:spec_decode_num_draft_tokens_total{model_name="pdserve"} 12.0' in page
    assert 'pdserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="pdserve",position="1"} 2.0' in page
    assert spec_decode_delta(before, parse_spec_counters(page)) == {
        "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 5, "spec_decode_acceptance_rate": 5 / 12}
    assert parse_spec_counters("vllm:other_total 3") is None
