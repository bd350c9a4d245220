"""Prompt logprobs equal transformers' log_softmax of the whole prompt's logits (fp32, 1e-4): whole
prompts and chunked prefills, with a cached prefix, under preemption, a bounded slice of logits at
a time, with the CPU kernels and with torch's ops."""
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine import prompt_logprobs as plp
from pdserve.errors import RequestError
from tests.helpers import corpus_prompts, hf_logits

K = 5
LENS = [1, 2, 17, 40, 120]


@pytest.fixture(scope="module")
def path(tiny_llama):
    return tiny_llama


def reference(path, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(path, ids), dim=-1)


def check(out, path, tok, k: int = K) -> None:
    """out.prompt_logprobs against transformers: each token's logprob and rank, and the top k."""
    ids = out.prompt_token_ids
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    ref = reference(path, ids)
    for i in range(1, len(ids)):
        row, t_id, entry = ref[i - 1], ids[i], got[i]
        assert abs(entry[t_id].logprob - row[t_id].item()) < 1e-4, f"position {i}"
        # the rank: 1 + how many are more likely (a near-tie may fall either way)
        more = (row > row[t_id] + 1e-4).sum().item() + 1
        assert more <= entry[t_id].rank <= (row > row[t_id] - 1e-4).sum().item() + 1
        top = sorted(((v.logprob, t) for t, v in entry.items() if v.rank <= k), reverse=True)
        vals, order = row.topk(k)
        assert len(top) == k
        torch.testing.assert_close(torch.tensor([v for v, _ in top]), vals, atol=1e-4, rtol=0)
        for (v, t), rv in zip(top, vals.tolist()):   # the ids, where no other value is that close
            if ((row - rv).abs() < 2e-4).sum() == 1:
                assert abs(row[t].item() - v) < 1e-4
        assert entry[t_id].decoded_token == tok.decode([t_id], skip_special_tokens=False)


@pytest.mark.parametrize("cpu_kernels", [None, False], ids=["kernels", "torch-ops"])
@pytest.mark.parametrize("budget", [512, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(path, isa_or_torch, cpu_kernels, budget):
    llm = LLM(path, dtype="float32", cpu_kernels=cpu_kernels, max_num_batched_tokens=budget, max_num_seqs=8)
    prompts = corpus_prompts(llm.tokenizer, lens=LENS)
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=K))
    for out in outs:
        check(out, path, llm.tokenizer)
    if budget == 16:   # the longer prompts were prefilled in several chunks
        assert max(o.metrics.num_prefill_steps for o in outs) > 1
    # a request that does not ask has none, and its outputs are unchanged
    plain = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0))
    assert all(p.prompt_logprobs is None for p in plain)
    assert [p.token_ids for p in plain] == [o.token_ids for o in outs]
    llm.engine.block_manager.check_all_free()


def test_zero_alternatives_and_greedy_fused_argmax(path):
    """prompt_logprobs=0: only the prompt's own token (as vLLM); the greedy tokens still come from
    the CPU's fused argmax, the prompt rows from real logits."""
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16)
    (out,) = llm.generate([corpus_prompts(llm.tokenizer, lens=[30])[0]],
                          SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    ref = reference(path, out.prompt_token_ids)
    for i, tok in enumerate(out.prompt_token_ids[1:], 1):
        assert list(out.prompt_logprobs[i]) == [tok] or out.prompt_logprobs[i][tok].rank == 1
        assert abs(out.prompt_logprobs[i][tok].logprob - ref[i - 1, tok].item()) < 1e-4


def test_logits_are_made_a_slice_at_a_time(path, monkeypatch):
    """LOGITS_BYTES bounds the logits made at once; smaller slices give the same numbers."""
    made = []
    real = plp._entries

    def spy(lp, targets, owners):
        made.append(lp.shape[0])
        return real(lp, targets, owners)
    monkeypatch.setattr(plp, "_entries", spy)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=512)
    vocab = llm.engine.model_config.vocab_size
    monkeypatch.setattr(plp, "LOGITS_BYTES", 4 * vocab * 7)   # 7 rows at a time
    (out,) = llm.generate([corpus_prompts(llm.tokenizer, lens=[60])[0]],
                          SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=K))
    assert max(made) == 7 and sum(made) == 59
    check(out, path, llm.tokenizer)


