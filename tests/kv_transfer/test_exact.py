"""A prompt prefilled on a prefill engine and decoded on a decode engine (its KV pulled over
each transport) gives the colocated engine's greedy tokens, token for token, for every
architecture the tests build; and the decode engine really uses the pulled KV."""
import pytest

from pdserve.engine.llm_engine import LLMEngine
from tests.helpers import corpus_prompts
from tests.engine.test_exact import VARIANTS
from tests.kv_transfer.pd import SECRET, colocated, decode, prefill

NEW_TOKENS = 10
LENS = [1, 2, 15, 16, 17, 33, 120]
ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=16)


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_path(request, make_tiny):
    arch, overrides = VARIANTS[request.param]
    return make_tiny(arch, **overrides)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_disaggregated_greedy_equals_colocated(model_path, transport):
    pre = LLMEngine(model_path, role="prefill", kv_transfer_secret=SECRET, kv_transport=transport, **ENGINE)
    dec = LLMEngine(model_path, role="decode", kv_transfer_secret=SECRET, **ENGINE)
    try:
        prompts = corpus_prompts(pre.tokenizer, LENS)
        ref = colocated(model_path, prompts, NEW_TOKENS, **ENGINE)
        params = prefill(pre, prompts, dec)
        assert len(pre.connector.leases) == len(prompts)
        assert all(p["transport"] == transport and p["num_tokens"] == len(q) for p, q in zip(params, prompts))
        finals = decode(dec, prompts, params, NEW_TOKENS, pre)
        assert [finals[f"d{i}"].token_ids for i in range(len(prompts))] == ref
        # every prompt but the one-token one was pulled: its first n - 1 tokens' K/V
        stats = dec.get_stats()
        assert stats.kv_transfers == len(prompts) - 1 and stats.kv_transfer_failures == 0
        row = 2 * pre.model_config.num_layers * pre.model_config.num_kv_heads * pre.model_config.head_dim * 4
        assert stats.kv_transfer_bytes == sum(len(p) - 1 for p in prompts) * row
        assert len(pre.connector.leases) == 0   # every lease released by the decode worker
        pre.block_manager.check_all_free()
        dec.block_manager.check_all_free()
    finally:
        pre.close()
        dec.close()


def test_decode_uses_the_pulled_kv(tiny_llama):
    """Corrupting the prefill worker's cache after the prefill changes the decode's tokens: the
    decode worker took the prompt's K/V from there, it did not recompute it."""
    pre = LLMEngine(tiny_llama, role="prefill", kv_transfer_secret=SECRET, **ENGINE)
    dec = LLMEngine(tiny_llama, role="decode", kv_transfer_secret=SECRET, **ENGINE)
    try:
        prompts = corpus_prompts(pre.tokenizer, [120])
        ref = colocated(tiny_llama, prompts, NEW_TOKENS, **ENGINE)
        params = prefill(pre, prompts, dec)
        pre.runner.kv_cache.normal_()
        finals = decode(dec, prompts, params, NEW_TOKENS, pre)
        assert finals["d0"].token_ids != ref[0]
    finally:
        pre.close()
        dec.close()
