"""Shared test helpers for engine tests: reference runs through transformers, chunked prefills."""
import functools

import torch

from pdserve.engine.scheduler import SchedulerOutput
from pdserve.layers.attention import attention_context, build_metadata
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams

# Prompt lengths from 1 to 200 tokens: single token, inside one block, block edges, many blocks.
PROMPT_LENS = [1, 2, 7, 15, 16, 17, 33, 64, 120, 200]


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    # a vision-language checkpoint AutoModelForCausalLM does not map (Mistral 3): its image-text class
    vlm = getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


def corpus_prompts(tokenizer, lens=PROMPT_LENS, offset=0) -> list[list[int]]:
    """Token-id prompts of exactly the given lengths, cut from varied corpus text."""
    from tools.make_model import corpus_prompts
    return corpus_prompts(tokenizer, lens, offset)


@torch.no_grad()
def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(path)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    """All-position logits of one full forward, without a cache."""
    return hf_model(path)(torch.tensor([ids]), use_cache=False).logits[0].float()


def chunked_logits(engine, ids: list[int], chunk: int) -> torch.Tensor:
    """Run `ids` through the engine's runner in chunks of `chunk` tokens against its paged cache
    (chunk 1 is exactly decode with the KV cache) and return every position's logits."""
    bm = engine.block_manager
    seq = Sequence("probe", ids, SamplingParams(), 0.0)
    seq.prefill_len = len(ids)
    out = []
    try:
        while seq.num_computed_tokens < len(ids):
            n = min(chunk, len(ids) - seq.num_computed_tokens)
            bm.allocate(seq, seq.num_computed_tokens + n)
            sched = SchedulerOutput()
            sched.add(seq, n)
            out.append(engine.runner.forward_logits(sched))
            seq.num_computed_tokens += n
    finally:
        bm.free(seq)
    return torch.cat(out)


# Prefill of a whole prompt matches transformers to 1e-4. Smaller chunks (down to one token, i.e.
# decode) run the same math as matrix-vector instead of matrix-matrix products, whose fp32
# accumulation order differs: we measured up to 1.3e-4 on logits of magnitude ~8 (2e-5 relative).
CHUNK_ATOL = 3e-4


def assert_last_position_logits_match(llm, path: str, lens=(1, 17, 200), atol: float = 1e-4) -> None:
    """Each prompt's last-position logits, prefilled whole, equal transformers' within atol."""
    for prompt in corpus_prompts(llm.tokenizer, lens=list(lens)):
        ours = chunked_logits(llm.engine, prompt, chunk=len(prompt))[-1]
        torch.testing.assert_close(ours, hf_logits(path, prompt)[-1], atol=atol, rtol=0)


def assert_greedy_batch_equals_transformers(llm, path: str, reference, new_tokens: int) -> None:
    """PROMPT_LENS' prompts in one batch (the 200-token one prefilled in chunks) give transformers'
    greedy tokens (reference(path, prompt tuple)), and every block is free after."""
    prompts = corpus_prompts(llm.tokenizer)
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(path, tuple(prompt)), f"prompt of {len(prompt)} tokens"
    assert max(o.metrics.num_prefill_steps for o in outs) > 1   # the 200-token prompt was chunked
    llm.engine.block_manager.check_all_free()


