"""BlockManager and Scheduler on fake sequences: no model, exact numbers."""
import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.sampling_params import SamplingParams


def seq(name: str, prompt_len: int) -> Sequence:
    return Sequence(name, list(range(prompt_len)), SamplingParams(max_tokens=100), 0.0)


def run_step(sched: Scheduler, token: int = 7):
    """One fake step: schedule, mark the scheduled tokens computed, 'sample' a token for each
    sequence whose tokens are all cached (what the engine does with real logits)."""
    out = sched.schedule(now=1.0)
    for s, n in zip(out.seqs, out.num_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(token)
    return out


def test_block_manager_allocate_free_and_refcounts():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", 5)
    assert bm.blocks_needed(a, 5) == 2
    bm.allocate(a, 5)
    assert a.block_table == [0, 1] and bm.num_free_blocks == 2
    assert bm.slot(a, 4) == 1 * 4 + 0
    bm.allocate(a, 8)            # still inside block 1: nothing new
    assert a.block_table == [0, 1]
    bm.allocate(a, 9)
    assert a.block_table == [0, 1, 2]
    assert not bm.can_allocate(seq("b", 8), 8)
    with pytest.raises(RuntimeError):
        bm.allocate(seq("b", 8), 8)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 4
    bm.check_all_free()
    b = seq("b", 4)
    bm.allocate(b, 4)
    with pytest.raises(AssertionError, match="leak"):
        bm.check_all_free()


def test_budget_chunks_and_decode_first():
    bm = BlockManager(num_blocks=100, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=10, max_num_seqs=8)
    a, b = seq("a", 3), seq("b", 25)
    s.add(a)
    s.add(b)
    out = run_step(s)
    # a's whole prompt (3), then the first chunk of b with the rest of the budget
    assert [x.request_id for x in out.seqs] == ["a", "b"] and out.num_tokens == [3, 7]
    assert out.is_prefill == [True, True]
    out = run_step(s)
    # a now decodes first (1 token), b's prefill takes the remaining 9
    assert [x.request_id for x in out.seqs] == ["a", "b"] and out.num_tokens == [1, 9]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 9
    c = seq("c", 4)
    s.add(c)
    out = run_step(s)
    # decode a, finish b's prompt (9 left), no budget left for c
    assert out.num_tokens == [1, 9] and c.status == SequenceStatus.WAITING
    assert b.num_computed_tokens == 25 and b.num_output_tokens == 1 and b.metrics.num_prefill_steps == 3
    out = run_step(s)
    assert [x.request_id for x in out.seqs] == ["a", "b", "c"] and out.num_tokens == [1, 1, 4]
    assert out.total_tokens <= 10
    # blocks cover exactly the cached tokens
    for x in (a, b, c):
        assert len(x.block_table) == -(-x.num_computed_tokens // 4)


def test_max_num_seqs_caps_running():
    bm = BlockManager(num_blocks=100, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        s.add(seq(str(i), 2))
    out = run_step(s)
    assert [x.request_id for x in out.seqs] == ["0", "1"] and len(s.waiting) == 1


def test_preempts_most_recent_and_requeues_at_front():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    a, b = seq("a", 8), seq("b", 7)
    s.add(a)
    s.add(b)
    run_step(s)                 # a: 2 blocks, b: 2 blocks; all 4 used
    assert bm.num_free_blocks == 0
    # a has 9 tokens now (needs a 3rd block to decode): b, admitted last, is preempted
    out = run_step(s)
    assert out.preempted == [b] and b.status == SequenceStatus.WAITING and s.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.metrics.num_preemptions == 1
    assert b.num_tokens == 8    # prompt + its generated token: recomputed on re-admission
    assert [x.request_id for x in out.seqs] == ["a"] and len(a.block_table) == 3
    # when a finishes, b comes back and re-prefills prompt + generated token in one go
    s.finish(a, "stop")
    out = run_step(s)
    assert out.seqs == [b] and out.num_tokens == [8] and out.is_prefill == [True]
    s.finish(b, "stop")
    bm.check_all_free()


def test_preempts_itself_when_all_others_are_scheduled():
    bm = BlockManager(num_blocks=3, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=6, max_num_seqs=8)
    a, b = seq("a", 4), seq("b", 12)
    s.add(a)
    s.add(b)
    out = run_step(s)          # a: 4 tokens (1 block), b: first chunk of 2 (1 block)
    assert out.num_tokens == [4, 2]
    # a decodes first and takes the last free block; b's next chunk needs one more and every
    # other running sequence is already in this step, so b preempts itself
    out = run_step(s)
    assert out.seqs == [a] and out.preempted == [b]
    assert s.waiting[0] is b and b.block_table == [] and b.num_computed_tokens == 0
    assert bm.num_free_blocks == 1


def test_abort_frees_blocks_everywhere():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=8, max_num_seqs=8)
    a, b, c = seq("a", 6), seq("b", 30), seq("c", 3)
    for x in (a, b, c):
        s.add(x)
    run_step(s)                     # a whole, b partially prefilled, c waiting
    assert b.block_table and c.status == SequenceStatus.WAITING
    s.finish(b, "abort")            # mid-prefill
    s.finish(c, "abort")            # waiting
    s.finish(a, "abort")            # decoding
    assert not s.has_unfinished()
    bm.check_all_free()
