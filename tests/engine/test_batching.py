"""Continuous batching, chunked prefill and preemption never change what a request generates."""
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence
from tests.helpers import corpus_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def prompts(path):
    return corpus_prompts(LLM(path).tokenizer, lens=[5, 40, 13, 90, 1, 27, 64, 8])


@pytest.fixture(scope="module")
def solo(path, prompts):
    """Each prompt run alone in its own engine: the reference for everything below."""
    llm = LLM(path)
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def run_to_end(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int]]]]):
    """Step the engine; before step k, add the requests in arrivals[k]. Returns final outputs by id."""
    final, step = {}, 0
    while engine.has_unfinished_requests() or any(k >= step for k in arrivals):
        for rid, prompt in arrivals.get(step, []):
            engine.add_request(rid, prompt, GREEDY)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
    return final


def test_requests_joining_mid_decode_get_their_solo_output(path, prompts, solo):
    engine = LLMEngine(path, max_num_batched_tokens=32, max_num_seqs=8)
    # arrivals spread over steps, while earlier requests are decoding or mid-prefill
    arrivals = {0: [("0", prompts[0]), ("1", prompts[1])], 3: [("2", prompts[2])], 5: [("3", prompts[3])],
                9: [("4", prompts[4]), ("5", prompts[5])], 14: [("6", prompts[6]), ("7", prompts[7])]}
    final = run_to_end(engine, arrivals)
    assert [final[str(i)].token_ids for i in range(8)] == solo
    assert engine.last_step is not None
    engine.block_manager.check_all_free()


def test_steps_mix_prefill_and_decode_under_the_budget(path, prompts):
    engine = LLMEngine(path, max_num_batched_tokens=16, max_num_seqs=8)
    engine.add_request("short", prompts[0], GREEDY)
    engine.step()                          # prefill of the short prompt
    engine.add_request("long", prompts[3], GREEDY)   # 90 tokens: 6+ chunks
    mixed = 0
    while engine.has_unfinished_requests():
        engine.step()
        st = engine.last_step
        assert st.num_prefill_tokens + st.num_decode_tokens <= 16
        mixed += st.num_prefill_tokens > 0 and st.num_decode_tokens > 0
    # the running decode was never stalled: it shared every step of the long prefill
    assert mixed >= 5


def test_preemption_keeps_outputs_and_frees_every_block(path, prompts, solo):
    # 12 blocks of 16 tokens = 192 slots for 8 requests needing up to 114 each: must preempt
    llm = LLM(path, num_kv_blocks=12, block_size=16, max_num_batched_tokens=64)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == solo
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.engine.block_manager.check_all_free()
    assert not llm.engine.seqs


def test_abort_frees_blocks(path, prompts):
    engine = LLMEngine(path, max_num_batched_tokens=32)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    for _ in range(4):
        engine.step()
    for i in range(len(prompts)):
        engine.abort_request(str(i))
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == [str(i) for i in range(len(prompts))]
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_all_free()


def test_request_metrics(path, prompts):
    llm = LLM(path, max_num_batched_tokens=16)
    out = llm.generate([prompts[3]], GREEDY)[0]
    m = out.metrics
    assert len(m.token_times) == len(out.token_ids) == 24
    assert m.num_prefill_steps == 6                   # 90 tokens in chunks of 16
    assert 0 <= m.queue_time <= m.ttft <= m.e2e
    assert m.first_token_time == m.token_times[0] and m.finished_time == m.token_times[-1]
    assert m.tpot == pytest.approx((m.e2e - m.ttft) / 23)
    assert len(m.itl) == 23 and all(x >= 0 for x in m.itl)
    assert m.prefill_time + m.decode_time == pytest.approx(m.e2e - m.queue_time)


def test_stream_deltas_add_up(path, prompts):
    llm = LLM(path)
    texts, finals = {}, {}
    for out in llm.generate_stream(prompts[:3], GREEDY):
        texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
        if out.finished:
            finals[out.request_id] = out
    assert len(finals) == 3
    for rid, out in finals.items():
        assert texts[rid] == out.text == llm.tokenizer.decode(out.token_ids)


def test_streamed_outputs_keep_their_own_tokens(path, prompts):
    # Outputs hand out their token ids and logprobs as prefixes of the sequence's lists, copied
    # when read: an output read after later steps still shows only what it had when made.
    llm = LLM(path)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    outs = [o for o in llm.generate_stream(prompts[:2], params) if o.new_token_ids]
    final = {o.request_id: o for o in outs if o.finished}
    seen = {}
    for o in outs:
        seen[o.request_id] = seen.get(o.request_id, []) + o.new_token_ids
        assert o.token_ids == seen[o.request_id] == final[o.request_id].token_ids[:len(o.token_ids)]
        assert o.logprobs == final[o.request_id].logprobs[:len(o.token_ids)]
        assert o.new_logprobs == o.logprobs[-len(o.new_token_ids):]