def test_cached_prefix_is_recomputed_for_prompt_logprobs(path):
    """A prompt whose prefix is in the cache: the blocks it would reuse have no logits, so it is
    computed again (exact), while requests without prompt logprobs still hit the cache."""
    llm = LLM(path, dtype="float32", max_num_batched_tokens=512, block_size=16)
    system, q1, q2, q3 = corpus_prompts(llm.tokenizer, lens=[48, 9, 11, 5])
    greedy = SamplingParams(max_tokens=2, temperature=0)
    first = llm.generate([system + q1], greedy)[0]
    assert first.num_cached_tokens == 0
    (scored,) = llm.generate([system + q2], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=K))
    assert scored.num_cached_tokens == 0
    check(scored, path, llm.tokenizer)
    (again,) = llm.generate([system + q3], greedy)
    assert again.num_cached_tokens == 48   # the cache is still used by the others
    llm.engine.block_manager.check_all_free()


def test_preemption_neither_repeats_nor_loses_prompt_logprobs(path):
    """Too few blocks for all: running sequences are preempted (some in the middle of their
    prefill) and re-prefilled; each prompt position still gets exactly one entry, exact."""
    llm = LLM(path, dtype="float32", max_num_batched_tokens=24, num_kv_blocks=14, block_size=8, max_num_seqs=8)
    prompts = corpus_prompts(llm.tokenizer, lens=[40, 33, 25, 50])
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for out in outs:
        check(out, path, llm.tokenizer, k=2)
    llm.engine.block_manager.check_all_free()


def test_prompt_logprobs_are_bounded_like_logprobs():
    for bad in (21, -1, True, 2.0):
        with pytest.raises(RequestError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs"
    SamplingParams(prompt_logprobs=20)


def test_decode_role_refuses_and_prefill_role_computes(path):
    """A --role decode worker pulls the prompt's KV and never runs the prompt: no logits for it,
    so it refuses (a 400 naming the field); the prefill worker computes them (exact)."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kv_transfer import KVTransferParams
    from tests.kv_transfer.pd import ENGINE, SECRET

    pre = LLMEngine(path, role="prefill", kv_transfer_secret=SECRET, dtype="float32", **ENGINE)
    dec = LLMEngine(path, role="decode", kv_transfer_secret=SECRET, dtype="float32", **ENGINE)
    try:
        (prompt,) = corpus_prompts(pre.tokenizer, lens=[40])
        pre.add_request("p", prompt, SamplingParams(
            max_tokens=1, temperature=0, prompt_logprobs=K,
            kv_transfer_params=KVTransferParams(do_remote_decode=True, decode_engine_id=dec.connector.engine_id)))
        finals = {}
        while pre.scheduler.has_unfinished():
            finals.update({o.request_id: o for o in pre.step() if o.finished})
        check(finals["p"], path, pre.tokenizer)
        kv = KVTransferParams.from_dict(finals["p"].kv_transfer_params)
        with pytest.raises(RequestError) as e:
            dec.add_request("d", prompt, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0,
                                                        kv_transfer_params=kv))
        assert e.value.param == "prompt_logprobs" and "--role decode" in str(e.value)
        # the same request without them is served from the pulled KV
        dec.add_request("d", prompt, SamplingParams(max_tokens=4, temperature=0, kv_transfer_params=kv))
        while dec.has_unfinished_requests() or pre.has_unfinished_requests():
            dec.step()
            pre.step()
        assert dec.get_stats().kv_transfers == 1
    finally:
        pre.close()
        dec.close()


def test_speculative_decoding_leaves_prompt_logprobs_exact(path):
    """Drafts are verified in decode steps only: the prefill's prompt rows are the same with
    speculation on (n-gram drafts here), and the greedy tokens too."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=K)
    plain = LLM(path, dtype="float32", max_num_batched_tokens=16)
    prompts = corpus_prompts(plain.tokenizer, lens=[17, 40])
    ref = plain.generate(prompts, params)
    spec = LLM(path, dtype="float32", max_num_batched_tokens=16, speculative_config='{"method": "ngram", '
               '"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}')
    outs = spec.generate(prompts, params)
    assert spec.engine.get_stats().spec_decode.num_draft_tokens > 0
    for out, r in zip(outs, ref):
        check(out, path, spec.tokenizer)
        assert out.token_ids == r.token_ids
