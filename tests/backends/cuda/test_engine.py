"""The engine on the CUDA backend, its attention on the Triton kernels under Triton's
interpreter with the tensors on the CPU (a test-only construction: --device cuda needs a GPU),
generates transformers' greedy tokens: prompts of several lengths in one batch, the longer
prefilled in chunks while the others decode, with GQA, a sliding window, soft caps or sinks
where the architecture has them. And the pieces of the backend that only a GPU runs (the KV
cache's sizing, the graphs' capture) where a GPU is present."""
import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.helpers import corpus_prompts, hf_greedy

VARIANTS = {
    "llama": ("llama", {}),                                  # GQA (2 KV heads of 4)
    "mistral-window": ("mistral", {"sliding_window": 8}),    # windows shorter than the prompts
    "gemma2": ("gemma2", {}),                                # soft caps, local and global layers
    "gpt_oss": ("gpt_oss", {}),                              # sinks
}
NEW_TOKENS = 6


@pytest.fixture(params=list(VARIANTS))
def model_path(request, make_tiny):
    arch, overrides = VARIANTS[request.param]
    return make_tiny(arch, **overrides)


def test_greedy_equals_transformers(cuda, model_path, monkeypatch):
    import pdserve.engine.model_runner as model_runner
    made = []

    def cuda_backend_on_cpu(model_config, config, dtype):
        made.append(cuda.backend.CudaBackend(model_config, config, device=torch.device("cpu")))
        return made[0]
    monkeypatch.setattr(model_runner, "select_backend", cuda_backend_on_cpu)
    llm = LLM(model_path, device="cpu", max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=64, block_size=4)
    assert made and "Triton paged attention (Triton's interpreter)" in made[0].describe()
    prompts = corpus_prompts(llm.tokenizer, lens=[3, 21, 9])
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model_path, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    assert max(o.metrics.num_prefill_steps for o in outs) > 1   # the 21-token prompt was chunked
    llm.engine.block_manager.check_all_free()
