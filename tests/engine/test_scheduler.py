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


# ---- the decode-aware prefill cap (max_prefill_tokens_with_decodes)

def test_prefill_cap_applies_only_to_steps_with_decodes():
    bm = BlockManager(num_blocks=100, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, max_prefill_tokens_with_decodes=8)
    a, b = seq("a", 3), seq("b", 100)
    s.add(a)
    s.add(b)
    out = run_step(s)
    # nothing decodes yet (an idle server): the whole budget, the cap does not apply
    assert out.num_tokens == [3, 61] and out.is_prefill == [True, True]
    out = run_step(s)
    # a decodes: b's chunk is capped at 8, not the 39 left of its prompt (budget left: 63)
    assert [x.request_id for x in out.seqs] == ["a", "b"] and out.num_tokens == [1, 8]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 8
    c = seq("c", 5)
    s.add(c)
    out = run_step(s)
    # the cap is for all prefills together: b took it, c is not admitted although budget is left
    assert out.num_tokens == [1, 8] and c.status == SequenceStatus.WAITING
    out = run_step(s)
    out = run_step(s)
    assert out.num_tokens == [1, 8] and b.num_computed_tokens == 93
    out = run_step(s)
    # b's last 7 tokens, and c gets the 1 token of the cap that is left
    assert [x.request_id for x in out.seqs] == ["a", "b", "c"] and out.num_tokens == [1, 7, 1]
    assert out.num_prefill_tokens == 8 and b.metrics.num_prefill_steps == 6
    out = run_step(s)
    assert [x.request_id for x in out.seqs] == ["a", "b", "c"] and out.num_tokens == [1, 1, 4]
    assert out.is_prefill == [False, False, True]
    for x in (a, b, c):
        assert len(x.block_table) == -(-x.num_computed_tokens // 4)


def test_prefill_cap_off_or_at_least_the_budget_changes_nothing():
    for cap in (0, 64, 1000):
        bm = BlockManager(num_blocks=100, block_size=4)
        s = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, max_prefill_tokens_with_decodes=cap)
        s.add(seq("a", 3))
        s.add(seq("b", 100))
        assert run_step(s).num_tokens == [3, 61]
        assert run_step(s).num_tokens == [1, 39]      # the rest of b's prompt, uncapped


def test_prefill_cap_of_one_still_moves_the_oldest_prefill_every_step():
    # the smallest cap: no prefill starves; prefills advance oldest first, one token a step
    bm = BlockManager(num_blocks=100, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=8, max_prefill_tokens_with_decodes=1)
    a, b, c = seq("a", 2), seq("b", 10), seq("c", 12)
    for x in (a, b, c):
        s.add(x)
    out = run_step(s)
    assert out.num_tokens == [2, 10, 4]              # no decodes: the whole budget; c is cut
    out = run_step(s)
    # a and b decode; c (8 left) gets one token
    assert [x.request_id for x in out.seqs] == ["a", "b", "c"] and out.num_tokens == [1, 1, 1]
    d = seq("d", 3)
    s.add(d)
    for _ in range(7):
        out = run_step(s)
        assert [x.request_id for x in out.seqs] == ["a", "b", "c"] and out.num_tokens == [1, 1, 1]
        assert d.status == SequenceStatus.WAITING
    # c's prompt is done (it decodes from now on): d is admitted, one token a step
    assert c.num_computed_tokens == 12 and c.num_output_tokens == 1
    out = run_step(s)
    assert [x.request_id for x in out.seqs] == ["a", "b", "c", "d"] and out.num_tokens == [1, 1, 1, 1]
    assert out.is_prefill == [False, False, False, True]


