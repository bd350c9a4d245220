"""Rejection sampling keeps the target's distribution: chi-square tests with fixed seeds, on
hand-made distributions and through the engine on a tiny model."""
import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.spec_decode.rejection import accept_greedy, rejection_sample
from tests.helpers import corpus_prompts, finish_all, hf_logits

# 0.999 quantiles of the chi-square distribution by degrees of freedom: a correct sampler fails
# a test at most once in a thousand seeds; these seeds are fixed.
CHI2_999 = {2: 13.82, 3: 16.27, 5: 20.52, 8: 26.12, 11: 31.26, 15: 37.70}


def chi_square(counts: dict, expected: dict, n: int) -> tuple[float, int]:
    """Statistic and degrees of freedom over the cells of `expected` (probabilities)."""
    assert set(counts) <= set(expected), f"drew outside the support: {set(counts) - set(expected)}"
    stat = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in expected.items())
    return stat, len(expected) - 1


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5], [4, 1]) == [4]


@pytest.mark.parametrize("drafts", [[1, 0], [3, 2], [0, 0]])
def test_first_two_tokens_follow_the_target(drafts):
    """Row 0 is p(. | context), row 1 p(. | context, drafts[0]): the first emitted token is
    distributed as row 0, and the second, when the first was the accepted draft, as row 1."""
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    gen = torch.Generator().manual_seed(1)
    n = 20000
    first, second = {}, {}
    for _ in range(n):
        out = rejection_sample(probs, drafts, gen)
        assert 1 <= len(out) <= 3 and out[:-1] == drafts[:len(out) - 1]
        first[out[0]] = first.get(out[0], 0) + 1
        if out[0] == drafts[0]:
            second[out[1]] = second.get(out[1], 0) + 1
    stat, dof = chi_square(first, dict(enumerate(probs[0].tolist())), n)
    assert stat < CHI2_999[dof], (stat, first)
    stat, dof = chi_square(second, dict(enumerate(probs[1].tolist())), sum(second.values()))
    assert stat < CHI2_999[dof], (stat, second)


def test_a_draft_the_target_cannot_make_is_never_kept():
    probs = torch.tensor([[0.0, 0.6, 0.4], [1.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    assert all(rejection_sample(probs, [0], gen)[0] in (1, 2) for _ in range(500))


class TableProposer:
    """Fixed drafts for a sequence whose output so far is one of the table's keys."""
    def __init__(self, table: dict):
        self.table = table

    def propose(self, seqs, num_drafts):
        return [list(self.table.get(tuple(s.output_token_ids), ()))[:k] for s, k in zip(seqs, num_drafts)]


def top_k_probs(logits: torch.Tensor, k: int) -> dict[int, float]:
    vals, ids = logits.topk(k)
    return dict(zip(ids.tolist(), vals.softmax(-1).tolist()))


def test_engine_samples_the_target_distribution(tiny_llama):
    """Sampled through the engine (top_k=3, drafts verified in batches of other requests' rows),
    the second and third tokens given the first follow the target's filtered distribution."""
    engine = LLMEngine(tiny_llama, num_speculative_tokens=2, max_num_seqs=64, max_num_batched_tokens=256)
    prompt = corpus_prompts(engine.tokenizer, lens=[9])[0]
    top = 3
    p2, p3, table = {}, {}, {}
    for t1 in top_k_probs(hf_logits(tiny_llama, prompt)[-1], top):
        p2[t1] = top_k_probs(hf_logits(tiny_llama, prompt + [t1])[-1], top)
        ranked = sorted(p2[t1], key=p2[t1].get)
        d1 = ranked[1]   # a middling draft: accepted some of the time
        for t2 in p2[t1]:
            p3[t1, t2] = top_k_probs(hf_logits(tiny_llama, prompt + [t1, t2])[-1], top)
        table[(t1,)] = [d1, max(p3[t1, d1], key=p3[t1, d1].get)]
    engine.speculator.cost_model = None
    engine.speculator.proposer = TableProposer(table)
    n = 1500
    for i in range(n):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=top, ignore_eos=True))
    outs = finish_all(engine)
    engine.block_manager.check_all_free()
    s = engine.speculator.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens   # both branches were taken
    joint: dict = {}
    for o in outs.values():
        t1, t2, t3 = o.token_ids
        joint.setdefault(t1, {})
        joint[t1][t2, t3] = joint[t1].get((t2, t3), 0) + 1
    for t1, counts in joint.items():
        expected = {(a, b): p2[t1][a] * p3[t1, a][b] for a in p2[t1] for b in p3[t1, a]}
        stat, dof = chi_square(counts, expected, sum(counts.values()))
        assert stat < CHI2_999[dof], (t1, stat, counts)
