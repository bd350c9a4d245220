"""Sampler semantics (on hand-made logits) and sampling through the engine."""
import math

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.errors import RequestError
from pdserve.engine.sampler import Sampler
from tests.helpers import corpus_prompts, hf_logits

EOS = 9


def fake_seq(params: SamplingParams, prompt=(1, 2), output=()) -> Sequence:
    s = Sequence("x", list(prompt), params, 0.0)
    s.token_ids.extend(output)
    return s


def sample(logits: list[float], params: SamplingParams, **kw) -> int:
    sampler = Sampler([EOS], "cpu", seed=0)
    tokens, _ = sampler(torch.tensor([logits]), [fake_seq(params, **kw)])
    return tokens[0]


def test_greedy_and_top_k_1():
    logits = [0.0, 3.0, 2.9, 1.0]
    assert sample(logits, SamplingParams(temperature=0)) == 1
    assert all(sample(logits, SamplingParams(temperature=5.0, top_k=1, seed=s)) == 1 for s in range(20))


def test_top_p_and_min_p_cut_the_tail():
    # probabilities ~ [0.6, 0.3, 0.1]: top_p=0.5 keeps only the first; min_p=0.4 drops the 0.1 one
    logits = [math.log(0.6), math.log(0.3), math.log(0.1)]
    assert {sample(logits, SamplingParams(top_p=0.5, seed=s)) for s in range(30)} == {0}
    assert {sample(logits, SamplingParams(min_p=0.4, seed=s)) for s in range(60)} == {0, 1}
    assert {sample(logits, SamplingParams(seed=s)) for s in range(200)} == {0, 1, 2}


def test_seeded_draws_follow_the_distribution():
    logits = [math.log(0.7), math.log(0.3)]
    picks = [sample(logits, SamplingParams(seed=s)) for s in range(400)]
    assert 0.6 < picks.count(0) / 400 < 0.8


def test_penalties():
    logits = [2.0, 1.8, -1.0, 0.0]
    # presence: token 0 appeared in the output, 2.0 - 0.5 < 1.8
    assert sample(logits, SamplingParams(temperature=0, presence_penalty=0.5), output=[0]) == 1
    # frequency scales with the count: 2.0 - 3 * 0.05 = 1.85 still wins, 2.0 - 5 * 0.05 does not
    assert sample(logits, SamplingParams(temperature=0, frequency_penalty=0.05), output=[0] * 3) == 0
    assert sample(logits, SamplingParams(temperature=0, frequency_penalty=0.05), output=[0] * 5) == 1
    # repetition penalty counts the prompt too and divides positive logits: 2.0 / 1.2 < 1.8
    assert sample(logits, SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0]) == 1
    # penalties on the prompt do not come from presence/frequency (output only)
    assert sample(logits, SamplingParams(temperature=0, presence_penalty=2.0), prompt=[0]) == 0


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = [0.0] * 10
    logits[EOS], logits[3], logits[5] = 5.0, 4.0, 1.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    assert sample(logits, p, output=[7]) == 5
    assert sample(logits, p, output=[7, 7]) == EOS


def test_logprobs_are_raw_and_include_the_sampled_token():
    sampler = Sampler([EOS], "cpu")
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    ref = torch.log_softmax(logits[0], -1)   # before: the sampler works in place on its input
    tokens, lps = sampler(logits, [fake_seq(SamplingParams(temperature=0, logprobs=2, presence_penalty=1.0),
                                            output=[2])])
    assert tokens == [1]          # penalty moved the choice, not the logprobs
    assert set(lps[0]) == {1, 2}  # sampled + top-2
    assert lps[0][2] == pytest.approx(ref[2].item())


def test_batched_logprobs_equal_row_by_row():
    """A GPU's logprobs come back for the whole batch at once (Sampler._batch_logprobs), the CPU's
    row by row: the same entries, each row with its own n. A row asking for a top n beyond the
    vocabulary makes the batch raise (a GPU then goes row by row) and fails alone row by row."""
    raw = torch.log_softmax(torch.randn(5, 50, generator=torch.Generator().manual_seed(1)), -1)
    seqs = [fake_seq(SamplingParams(temperature=0, logprobs=n)) for n in (0, 3, 1, 5, 2)]
    tokens = [4, 9, 0, 49, 7]
    row_by_row = Sampler._logprobs(raw, seqs, tokens, set())
    for i, (e, n) in enumerate(zip(row_by_row, (0, 3, 1, 5, 2))):
        assert set(e) == {tokens[i], *raw[i].topk(n).indices.tolist()}
        assert e[tokens[i]] == raw[i, tokens[i]].item()
    assert Sampler._batch_logprobs(raw, seqs, list(tokens), [0, 1, 2, 3, 4], [None] * 5) == row_by_row
    seqs[2].params.logprobs = 51
    with pytest.raises(RuntimeError):
        Sampler._batch_logprobs(raw, seqs, tokens, [0, 1, 2, 3, 4], [None] * 5)
    failed = set()
    assert Sampler._logprobs(raw, seqs, tokens, failed) == row_by_row[:2] + [None] + row_by_row[3:]
    assert failed == {2}


