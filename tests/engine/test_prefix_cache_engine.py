"""The prefix cache end to end on a tiny fp32 model: greedy outputs are the same with it on and off,
with the CPU kernels and with torch's ops, under chunking, preemption, aborts and sharing."""
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine import block_manager as bm_module
from pdserve.engine.llm_engine import LLMEngine
from tests.helpers import corpus_prompts

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def prompts(path):
    """Prompts that share prefixes the way traffic does: a 40-token system prompt with different
    questions, the same prompt twice, a prompt of exactly two blocks, a conversation's next turn."""
    system, q1, q2, q3, other = corpus_prompts(LLM(path, num_kv_blocks=4).tokenizer, lens=[40, 9, 30, 3, 50])
    turn1 = system + q1
    return [turn1, system + q2, system + q2, system[:32], other, turn1 + q3 + q2, system + q3, other[:20] + q1]


def run(engine: LLMEngine, prompts, arrivals: list[int], aborts: dict[int, list[int]] = None):
    """Step the engine; prompt i arrives before step arrivals[i]; aborts[k]: ids aborted before step k."""
    final, step, aborts = {}, 0, aborts or {}
    while engine.has_unfinished_requests() or step <= max(arrivals):
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(str(i), prompts[i], GREEDY)
        for i in aborts.get(step, []):
            engine.abort_request(str(i))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
    engine.block_manager.check_all_free()
    return [final[str(i)] for i in range(len(prompts))]


ARRIVALS = [0, 0, 2, 3, 3, 9, 12, 12]   # later ones arrive while earlier ones still run


@pytest.mark.parametrize("cpu_kernels", [None, False], ids=["kernels", "torch-ops"])
@pytest.mark.parametrize("budget", [512, 24], ids=["whole", "chunked"])
def test_greedy_outputs_are_the_same_with_the_cache_on_and_off(path, prompts, cpu_kernels, budget):
    kw = dict(dtype="float32", cpu_kernels=cpu_kernels, max_num_batched_tokens=budget, block_size=16)
    off = run(LLMEngine(path, enable_prefix_caching=False, **kw), prompts, ARRIVALS)
    engine = LLMEngine(path, **kw)
    on = run(engine, prompts, ARRIVALS)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    cached = [o.num_cached_tokens for o in on]
    assert all(o.num_cached_tokens == 0 for o in off)
    # Whole blocks of what ran before: 2 repeats 1 (4 of its 5 blocks; chunked, 1 was still being
    # prefilled); 3 is two whole blocks of the system prompt, the last recomputed for its logits;
    # 5 is the next turn of 0, whose blocks beyond 48 tokens hold 0's generated tokens.
    assert cached == ([0, 0, 64, 16, 0, 48, 32, 16] if budget == 512 else [0, 32, 48, 16, 0, 48, 32, 16])
    assert engine.block_manager.num_hits == sum(cached) and engine.block_manager.num_hits > 0


def test_preemption_with_the_cache_keeps_outputs(path, prompts):
    kw = dict(dtype="float32", num_kv_blocks=9, block_size=16, max_num_batched_tokens=64)
    off = LLM(path, enable_prefix_caching=False, **kw).generate(prompts, GREEDY)
    llm = LLM(path, **kw)
    on = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert sum(o.metrics.num_preemptions for o in on) > 0 and llm.engine.block_manager.num_hits > 0
    llm.engine.block_manager.check_all_free()


def test_aborting_a_sequence_never_frees_blocks_another_reads(path, prompts):
    kw = dict(dtype="float32", max_num_batched_tokens=32, block_size=16)
    off = run(LLMEngine(path, enable_prefix_caching=False, **kw), prompts, ARRIVALS)
    # 0 and 1 (whose blocks 2, 3, 5 and 6 share) are aborted while those still read them
    on = run(LLMEngine(path, **kw), prompts, ARRIVALS, aborts={4: [0], 6: [1]})
    assert [on[i].finish_reason for i in (0, 1)] == ["abort", "abort"]
    kept = [2, 3, 4, 5, 6, 7]
    assert [on[i].token_ids for i in kept] == [off[i].token_ids for i in kept]
    assert on[2].num_cached_tokens == 32


def test_colliding_hashes_never_give_another_prefix_its_kv(path, prompts, monkeypatch):
    """With four hash values for all blocks, lookups meet other prefixes' blocks all the time:
    only the key comparison keeps the outputs right."""
    real = bm_module.hash_block
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: real(parent, tokens) % 4)
    kw = dict(dtype="float32", max_num_batched_tokens=512, block_size=8)
    off = run(LLMEngine(path, enable_prefix_caching=False, **kw), prompts, ARRIVALS)
    engine = LLMEngine(path, **kw)
    on = run(engine, prompts, ARRIVALS)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert engine.block_manager.num_hits > 0
