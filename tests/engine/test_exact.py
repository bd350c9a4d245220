"""The engine generates exactly what transformers generates (fp32 greedy), for every architecture."""
import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.helpers import (CHUNK_ATOL, assert_decode_equals_recompute, assert_last_position_logits_match,
                           chunked_logits, corpus_prompts, hf_greedy, hf_logits)

# arch, config overrides: the four families plus OPT-350m style (post-LN, project_in/out), Llama
# 3.1 style (llama3 RoPE scaling, tied embeddings) and sliding windows shorter than the prompts.
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "mistral-window": ("mistral", {"sliding_window": 16}),
    # Qwen2's windows only from max_window_layers on: layer 0 full, layer 1 windowed
    "qwen2-window-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    "opt": ("opt", {}),
    "opt-350m": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
    "llama3-rope-tied": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64},
                                   "tie_word_embeddings": True}),
}
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_path(request, make_tiny):
    arch, overrides = VARIANTS[request.param]
    return make_tiny(arch, **overrides)


@pytest.fixture(scope="module")
def llm(model_path, isa_or_torch):   # once per kernel build this CPU runs
    # small budget: the longer prompts are prefilled in chunks while the short ones decode
    return LLM(model_path, max_num_batched_tokens=64, max_num_seqs=16)


def test_greedy_batch_equals_transformers(llm, model_path):
    prompts = corpus_prompts(llm.tokenizer)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(model_path, prompt, NEW_TOKENS)
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"
        assert out.prompt_token_ids == prompt
    assert max(o.metrics.num_prefill_steps for o in outs) > 1  # the 200-token prompt was chunked
    llm.engine.block_manager.check_all_free()


def test_last_position_logits_match(llm, model_path):
    assert_last_position_logits_match(llm, model_path)


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_prefill_equals_whole_prompt(llm, model_path, chunk):
    """The causal mask makes prefill independent of how the prompt is split."""
    prompt = corpus_prompts(llm.tokenizer, lens=[45])[0]
    whole = chunked_logits(llm.engine, prompt, chunk=len(prompt))
    split = chunked_logits(llm.engine, prompt, chunk=chunk)
    torch.testing.assert_close(split, whole, atol=CHUNK_ATOL, rtol=0)
    assert torch.equal(split.argmax(-1), whole.argmax(-1))
    torch.testing.assert_close(whole, hf_logits(model_path, prompt), atol=1e-4, rtol=0)


def test_decode_with_cache_equals_recompute(llm, model_path):
    """Each decode step's logits (one token against the cache) equal a full forward without a cache."""
    assert_decode_equals_recompute(llm, model_path, prompt_len=20)