def test_prefill_cap_shares_between_running_and_partial_prefills_oldest_first():
    bm = BlockManager(num_blocks=100, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=32, max_num_seqs=8, max_prefill_tokens_with_decodes=6)
    a, b, c = seq("a", 4), seq("b", 30), seq("c", 20)
    for x in (a, b, c):
        s.add(x)
    out = run_step(s)
    assert out.num_tokens == [4, 28]                 # c waits: no budget left
    out = run_step(s)
    # a decodes; b's last 2 tokens, then c is admitted with the 4 left of the cap
    assert [x.request_id for x in out.seqs] == ["a", "b", "c"] and out.num_tokens == [1, 2, 4]
    out = run_step(s)
    assert [x.request_id for x in out.seqs] == ["a", "b", "c"] and out.num_tokens == [1, 1, 6]
    assert out.num_prefill_tokens == 6


def test_prefill_cap_with_preemption_keeps_the_rules():
    # 4 blocks of 4: a (8) and b (7) fill the cache in the first step; when a needs a third block,
    # b (admitted last) is preempted; a step with no decodes left re-prefills b with the whole budget
    bm = BlockManager(num_blocks=4, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, max_prefill_tokens_with_decodes=2)
    a, b = seq("a", 8), seq("b", 7)
    s.add(a)
    s.add(b)
    assert run_step(s).num_tokens == [8, 7]
    out = run_step(s)
    assert out.preempted == [b] and out.seqs == [a] and out.num_tokens == [1]
    s.finish(a, "stop")
    out = run_step(s)
    assert out.seqs == [b] and out.num_tokens == [8] and out.is_prefill == [True]
    s.finish(b, "stop")
    bm.check_all_free()


def test_prefill_cap_is_validated():
    from pdserve.config import EngineConfig

    assert EngineConfig(model="m", device="cpu").max_prefill_tokens_with_decodes == 0   # off by default
    assert EngineConfig(model="m", device="cpu", max_prefill_tokens_with_decodes=0).max_prefill_tokens_with_decodes == 0
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes must be >= 0"):
        EngineConfig(model="m", device="cpu", max_prefill_tokens_with_decodes=-1)


@pytest.mark.parametrize("flag, value, message", [
    ("--max-prefill-tokens-with-decodes", "-1", "must be >= 0 (0 = no cap), got -1"),
    ("--max-prefill-tokens-with-decodes", "many", "invalid int value: 'many'"),
    ("--max-num-batched-tokens", "0", "must be >= 1, got 0"),
])
def test_bad_scheduler_flags_are_one_line_cli_errors(flag, value, message):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pdserve", "generate", "x", flag, value], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines() == [f"pdserve generate: error: argument {flag}: {message}",
                                                           "(see `pdserve generate --help`)"]
    assert "Traceback" not in r.stderr


def test_engine_with_a_small_prefill_cap_generates_what_each_request_does_alone(tiny_llama):
    """End to end: the cap changes how prompts are chunked, never what is generated."""
    from pdserve import LLM, SamplingParams
    from pdserve.engine.llm_engine import LLMEngine
    from tests.helpers import corpus_prompts

    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = LLM(tiny_llama, max_prefill_tokens_with_decodes=0)
    prompts = corpus_prompts(ref.tokenizer, lens=[6, 70, 23, 41])
    solo = [ref.generate([p], greedy)[0].token_ids for p in prompts]
    engine = LLMEngine(tiny_llama, max_num_batched_tokens=64, max_prefill_tokens_with_decodes=5)
    engine.add_request("0", prompts[0], greedy)
    final, step, capped = {}, 0, 0
    while engine.has_unfinished_requests() or step < 3:
        if step == 2:                       # arrive while "0" decodes
            for i in (1, 2, 3):
                engine.add_request(str(i), prompts[i], greedy)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        st = engine.last_step
        if st.num_decode_tokens:
            assert st.num_prefill_tokens <= 5
            capped += st.num_prefill_tokens == 5
        step += 1
    assert [final[str(i)].token_ids for i in range(4)] == solo
    assert capped >= 10                     # every step while "0" decoded carried a capped chunk
    engine.block_manager.check_all_free()
