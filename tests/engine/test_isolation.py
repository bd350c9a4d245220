"""One request's failure in sampling or output processing fails that request alone: the others
of its step get the same outputs as without it. And the bounds that keep a request's numbers
inside what the sampler can hold."""
import math

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import RequestError
from pdserve.engine.sampler import Sampler
from pdserve.sampling_params import SamplingParams
from tests.helpers import finish_all

POISON = "poison"


def innocent_params(i: int) -> SamplingParams:
    # sampled (seeded: the same tokens whatever the batch), greedy, and the general paths
    kinds = [dict(temperature=1.0, seed=100 + i), dict(temperature=0), dict(temperature=0.8, top_k=5, seed=i),
             dict(temperature=0, repetition_penalty=1.3), dict(temperature=1.0, top_p=0.9, seed=i, logprobs=2),
             dict(temperature=0, min_tokens=3, stop_token_ids=[7, 8])]
    return SamplingParams(max_tokens=10, ignore_eos=True, **kinds[i % len(kinds)])


def run(engine, requests) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    finals = finish_all(engine)
    assert not engine.seqs
    engine.block_manager.check_all_free()
    return finals


def make_engine(path):
    return LLMEngine(path, max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=64, block_size=16)


def poisoned(fn, check):
    """fn, raising when one of its sequences is the poisoned request."""
    def wrapper(*args):
        if check(args):
            raise RuntimeError("poisoned request")
        return fn(*args)
    return wrapper


def has_poison(args):
    return any(getattr(a, "request_id", None) == POISON for a in args) or \
        any(isinstance(a, list) and any(getattr(s, "request_id", None) == POISON for s in a) for a in args)


@pytest.mark.parametrize("stage", ["penalties", "filter", "noise", "logprobs", "output"])
def test_a_poisoned_request_fails_alone(tiny_llama, monkeypatch, stage):
    innocents = [(f"r{i}", [3 + i, 17, 29, 41 + i], innocent_params(i)) for i in range(12)]
    alone = run(make_engine(tiny_llama), innocents)
    assert all(o.finish_reason == "length" for o in alone.values())

    engine = make_engine(tiny_llama)
    poison = (POISON, [5, 6, 7], SamplingParams(max_tokens=10, temperature=1.0, seed=1, repetition_penalty=1.1,
                                               logprobs=1, ignore_eos=True))
    if stage == "penalties":
        monkeypatch.setattr(Sampler, "_apply_penalties", staticmethod(poisoned(Sampler._apply_penalties, has_poison)))
    elif stage == "filter":
        monkeypatch.setattr(Sampler, "_filtered_probs", staticmethod(poisoned(Sampler._filtered_probs, has_poison)))
    elif stage == "noise":
        monkeypatch.setattr(Sampler, "_exponential", poisoned(Sampler._exponential, has_poison))
    elif stage == "logprobs":
        real = Sampler._logprobs

        def logprobs(raw, seqs, tokens, failed):
            for s in seqs:
                if s.request_id == POISON:
                    s.params.logprobs = 10**6   # topk beyond the vocabulary: raises for this row only
            return real(raw, seqs, tokens, failed)
        monkeypatch.setattr(Sampler, "_logprobs", staticmethod(logprobs))
    else:
        engine.processor.append_token = poisoned(engine.processor.append_token, has_poison)
    finals = run(engine, innocents[:6] + [poison] + innocents[6:])
    assert finals.pop(POISON).finish_reason == "error"
    assert {rid: (o.finish_reason, list(o.token_ids)) for rid, o in finals.items()} == \
        {rid: (o.finish_reason, list(o.token_ids)) for rid, o in alone.items()}


def test_top_k_is_bounded_by_what_a_tensor_and_the_vocabulary_hold(tiny_llama):
    for k in (2**63, 2**64, 2**31):
        with pytest.raises(RequestError) as e:
            SamplingParams(top_k=k)
        assert e.value.param == "top_k"
    engine = make_engine(tiny_llama)
    vocab = engine.model_config.vocab_size
    with pytest.raises(RequestError) as e:
        engine.add_request("a", [1, 2, 3], SamplingParams(top_k=vocab + 1))
    assert e.value.param == "top_k" and str(vocab) in str(e.value)
    # the whole vocabulary is the same as no top-k
    same = [SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, top_k=k) for k in (vocab, 0)]
    finals = run(engine, [(f"k{i}", [1, 2, 3], p) for i, p in enumerate(same)])
    assert list(finals["k0"].token_ids) == list(finals["k1"].token_ids)


@pytest.mark.parametrize("param", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, float("1e999"), "1", True])
def test_float_fields_must_be_finite_numbers(param, value):
    with pytest.raises(RequestError) as e:
        SamplingParams(**{param: value})
    assert e.value.param == param


def test_stop_token_ids_must_fit_a_tensor():
    with pytest.raises(RequestError) as e:
        SamplingParams(stop_token_ids=[5, 2**63])
    assert e.value.param == "stop_token_ids"


def test_stop_token_ids_are_a_set_and_a_tensor_built_once(tiny_llama):
    engine = make_engine(tiny_llama)
    ids = list(range(900, 1400))   # a long list (the server caps it: --max-stop-token-ids)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6, min_tokens=4, temperature=0,
                                                      stop_token_ids=ids))
    seq = engine.seqs["a"]
    banned = seq.min_tokens_banned
    assert isinstance(seq.stop_token_ids, frozenset) and len(seq.stop_token_ids) == len(ids)
    assert sorted(banned.tolist()) == sorted(set(ids) | set(engine.tokenizer.eos_token_ids))
    for _ in range(3):
        engine.step()
        assert seq.min_tokens_banned is banned   # not rebuilt per step
    out = run(engine, [])["a"]
    assert not set(out.token_ids[:4]) & set(ids)