def test_greedy_fast_path_equals_the_general_path():
    # A batch with nothing but greedy argmax skips the per-sequence steps; the same batch through
    # the general path (any one request with a min_tokens to apply sends it there) picks the same
    # tokens, and both pick torch.argmax's (first maximum; a NaN counts as the maximum).
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 3, (40, 200), generator=g).float()   # many ties
    logits[3, 7] = logits[5, 0] = float("inf")
    logits[4, 11] = logits[4, 50] = logits[6, 1] = float("nan")
    logits[8] = float("-inf")
    fast = [fake_seq(SamplingParams(temperature=0), output=[1] * 3) for _ in range(40)]
    general = [fake_seq(SamplingParams(temperature=0), output=[1] * 3) for _ in range(39)]
    general.append(fake_seq(SamplingParams(temperature=0, min_tokens=2), output=[1] * 3))
    assert all(s.argmax_only for s in fast) and not general[-1].argmax_only
    sampler = Sampler([EOS], "cpu")
    tokens, lps = sampler(logits.clone(), fast)
    assert tokens == sampler(logits.clone(), general)[0] == logits.argmax(dim=-1).tolist()
    assert lps == [None] * 40


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=21), "logprobs"), (dict(min_tokens=50, max_tokens=10), "min_tokens"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_params_are_refused(kwargs, param):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


# --- through the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    return LLM(tiny_qwen2, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def prompts(llm):
    return corpus_prompts(llm.tokenizer, lens=[6, 30, 11, 50])


def test_seed_gives_the_same_output_whatever_the_batch(llm, prompts):
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[0]], p)[0].token_ids
    # same request among others (sampled without seed, different lengths) and at another position
    others = SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)
    batch = llm.generate(prompts[1:] + [prompts[0]], [others] * 3 + [p])
    assert batch[-1].token_ids == alone
    different = llm.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=99,
                                                          ignore_eos=True))[0].token_ids
    assert different != alone


def test_top_k_1_equals_greedy(llm, prompts):
    greedy = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    topk1 = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.3, top_k=1))
    assert [o.token_ids for o in topk1] == [o.token_ids for o in greedy]


def test_stop_string_and_stop_token(llm, prompts):
    ref = llm.generate([prompts[1]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    text = ref.text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3])
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=True))[0]
    assert out.text == text[:text.index(stop) + len(stop)]
    # streamed deltas never show text past the stop string
    streamed = "".join(o.new_text for o in llm.generate_stream(
        [prompts[1]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])))
    assert streamed == text[:text.index(stop)]
    # a stop token id ends generation at its first occurrence, and is kept in token_ids
    tok = ref.token_ids[5]
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[tok]))[0]
    assert out.token_ids == ref.token_ids[:ref.token_ids.index(tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert ref.finish_reason == "length" and len(ref.token_ids) == 30


def test_eos_stops_unless_ignored(llm, prompts):
    eos = llm.tokenizer.eos_token_ids[0]
    # random weights rarely pick EOS: declare the 4th greedy token an EOS id for this test
    ref = llm.generate([prompts[2]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    eos_ids = llm.engine.tokenizer.eos_token_ids
    saved = list(eos_ids)
    try:
        eos_ids.append(ref.token_ids[3])
        out = llm.generate([prompts[2]], SamplingParams(max_tokens=12, temperature=0))[0]
        assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[:ref.token_ids.index(ref.token_ids[3]) + 1]
        out = llm.generate([prompts[2]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        assert out.token_ids == ref.token_ids
    finally:
        eos_ids[:] = saved
    assert eos in saved


def test_logprobs_match_the_reference(llm, prompts, tiny_qwen2):
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    assert len(out.logprobs) == 4
    ids = prompts[0] + out.token_ids
    ref = torch.log_softmax(hf_logits(tiny_qwen2, ids), -1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompts[0]) - 1 + i]
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == pytest.approx(row[tok].item(), abs=3e-4)
        assert set(lp) >= set(row.topk(3).indices.tolist())


def test_top_p_that_rounds_to_zero_keeps_the_most_likely_token(tiny_llama):
    from pdserve import LLM
    llm = LLM(tiny_llama)
    greedy = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    tiny_p = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-300,
                                                               seed=1, ignore_eos=True))[0]
    assert tiny_p.token_ids == greedy.token_ids


@pytest.mark.parametrize("penalty", [1e-300, 1e308])
def test_extreme_repetition_penalty_stays_finite(tiny_llama, penalty):
    from pdserve import LLM
    llm = LLM(tiny_llama)
    prompt = corpus_prompts(llm.tokenizer, lens=[40])[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True,
                                                repetition_penalty=penalty, logprobs=1))[0]
    assert all(math.isfinite(lp) for step in out.logprobs for lp in step.values())
    if penalty < 1:   # every seen token with a positive logit is pushed to the top: the draw stays among them
        seen = set(prompt)
        for t in out.token_ids:
            assert t in seen
            seen.add(t)
