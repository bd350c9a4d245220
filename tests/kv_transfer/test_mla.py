"""P/D disaggregation of a multi-head-latent-attention model (DeepSeek-V3): what moves is the
latent cache, one row of kv_lora_rank + qk_rope_head_dim values per token and layer, and the
decode worker's greedy tokens are the colocated engine's."""
import pytest

from pdserve.engine.llm_engine import LLMEngine
from tests.helpers import corpus_prompts
from tests.kv_transfer.pd import ENGINE, SECRET, colocated, decode, prefill

NEW_TOKENS = 10
LENS = [1, 15, 17, 33, 120]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_disaggregated_mla_moves_the_latents(make_tiny, transport):
    path = make_tiny("deepseek_v3")
    pre = LLMEngine(path, role="prefill", kv_transfer_secret=SECRET, kv_transport=transport, **ENGINE)
    dec = LLMEngine(path, role="decode", kv_transfer_secret=SECRET, **ENGINE)
    try:
        prompts = corpus_prompts(pre.tokenizer, LENS)
        ref = colocated(path, prompts, NEW_TOKENS, **ENGINE)
        params = prefill(pre, prompts, dec)
        finals = decode(dec, prompts, params, NEW_TOKENS, pre)
        assert [finals[f"d{i}"].token_ids for i in range(len(prompts))] == ref
        stats = dec.get_stats()
        assert stats.kv_transfers == len(prompts) - 1 and stats.kv_transfer_failures == 0
        raw = pre.model_config.raw
        row = pre.model_config.num_layers * (raw["kv_lora_rank"] + raw["qk_rope_head_dim"]) * 4   # fp32, one plane
        assert stats.kv_transfer_bytes == sum(len(p) - 1 for p in prompts) * row
        pre.block_manager.check_all_free()
        dec.block_manager.check_all_free()
    finally:
        pre.close()
        dec.close()