@pytest.mark.usefixtures("cpu_isa")   # the kernels' step metadata (meta.step)
def test_prepare_flattens_decodes_and_chunks_alike(path):
    # prepare() takes a shortcut for one-token sequences (decodes, and a last one-token chunk):
    # every row must be what the general rule gives, token ids[first:first + n] at positions
    # first.. in the slots of the block table.
    engine = LLMEngine(path, block_size=4)
    bm, sched = engine.block_manager, SchedulerOutput()
    for i, (length, first, n) in enumerate([(9, 8, 1), (14, 3, 6), (7, 0, 7), (11, 10, 1), (6, 5, 1)]):
        seq = Sequence(str(i), list(range(20 + i, 20 + i + length)), GREEDY, 0.0)
        seq.num_computed_tokens, seq.prefill_len = first, length if n > 1 else first
        bm.allocate(seq, first + n)
        sched.add(seq, n)
    input_ids, positions, meta, logit_rows, sample_seqs, verify = engine.runner.prepare(sched)
    assert verify == []   # no drafts: nothing verifies
    rows = [(seq, p) for seq, n in zip(sched.seqs, sched.num_tokens)
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n)]
    assert input_ids.tolist() == [seq.token_ids[p] for seq, p in rows]
    assert positions.tolist() == [p for _, p in rows]
    assert meta.slot_mapping.tolist() == [bm.slot(seq, p) for seq, p in rows]
    assert logit_rows == [0, 13, 14, 15] and sample_seqs == sched.seqs[:1] + sched.seqs[2:]
    # the one-token rows are not all at the front: the kernels get them by index
    step = meta.step
    assert step.decode_first_row == -1 and step.decode_rows.tolist() == [0, 14, 15]
    assert step.decode_ctx.tolist() == [9, 11, 6]
    padded = [seq.block_table + [0] * (3 - len(seq.block_table)) for seq in sched.seqs]   # 3 blocks: 9 and 11 keys
    assert step.decode_tables.tolist() == [padded[0], padded[3], padded[4]]
    assert step.prefill_starts.tolist() == [1, 7] and step.prefill_q_lens.tolist() == [6, 7]
    assert step.prefill_ctx.tolist() == [9, 7] and step.prefill_tables.tolist() == padded[1:3]
    for seq in sched.seqs:
        bm.free(seq)


def test_kv_cache_sizing(path):
    by_blocks = LLMEngine(path, num_kv_blocks=7, block_size=8)
    assert by_blocks.block_manager.num_blocks == 7 and by_blocks.runner.kv_cache.shape[2] == 7 * 8
    per_block = by_blocks.runner.bytes_per_block
    by_memory = LLMEngine(path, kv_cache_memory=per_block * 5 + per_block // 2, block_size=8)
    assert by_memory.block_manager.num_blocks == 5
    assert by_memory.runner.kv_cache.numel() * by_memory.runner.kv_cache.element_size() == 5 * per_block
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(path, kv_cache_memory=per_block - 1, block_size=8)


def test_a_failing_step_fails_only_its_requests(path, prompts):
    engine = LLMEngine(path, max_num_batched_tokens=64)
    engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", prompts[1], GREEDY)
    real = engine.runner.execute
    engine.runner.execute = lambda *a: (_ for _ in ()).throw(RuntimeError("injected"))
    outs = engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("a", "error"), ("b", "error")]
    assert all(o.finished for o in outs)
    engine.block_manager.check_all_free()
    engine.runner.execute = real
    engine.add_request("c", prompts[0], GREEDY)
    final = run_to_end(engine, {})
    assert final["c"].finish_reason == "length" and len(final["c"].token_ids) == GREEDY.max_tokens


def _same_logprobs(a: list[dict[int, float]], b: list[dict[int, float]], exact: bool) -> bool:
    if exact:
        return a == b
    # the sampled token's and every shared top token's logprob (a near-tie may swap the runner-up)
    return len(a) == len(b) and all(v == pytest.approx(d2[k], abs=1e-4) for d, d2 in zip(a, b) for k, v in d.items()
                                    if k in d2)


