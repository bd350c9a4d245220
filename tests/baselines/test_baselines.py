"""The origin's generation paths, as baselines: same outputs as the engine, their own behaviour."""
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.baselines import BASELINES, NoCacheBaseline, StaticBaseline
from pdserve.errors import RequestError
from tests.helpers import corpus_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0)


def run(baseline, prompts, params=GREEDY):
    for i, p in enumerate(prompts):
        baseline.add_request(str(i), p, params)
    final = {}
    while baseline.has_unfinished_requests():
        for out in baseline.step():
            if out.finished:
                final[out.request_id] = out
    return [final[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "opt"])
def test_every_baseline_matches_the_engine(make_tiny, arch):
    path = make_tiny(arch)
    llm = LLM(path)
    prompts = corpus_prompts(llm.tokenizer, lens=[1, 6, 19, 50, 3, 33])
    want = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    for name, cls in BASELINES.items():
        outs = run(cls(path), prompts)
        assert [o.token_ids for o in outs] == want, name
        assert [o.text for o in outs] == [llm.tokenizer.decode(t) for t in want], name


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    return corpus_prompts(LLM(tiny_llama).tokenizer, lens=[4, 9, 30, 2, 14, 7, 21, 5, 11, 3])


def test_static_batches_of_four(tiny_llama, prompts):
    baseline = StaticBaseline(tiny_llama, batch_size=4)
    outs = run(baseline, prompts)
    assert baseline.num_model_calls == 3   # 10 requests: 4 + 4 + 2
    # left padding: batched greedy output equals each prompt's solo output
    solo = [run(StaticBaseline(tiny_llama, batch_size=1), [p])[0].token_ids for p in prompts[:4]]
    assert [o.token_ids for o in outs[:4]] == solo
    # nothing streams before the call returns: every token has the same timestamp, TTFT = e2e
    for o in outs:
        assert o.metrics.ttft == o.metrics.e2e and len(set(o.metrics.token_times)) == 1


def test_static_right_padding_would_change_results(tiny_llama, prompts):
    """Why we pad on the left: the origin's right padding puts pads between prompt and output."""
    baseline = StaticBaseline(tiny_llama, batch_size=2)
    short, long = prompts[3], prompts[2]
    ids = torch.full((2, len(long)), baseline.pad_id)
    ids[0, :len(short)] = torch.tensor(short)
    ids[1] = torch.tensor(long)
    mask = (torch.arange(len(long))[None, :] < torch.tensor([len(short), len(long)])[:, None]).long()
    out = baseline.model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                 pad_token_id=baseline.pad_id)
    right_padded = out[0, len(long):].tolist()
    assert right_padded != run(baseline, [short])[0].token_ids


def test_static_groups_by_settings_and_cuts_each_row(tiny_llama, prompts):
    baseline = StaticBaseline(tiny_llama, batch_size=4)
    params = [SamplingParams(max_tokens=3, temperature=0), SamplingParams(max_tokens=8, temperature=0),
              SamplingParams(max_tokens=5, temperature=0.9, top_k=5)]
    for i, p in enumerate(params):
        baseline.add_request(str(i), prompts[i], p)
    final = {}
    while baseline.has_unfinished_requests():
        final.update({o.request_id: o for o in baseline.step() if o.finished})
    assert baseline.num_model_calls == 2   # the greedy pair together, the sampled one alone
    assert [len(final[str(i)].token_ids) for i in range(3)] == [3, 8, 5]


def test_nocache_steps_and_no_cache(tiny_llama, prompts):
    baseline = NoCacheBaseline(tiny_llama)
    calls = []
    forward = baseline.model.forward

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return forward(*args, **kwargs)

    baseline.model.forward = spy
    outs = run(baseline, prompts[:3], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert len(calls) == baseline.num_model_calls == 3 * 7   # one full forward per generated token
    assert all(c.get("use_cache") is False and c.get("past_key_values") is None for c in calls)
    # each token streamed when produced: 7 distinct timestamps per request
    assert all(len(set(o.metrics.token_times)) == 7 for o in outs)


def test_nocache_samples_with_seed_and_logprobs(tiny_llama, prompts):
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=7, logprobs=2)
    a = run(NoCacheBaseline(tiny_llama), prompts[:1], p)[0]
    b = run(NoCacheBaseline(tiny_llama), prompts[:1], p)[0]
    assert a.token_ids == b.token_ids and len(a.logprobs) == 8


@pytest.mark.parametrize("name, params, param", [
    ("hf", SamplingParams(logprobs=1), "logprobs"),
    ("hf", SamplingParams(presence_penalty=0.5), "presence_penalty"),
    ("static", SamplingParams(seed=3), "seed"),
    ("static", SamplingParams(frequency_penalty=0.5), "frequency_penalty"),
])
def test_baselines_refuse_what_they_cannot_do(tiny_llama, name, params, param):
    baseline = BASELINES[name](tiny_llama)
    with pytest.raises(RequestError) as e:
        baseline.add_request("x", "hello", params)
    assert e.value.param == param and name in str(e.value)
    assert not baseline.has_unfinished_requests()


def test_abort_while_waiting(tiny_llama, prompts):
    baseline = StaticBaseline(tiny_llama, batch_size=2)
    for i in range(3):
        baseline.add_request(str(i), prompts[i], GREEDY)
    baseline.abort_request("2")
    outs = baseline.step()   # delivers the abort, then runs the batch of the other two
    assert outs[0].request_id == "2" and outs[0].finish_reason == "abort" and not outs[0].token_ids
    assert sorted(o.request_id for o in outs[1:]) == ["0", "1"] and baseline.num_model_calls == 1
    assert all(o.finished and o.finish_reason == "length" for o in outs[1:])
    assert not baseline.has_unfinished_requests() and not baseline.seqs


def test_a_failing_generate_call_fails_only_its_batch(tiny_llama, prompts):
    baseline = StaticBaseline(tiny_llama, batch_size=2)
    real = baseline.model.generate
    baseline.model.generate = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))
    for i in range(3):
        baseline.add_request(str(i), prompts[i], GREEDY)
    outs = baseline.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("0", "error"), ("1", "error")]
    baseline.model.generate = real
    (last,) = baseline.step()
    assert last.request_id == "2" and last.finish_reason == "length"
    assert not baseline.has_unfinished_requests() and not baseline.seqs