def assert_decode_equals_recompute(llm, path: str, prompt_len: int, atol: float = CHUNK_ATOL) -> None:
    """Each decode step's logits (one token against the cache) equal a full forward without a
    cache (to atol), and the engine's own greedy tokens are their argmax."""
    prompt = corpus_prompts(llm.tokenizer, lens=[prompt_len])[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    full = prompt + out.token_ids
    decoded = chunked_logits(llm.engine, full, chunk=1)
    torch.testing.assert_close(decoded, hf_logits(path, full), atol=atol, rtol=0)
    assert decoded[len(prompt) - 1:-1].argmax(-1).tolist() == out.token_ids


def tokens_before_divergence(ref_outputs, other_outputs) -> int:
    """vLLM's rule for comparing precisions on greedy outputs with logprobs=5: at the first token
    where a pair differs, each side's token must be among the other's top-5 (asserted). Returns
    how many tokens matched before each pair's first difference, summed."""
    same = 0
    for a, b in zip(ref_outputs, other_outputs):
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                assert x in b.logprobs[i] and y in a.logprobs[i], f"token {i}: {x} vs {y}"
                break
            same += 1
    return same


def attention_torch_and_kernels(H, Hkv, D, block_size, window, dtype, q_lens, ctx_lens, seed):
    """A PagedAttention layer over a shuffled paged cache and one step's flat batch (sequence i has
    q_lens[i] new queries and ctx_lens[i] keys): the output of the torch path (gather + masked
    SDPA) and of the CPU kernels (no masks), to compare."""
    torch.manual_seed(seed)
    tables, used = [], 0
    num_blocks = sum(-(-n // block_size) for n in ctx_lens) + 3
    perm = torch.randperm(num_blocks).tolist()
    for n in ctx_lens:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    from pdserve.backends.cpu.layers import CpuPagedAttention
    from pdserve.backends.cpu.metadata import build_step_metadata
    layer = CpuPagedAttention(H, Hkv, D, scale=D ** -0.5, sliding_window=window)
    cache = torch.randn(2, num_blocks * block_size, Hkv, D).to(dtype)
    layer.k_cache, layer.v_cache = cache[0], cache[1]
    T = sum(q_lens)
    q, k, v = torch.randn(T, H, D).to(dtype), torch.randn(T, Hkv, D).to(dtype), torch.randn(T, Hkv, D).to(dtype)
    slots, starts = [], []
    for t, ql, n in zip(tables, q_lens, ctx_lens):
        starts.append(len(slots))
        slots.extend(t[p // block_size] * block_size + p % block_size for p in range(n - ql, n))
    # as the runner groups them: decodes (one query) and prefill chunks
    groups = [[i for i, ql in enumerate(q_lens) if ql == 1], [i for i, ql in enumerate(q_lens) if ql > 1]]

    def run(with_mask):
        step_groups = [([q_lens[i] for i in g], [starts[i] for i in g], [ctx_lens[i] for i in g],
                        [tables[i] for i in g]) for g in groups if g]
        if with_mask:
            _, meta = build_metadata([slots], step_groups, block_size, "cpu")
        else:
            _, meta = build_step_metadata([slots], step_groups, block_size)
        # a C++ step is what sends the groups to the kernels (the layer has no other path for it)
        assert (meta.step is None) == with_mask and (not meta.groups) == (not with_mask)
        with attention_context(meta):
            return layer(q, k, v)
    return run(True), run(False)


def finish_all(engine) -> dict:
    """Step the engine until idle; every request's final output, checking each finishes exactly once."""
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
    return finals


def assert_outputs_survive_cache_preemption_and_speculation(model_path: str, cpu_kernels, reference,
                                                            new_tokens: int) -> None:
    """Prompts that share a 48-token prefix, a KV cache too small for all of them at once, and
    n-gram drafts verified in every step: each output is still transformers' greedy one
    (reference(path, prompt tuple))."""
    from pdserve import LLM
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    llm = LLM(model_path, cpu_kernels=cpu_kernels, num_kv_blocks=9, block_size=16, max_num_batched_tokens=64,
              speculative_config=spec)
    llm.engine.speculator.cost_model = None   # propose in every step, whatever the cost model says
    system, *questions = corpus_prompts(llm.tokenizer, lens=[48, 9, 30, 3, 50, 20, 41, 7])
    prompts = [system + q for q in questions]
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model_path, tuple(prompt)), f"prompt of {len(prompt)} tokens"
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert sum(o.num_cached_tokens for o in outs) > 0 and llm.engine.block_manager.num_hits > 0
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    llm.engine.block_manager.check_all_free()