@pytest.mark.parametrize("cpu_kernels", [None, False], ids=["kernels", "torch"])
def test_final_only_requests_get_one_output_equal_to_the_streamed_final(path, prompts, cpu_kernels):
    # A final_only request (LLM.generate's, a non-streamed API response's) makes no output per
    # step, only its final one, which carries everything as new; requests streamed beside it in
    # the same steps are unaffected. The kernels compute each row alike whatever its place in the
    # batch (bitwise-equal logprobs); torch's products differ with the batch's shape (by ~4e-6 where measured).
    engine = LLMEngine(path, max_num_batched_tokens=32, cpu_kernels=cpu_kernels)
    exact = engine.runner.weight_format != "torch"
    params = dict(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2, stop=["zzzz"])
    for i in range(2):
        engine.add_request(f"s{i}", prompts[i], SamplingParams(**params))
        engine.add_request(f"f{i}", prompts[i], SamplingParams(**params, final_only=True))
    engine.add_request("fa", prompts[2], SamplingParams(**params, final_only=True))   # aborted mid-decode
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        steps += 1
        if steps == 6:
            engine.abort_request("fa")
    for i in range(2):
        streamed, (final,) = outs[f"s{i}"], outs[f"f{i}"]
        assert len(streamed) > 1 and final.finished
        last = streamed[-1]
        assert (final.token_ids, final.text, final.finish_reason) == (last.token_ids, last.text, last.finish_reason)
        assert _same_logprobs(final.logprobs, last.logprobs, exact)
        assert final.new_token_ids == final.token_ids and final.new_text == final.text
        assert final.new_logprobs == final.logprobs
        assert len(final.metrics.token_times) == 10
    (aborted,) = outs["fa"]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 10
    assert aborted.new_token_ids == aborted.token_ids
    engine.block_manager.check_all_free()


def test_final_only_text_is_decoded_when_an_output_is_made(path, prompts):
    # A final-only request without stop strings decodes its tokens only when an output is made
    # (its final one, or an abort's), not in every step; its text is the streamed request's,
    # characters split across tokens and bytes held back to the end included.
    engine = LLMEngine(path)
    proc = engine.processor
    ids = engine.tokenizer.encode("naïve café 世界 🙂 done", add_special_tokens=False)
    ids += [engine.tokenizer.encode("🙂", add_special_tokens=False)[0]]   # ends inside a character
    params = dict(max_tokens=len(ids), temperature=0, ignore_eos=True)
    deferred = proc.new_sequence("d", prompts[0], SamplingParams(**params, final_only=True), 0.0)
    streamed = proc.new_sequence("s", prompts[0], SamplingParams(**params), 0.0)
    with_stop = proc.new_sequence("w", prompts[0], SamplingParams(**params, final_only=True, stop=["zzzz"]), 0.0)
    assert deferred.output.deferred and not streamed.output.deferred and not with_stop.output.deferred
    half = len(ids) // 2
    for t in ids[:half]:
        for seq in (deferred, streamed, with_stop):
            proc.append_token(seq, t, None, 0.0)
    assert deferred.output.text == "" and deferred.output.num_tokens == 0      # nothing decoded in the steps
    assert with_stop.output.text == streamed.output.text != ""                   # stop strings need the text each step
    assert proc.make_output(deferred, []).text == streamed.output.text    # an output (an abort's) decodes
    assert deferred.output.num_tokens == half
    for t in ids[half:]:
        for seq in (deferred, streamed, with_stop):
            proc.append_token(seq, t, None, 0.0)
    assert deferred.finish_reason == streamed.finish_reason == "length"
    assert deferred.output.text == streamed.output.text == with_stop.output.text        # caught up before the final flush
    assert streamed.output.text.endswith("\ufffd")                       # the held-back bytes, flushed
    assert engine.tokenizer.decode(ids[:-1]) in streamed.output.text


def test_generate_text_equals_the_streamed_text(path, prompts):
    llm = LLM(path)
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True)
    finals = {o.request_id: o for o in llm.generate_stream(prompts[:4], params) if o.finished}
    outs = llm.generate(prompts[:4], params)
    assert [o.text for o in outs] == [finals[k].text for k in sorted(finals, key=lambda k: int(k))]
    assert all(o.text for o in outs)


def test_generate_asks_for_final_outputs_only_and_leaves_params_alone(path, prompts, solo):
    llm = LLM(path)
    seen = []
    step = llm.engine.step

    def counting_step():
        out = step()
        seen.extend(out)
        return out
    llm.engine.step = counting_step
    outs = llm.generate(prompts[:3], GREEDY)
    assert [o.token_ids for o in outs] == solo[:3]
    assert len(seen) == 3 and all(o.finished for o in seen)   # no per-step outputs
    assert GREEDY.final_only is False
