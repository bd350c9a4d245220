"""The engine on the CUDA backend, its attention on the Triton kernels under Triton's
interpreter with the tensors on the CPU (a test-only construction: --device cuda needs a GPU),
generates transformers' greedy tokens: prompts of several lengths in one batch, the longer
prefilled in chunks while the others decode, with GQA, a sliding window, soft caps or sinks
where the architecture has them. The decode graphs' padded batches are checked the same way,
with each "replay" running the forward eagerly over the graphs' static buffers (capturing needs a GPU)."""
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


def cuda_llm(cuda, path: str, monkeypatch, **kw) -> LLM:
    """An LLM whose runner has the CUDA backend, on the CPU."""
    import pdserve.engine.model_runner as model_runner

    def cuda_backend_on_cpu(model_config, config, dtype):
        return cuda.backend.CudaBackend(model_config, config, dtype, device=torch.device("cpu"))
    monkeypatch.setattr(model_runner, "select_backend", cuda_backend_on_cpu)
    llm = LLM(path, device="cpu", max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=64, block_size=4, **kw)
    assert "Triton paged attention (Triton's interpreter)" in llm.engine.runner.backend.describe()
    return llm


def assert_greedy_equals_transformers(llm, path: str) -> None:
    prompts = corpus_prompts(llm.tokenizer, lens=[3, 21, 9])
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    assert max(o.metrics.num_prefill_steps for o in outs) > 1   # the 21-token prompt was chunked
    llm.engine.block_manager.check_all_free()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_equals_transformers(cuda, make_tiny, monkeypatch, variant):
    arch, overrides = VARIANTS[variant]
    path = make_tiny(arch, **overrides)
    assert_greedy_equals_transformers(cuda_llm(cuda, path, monkeypatch), path)


def test_padded_decode_batches_equal_transformers(cuda, make_tiny, monkeypatch):
    """Decode steps through DecodeGraphs (batches of 3 padded to 4, of 1 and 2 as they are), each
    replay running the forward over the static buffers, with split-KV: padding writes no KV and
    changes no token."""
    path = make_tiny("mistral", sliding_window=8)
    llm = cuda_llm(cuda, path, monkeypatch)
    backend = llm.engine.runner.backend
    replays = []

    class EagerGraphs(cuda.graphs.DecodeGraphs):
        def capture(self, forward):
            self.forward = forward
            for size in self.sizes:
                self.graphs[size] = (None, None, *self._views(size, self._pack(size)[1]))

        def replay(self, meta, batch):
            flat = self.graphs[meta.graph_batch][2]
            replays.append((batch, meta.graph_batch))
            return self.forward(flat[0], flat[1], meta)[:batch]

    backend.num_sms = 8   # as if on a GPU of 8 SMs: decode steps split their keys over 2 to 8 programs
    monkeypatch.setattr(cuda.kernels, "KEY_TILE", 16)   # of 16 keys: the contexts here span two
    backend.graphs = EagerGraphs(cuda.graphs.capture_sizes(4), 16, 4, backend.block_q[True], torch.device("cpu"),
                                 backend._kv_splits)
    backend.graphs.capture(lambda ids, pos, meta: backend._eager(llm.engine.runner.model, ids, pos, meta))
    assert_greedy_equals_transformers(llm, path)
    assert (3, 4) in replays and backend.graphs.graphs[4][3].kv_splits == 2


def test_profile_step_runs_and_leaves_the_cache(cuda, make_tiny, monkeypatch):
    """The step that kv_cache_blocks profiles on a GPU (max_num_batched_tokens of prefill against a
    scratch cache, writing nothing): it runs, and the layers get their own cache back unchanged."""
    llm = cuda_llm(cuda, make_tiny("llama"), monkeypatch)
    runner = llm.engine.runner
    cache = runner.kv_cache.clone()
    runner.backend._largest_step(runner.model)
    assert torch.equal(runner.kv_cache, cache)
    layer = next(m for m in runner.model.modules() if isinstance(m, cuda.layers.CudaPagedAttention))
    assert layer.k_cache.data_ptr() == runner.kv_cache[0, 0].data_ptr()
