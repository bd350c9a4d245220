"""Speculative decoding is exact under greedy: the tokens equal plain greedy decoding's, on every
test architecture, with the CPU kernels (each build this CPU runs) and with torch's ops."""
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from tests.engine.test_exact import VARIANTS
from tests.helpers import corpus_prompts, finish_all

MAX_TOKENS = 20


class NoisyOracle:
    """Proposes the reference continuation with some drafts wrong: every verification then
    accepts a prefix and rejects the rest at a position that varies from step to step."""
    def __init__(self, reference: dict[str, list[int]], vocab: int):
        self.reference, self.vocab, self.calls = reference, vocab, 0

    def propose(self, seqs, num_drafts):
        out = []
        for seq, k in zip(seqs, num_drafts):
            self.calls += 1
            ref = self.reference[seq.request_id]
            pos = seq.num_output_tokens
            drafts = ref[pos:pos + k]
            wrong = (self.calls + pos) % (k + 2)   # k + 1 and beyond: all right
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % self.vocab
            out.append(drafts)
        return out


def prompts(engine):
    ids = corpus_prompts(engine.tokenizer, lens=[5, 40])
    # most of the vocabulary: n-gram lookup (from one token) finds whatever the model generates
    return ids + [list(range(3, 1000))]


def run(engine, prompt_ids, **params):
    for i, p in enumerate(prompt_ids):
        engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                     **params))
    out = finish_all(engine)
    engine.block_manager.check_all_free()
    return {rid: o.token_ids for rid, o in out.items()}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_path(request, make_tiny):
    arch, overrides = VARIANTS[request.param]
    return make_tiny(arch, **overrides)


@pytest.fixture(scope="module", params=[None, False], ids=["kernels", "torch"])
def cpu_kernels(request, isa_or_torch):
    return request.param


@pytest.fixture(scope="module")
def reference(model_path, cpu_kernels):
    engine = LLMEngine(model_path, cpu_kernels=cpu_kernels, max_num_batched_tokens=64)
    ids = prompts(engine)
    return ids, run(engine, ids)


def spec_engine(model_path, cpu_kernels, **kw):
    return LLMEngine(model_path, cpu_kernels=cpu_kernels, max_num_batched_tokens=64, **kw)


def test_noisy_drafts_are_verified_exactly(model_path, cpu_kernels, reference):
    ids, ref = reference
    engine = spec_engine(model_path, cpu_kernels, num_speculative_tokens=3)
    engine.speculator.cost_model = None   # propose in every step, whatever the cost model says
    engine.speculator.proposer = NoisyOracle(ref, engine.model_config.vocab_size)
    assert run(engine, ids) == ref
    s = engine.speculator.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert s.accepted_per_pos[0] > s.accepted_per_pos[2] > 0


def test_ngram_is_exact(model_path, cpu_kernels, reference):
    ids, ref = reference
    engine = spec_engine(model_path, cpu_kernels, speculative_config='{"method": "ngram", '
                         '"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}')
    engine.speculator.cost_model = None
    assert run(engine, ids) == ref
    assert engine.speculator.stats.num_draft_tokens > 0


def test_draft_model_is_exact(model_path, cpu_kernels, reference):
    """The target as its own draft: (nearly) every draft is accepted, and the output is the same."""
    ids, ref = reference
    engine = spec_engine(model_path, cpu_kernels, num_speculative_tokens=3, speculative_model=model_path)
    engine.speculator.cost_model = None
    assert run(engine, ids) == ref
    s = engine.speculator.stats
    assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens > 0
