"""The CUDA backend on a GPU: its compiled Triton kernels against the torch path (fp32, bf16,
fp16; the interpreter's cases and model-sized ones), and the engine on it: transformers' greedy
tokens in fp32 with decode graphs on, graphs equal to eager, sampling features on the GPU's logits,
and the KV cache sized from --gpu-memory-utilization. Skipped without a GPU; the interpreter tests
beside this file run the same kernels' logic on the CPU. This module never uses the interpreter
fixture, so the kernels here are compiled."""
import gc
import json
from types import SimpleNamespace

import pytest
import torch

from tests.backends.cuda.reference import CASES, MIXED, run_both
from tests.helpers import corpus_prompts, hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels, "
                                "graphs and memory profile run only on a GPU (test_attention_kernel.py and "
                                "test_engine.py run the kernels under Triton's interpreter instead)")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def compiled():
    from pdserve.backends.cuda import kernels, layers, metadata
    assert not kernels.interpreted(), "TRITON_INTERPRET is set: these tests are for the compiled kernels"
    return SimpleNamespace(kernels=kernels, layers=layers, metadata=metadata)


def tile(H: int, Hkv: int, rows: int) -> int:
    """The backend's block_q: queries per tile, so that a tile has `rows` rows (16 decode, 64 mixed)."""
    group_pad = 1 << (H // Hkv - 1).bit_length()
    return max(1, rows // group_pad)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_kernel_matches_torch(compiled, name, dtype):
    c = CASES[name]
    ref, out, caches = run_both(compiled, q_lens=MIXED[0], ctx_lens=MIXED[1], dtype=dtype, device="cuda",
                                block_q=tile(c["H"], c["Hkv"], 64), **c)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)


MODEL_SHAPES = {   # Llama-3-8B's attention, Qwen's group of 7 with head 64... Gemma 2's head 256 with its cap
    "llama3-8b": dict(H=32, Hkv=8, D=128, block_size=16),
    "group7-d64": dict(H=28, Hkv=4, D=64, block_size=16, window=100),
    "gemma2-d256": dict(H=8, Hkv=4, D=256, block_size=16, softcap=50.0, window=64),
    "gpt-oss-sinks": dict(H=64, Hkv=8, D=64, block_size=16, sinks=True, window=128),
}


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("name", list(MODEL_SHAPES))
def test_compiled_kernel_at_model_shapes(compiled, name, dtype):
    c = MODEL_SHAPES[name]
    q_lens, ctx_lens = [1] * 6 + [300, 17], [1, 7, 16, 17, 700, 1500, 300, 529]   # decodes, a prompt, a chunk
    ref, out, _ = run_both(compiled, q_lens=q_lens, ctx_lens=ctx_lens, dtype=dtype, device="cuda",
                           block_q=tile(c["H"], c["Hkv"], 64), **c)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for splits in (1, compiled.kernels.kv_splits(8, c["Hkv"], sms)):   # a decode step's tiles, split-KV or not
        ref, out, _ = run_both(compiled, q_lens=[1] * 8, ctx_lens=ctx_lens, dtype=dtype, device="cuda",
                               block_q=tile(c["H"], c["Hkv"], 16), kv_splits=splits, **c)
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def free_gpu():
    gc.collect()
    torch.cuda.empty_cache()


VARIANTS = {
    "llama": ("llama", {}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "gemma2": ("gemma2", {}),
    "gpt_oss": ("gpt_oss", {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_greedy_equals_transformers(make_tiny, variant):
    from pdserve import LLM, SamplingParams
    arch, overrides = VARIANTS[variant]
    path = make_tiny(arch, **overrides)
    llm = LLM(path, device="cuda", dtype="float32", max_num_batched_tokens=64, max_num_seqs=8,
              gpu_memory_utilization=0.1)
    backend = llm.engine.runner.backend
    assert backend.name == "cuda", backend.describe()
    prompts = corpus_prompts(llm.tokenizer, lens=[1, 7, 17, 33, 120])
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 12), f"{backend.describe()}: prompt of {len(prompt)} tokens"
    llm.engine.block_manager.check_all_free()
    del llm, backend
    free_gpu()


def test_graphs_replay_what_eager_computes(make_tiny):
    from pdserve import LLM, SamplingParams
    path = make_tiny("llama")
    outs = {}
    for eager in (True, False):
        llm = LLM(path, device="cuda", dtype="bfloat16", enforce_eager=eager, max_num_seqs=8,
                  gpu_memory_utilization=0.1)
        backend = llm.engine.runner.backend
        assert (backend.graphs is None) == eager, backend.describe()
        replays = []
        if not eager:
            replay = backend.graphs.replay
            backend.graphs.replay = lambda meta, batch: replays.append(batch) or replay(meta, batch)
        prompts = [[5, 6, 7], [9] * 11, [3, 4]]
        outs[eager] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                                                  ignore_eos=True))]
        assert eager or 3 in replays   # the three decoding together replayed the graph of 4
        del llm, backend
        free_gpu()
    assert outs[True] == outs[False]


def test_sampling_on_the_gpu(make_tiny):
    """Seeded draws, filters, penalties, min_tokens, logprobs and a grammar on CUDA logits: a
    seeded request samples the same tokens alone and in a batch, and the grammar holds."""
    from pdserve import LLM, SamplingParams
    from pdserve.engine.grammar import GrammarSpec
    llm = LLM(make_tiny("llama"), device="cuda", max_num_seqs=8, gpu_memory_utilization=0.1)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=7,
                            repetition_penalty=1.2, presence_penalty=0.5, min_tokens=5, logprobs=3, ignore_eos=True)
    colors = ["red", "green", "dark blue"]
    others = [SamplingParams(max_tokens=20, temperature=0.7, seed=1, grammar=GrammarSpec("choice", json.dumps(colors))),
              SamplingParams(max_tokens=10, temperature=0, frequency_penalty=1.0, logprobs=0)]
    alone = llm.generate([[5, 6, 7]], seeded)[0]
    batch = llm.generate([[5, 6, 7], [8, 9], [10]], [seeded] + others)
    assert batch[0].token_ids == alone.token_ids
    assert all(len(lp) in (3, 4) for lp in batch[0].logprobs)
    assert batch[1].text in colors
    llm.engine.block_manager.check_all_free()
    del llm
    free_gpu()


def test_kv_cache_from_gpu_memory_utilization(make_tiny):
    """Without --num-kv-blocks, the cache fills what the utilization leaves: doubling it (0.1 ->
    0.2 of the GPU) adds about 0.1 of the GPU to the cache."""
    from pdserve import LLM
    path = make_tiny("llama")
    total = torch.cuda.mem_get_info()[1]
    blocks = {}
    for u in (0.1, 0.2):
        llm = LLM(path, device="cuda", gpu_memory_utilization=u, enforce_eager=True)
        runner = llm.engine.runner
        blocks[u] = (runner.num_blocks, runner.bytes_per_block)
        del llm, runner
        free_gpu()
    (b1, per), (b2, _) = blocks[0.1], blocks[0.2]
    assert abs((b2 - b1) * per - 0.1 * total) < 0.01 * total
