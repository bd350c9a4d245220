"""Scheduling policies on fake sequences and a fixed step-time model: no model, exact numbers."""
import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.cost_model import StepCostModel
from pdserve.engine.policy import PriorityPolicy, SLOPolicy, make_policy
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.objectives import RequestObjectives
from pdserve.sampling_params import SamplingParams

# 10 ms a step plus 1 ms a token: easy to do in one's head
FAKE_COST = (0.010, 0.001, 0.0, 0.0)


def seq(name: str, prompt_len: int, priority: int = 0, arrival: float = 0.0, ttft: float | None = None,
        tpot: float | None = None) -> Sequence:
    s = Sequence(name, list(range(prompt_len)), SamplingParams(max_tokens=100,
                                                               objectives=RequestObjectives(priority=priority)),
                 arrival)
    s.metrics.ttft_target, s.metrics.tpot_target = ttft, tpot   # what the engine sets from the objectives
    return s


def run_step(sched: Scheduler, now: float = 1.0, token: int = 7):
    out = sched.schedule(now=now)
    for s, n in zip(out.seqs, out.num_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(token)
    return out


def names(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def slo_scheduler(num_blocks=100, block_size=4, budget=64, seats=8, admission="serve"):
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size)
    policy = SLOPolicy(StepCostModel(FAKE_COST), budget, admission)
    return Scheduler(bm, budget, seats, policy=policy)


# ---- priority

def test_priority_orders_waiting_by_priority_then_arrival():
    s = Scheduler(BlockManager(100, 4), max_num_batched_tokens=4, max_num_seqs=8, policy=PriorityPolicy())
    for name, prio, arrival in (("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0)):
        s.add(seq(name, 4, prio, arrival))
    seqs = list(s.waiting)
    for t in range(8):
        run_step(s, now=float(t))
    admitted = sorted(seqs, key=lambda x: (x.metrics.first_scheduled_time, x.seq_no))
    assert names(admitted) == ["b", "d", "c", "a"]
    # a waits a step more: c's prompt took two steps beside the decodes
    assert [x.metrics.first_scheduled_time for x in admitted] == [0.0, 1.0, 2.0, 4.0]


def test_fcfs_keeps_arrival_order():
    s = Scheduler(BlockManager(100, 4), max_num_batched_tokens=4, max_num_seqs=8, policy=make_policy("fcfs"))
    for name, prio in (("a", 2), ("b", 0)):
        s.add(seq(name, 4, prio))
    assert names(run_step(s).seqs) == ["a"]


def test_higher_priority_arrival_preempts_for_a_seat():
    s = Scheduler(BlockManager(100, 4), max_num_batched_tokens=64, max_num_seqs=2, policy=PriorityPolicy())
    a, b = seq("a", 6, priority=1, arrival=0.0), seq("b", 6, priority=1, arrival=1.0)
    s.add(a)
    s.add(b)
    run_step(s)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    c = seq("c", 5, priority=0, arrival=2.0)
    s.add(c)
    out = run_step(s)
    # b (lower priority, latest) gave up its seat and blocks (freed tail first: 3, 2 go to the back)
    assert out.preempted == [b] and b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and b.metrics.num_preemptions == 1
    assert names(out.seqs) == ["a", "c"] and out.num_tokens == [1, 5] and out.is_prefill == [False, True]
    assert c.block_table == [4, 5] and list(s.block_manager.free_blocks)[-2:] == [3, 2]
    assert list(s.waiting) == [b]
    # b keeps its 7 tokens (6 prompt + 1 generated) and is re-prefilled once a seat is free
    assert b.num_tokens == 7


def test_equal_priority_does_not_preempt():
    s = Scheduler(BlockManager(100, 4), max_num_batched_tokens=64, max_num_seqs=1, policy=PriorityPolicy())
    a, b = seq("a", 4, priority=1), seq("b", 4, priority=1, arrival=1.0)
    s.add(a)
    run_step(s)
    s.add(b)
    out = run_step(s)
    assert out.preempted == [] and names(out.seqs) == ["a"] and b.status == SequenceStatus.WAITING


def test_higher_priority_arrival_preempts_for_blocks():
    # 4 blocks of 4: a and b hold two each; c needs one
    s = Scheduler(BlockManager(4, 4), max_num_batched_tokens=64, max_num_seqs=8, policy=PriorityPolicy())
    a, b = seq("a", 7, priority=3, arrival=0.0), seq("b", 7, priority=2, arrival=1.0)
    s.add(a)
    s.add(b)
    run_step(s)   # b (priority 2) is admitted first
    assert b.block_table == [0, 1] and a.block_table == [2, 3] and s.block_manager.num_free_blocks == 0
    c = seq("c", 3, priority=0, arrival=2.0)
    s.add(c)
    out = run_step(s)
    # a has the lowest priority (3): it goes, though it arrived first; its blocks come back 3, 2
    assert out.preempted == [a] and names(out.seqs) == ["b", "c"] and out.num_tokens == [1, 3]
    assert b.block_table == [0, 1] and c.block_table == [3]
    assert list(s.block_manager.free_blocks) == [2]


def test_priority_does_not_preempt_when_it_would_not_make_room():
    # c needs 3 blocks; only a (1 block) has a lower priority: evicting it would not let c in
    s = Scheduler(BlockManager(2, 4), max_num_batched_tokens=64, max_num_seqs=8, policy=PriorityPolicy())
    a, b = seq("a", 3, priority=5), seq("b", 3, priority=0, arrival=1.0)
    s.add(a)
    s.add(b)
    run_step(s)
    s.add(seq("c", 12, priority=1, arrival=2.0))
    out = run_step(s)
    assert out.preempted == [] and names(out.seqs) == ["b", "a"]


def test_priority_victim_when_a_decode_needs_a_block():
    # 3 blocks of 2; c (priority 1) is admitted after b (priority 2)
    s = Scheduler(BlockManager(3, 2), max_num_batched_tokens=64, max_num_seqs=8, policy=PriorityPolicy())
    a, b, c = seq("a", 1, priority=0), seq("b", 1, priority=2, arrival=1.0), seq("c", 1, priority=1, arrival=2.0)
    s.add(a)
    s.add(b)
    run_step(s)
    s.add(c)
    run_step(s)   # a and b decode at position 1, inside their first block; c prefills
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2]) and s.running == [a, b, c]
    out = run_step(s)   # a and b reach position 2: a second block each, none free
    # a takes b's block (lowest priority; fcfs would take c's, the most recent); b is gone, c
    # decodes inside its block
    assert out.preempted == [b] and names(out.seqs) == ["a", "c"] and out.num_tokens == [1, 1]
    assert a.block_table == [0, 1] and c.block_table == [2] and list(s.waiting) == [b]


# ---- slo

def test_slo_admits_by_ttft_slack():
    s = slo_scheduler(budget=8)
    s.add(seq("loose", 8, arrival=0.0, ttft=5.0))
    s.add(seq("none", 8, arrival=0.0))          # no target: ordered as if NO_TARGET_TTFT_S
    s.add(seq("tight", 8, arrival=0.5, ttft=1.0))
    s.add(seq("tight-long", 8 * 30, arrival=0.5, ttft=1.0))   # same deadline, 30 steps of prefill: less slack
    admitted = [names(run_step(s).seqs)[-1] for _ in range(4)]
    assert admitted == ["tight-long", "tight-long", "tight-long", "tight-long"]
    for _ in range(26):
        run_step(s)
    order = []
    for _ in range(6):
        out = run_step(s)
        order += [x.request_id for x, p in zip(out.seqs, out.is_prefill) if p and x.request_id not in order]
    assert order == ["tight", "loose", "none"]


def test_slo_caps_prefill_to_protect_the_tightest_tpot():
    s = slo_scheduler(budget=64)
    a = seq("a", 4, tpot=0.0375)
    s.add(a)
    run_step(s)
    s.add(seq("b", 100, ttft=10.0))
    out = run_step(s)
    # one decode + n prefill tokens: 10 ms + (1 + n) ms <= 0.8 x 37.5 ms (TPOT_HEADROOM) -> n = 19
    assert names(out.seqs) == ["a", "b"] and out.num_tokens == [1, 19]
    out = run_step(s)
    assert out.num_tokens == [1, 19] and out.num_prefill_tokens == 19


def decoding(s: Scheduler, name: str, outputs: int, tpot: float, max_tokens: int = 100) -> Sequence:
    """A sequence admitted and decoded until it has `outputs` tokens."""
    a = seq(name, 4, tpot=tpot)
    a.params.max_tokens = max_tokens
    s.add(a)
    for _ in range(outputs):
        run_step(s)
    assert a.num_output_tokens == outputs
    return a


def test_slo_cap_lends_a_decode_its_credit_against_a_mean_tpot():
    s = slo_scheduler(budget=512)
    a = decoding(s, "a", 5, tpot=0.040)
    a.metrics.first_token_time = 1.0 - 0.0995   # 4 intervals in 99.5 ms, against 4 x 32 ms allowed
    s.add(seq("b", 1000, ttft=10.0))
    out = run_step(s, now=1.0)
    # allowance 32 ms + 28.5 ms banked + 16 tokens x (32 - 11 ms decode step) = 396.5 ms:
    # 10 ms + (1 + n) ms <= 396.5 ms -> n = 385
    assert names(out.seqs) == ["a", "b"] and out.num_tokens == [1, 385]


def test_slo_cap_without_credit_is_the_per_token_allowance():
    s = slo_scheduler(budget=512)
    a = decoding(s, "a", 5, tpot=0.0375)
    a.metrics.first_token_time = 1.0 - 0.5   # far behind its target: nothing to lend
    s.add(seq("b", 1000, ttft=10.0))
    assert run_step(s, now=1.0).num_tokens == [1, 19]   # as with no credit at all


def test_slo_cap_lends_only_the_tokens_a_request_has_left():
    s = slo_scheduler(budget=512)
    a = decoding(s, "a", 5, tpot=0.040, max_tokens=7)   # one more token after this step's
    a.metrics.first_token_time = 1.0 - 0.1275   # 0.5 ms banked
    s.add(seq("b", 1000, ttft=10.0))
    # 32 + 0.5 + 1 x 21 = 53.5 ms -> n = 42
    assert run_step(s, now=1.0).num_tokens == [1, 42]


def test_slo_admits_an_urgent_arrival_before_a_running_prefill_continues():
    s = slo_scheduler(budget=8)
    s.add(seq("long", 80, arrival=0.0, ttft=60.0))
    run_step(s)
    s.add(seq("short", 6, arrival=0.5, ttft=1.0))
    out = run_step(s)
    assert names(out.seqs) == ["short"] and out.num_tokens == [6]   # the long one's chunk waits a step
    out = run_step(s)
    assert names(out.seqs) == ["short", "long"]   # then it continues beside the short one's decode


def test_fcfs_lets_a_running_prefill_finish_first():
    bm = BlockManager(num_blocks=100, block_size=4)
    s = Scheduler(bm, 8, 8)
    s.add(seq("long", 80, arrival=0.0, ttft=60.0))
    run_step(s)
    s.add(seq("short", 6, arrival=0.5, ttft=1.0))
    assert names(run_step(s).seqs) == ["long"]


def test_slo_cap_follows_the_tightest_running_target():
    s = slo_scheduler(budget=64)
    s.add(seq("a", 4, tpot=0.030))
    s.add(seq("c", 4, tpot=0.01875))
    run_step(s)
    s.add(seq("b", 100, ttft=10.0))
    out = run_step(s)
    # two decodes + n prefill tokens: 10 ms + (2 + n) ms <= 0.8 x 18.75 ms -> n = 3
    assert names(out.seqs) == ["a", "c", "b"] and out.num_tokens == [1, 1, 3]


def test_slo_no_tpot_target_no_cap():
    s = slo_scheduler(budget=64)
    s.add(seq("a", 4))
    run_step(s)
    s.add(seq("b", 100, ttft=10.0))
    assert run_step(s).num_tokens == [1, 63]


def test_slo_floor_of_one_token_when_the_decodes_alone_miss_the_target():
    s = slo_scheduler(budget=64)
    s.add(seq("a", 4, tpot=0.005))   # below the 10 ms intercept: no step can meet it
    run_step(s)
    b = seq("b", 3, ttft=10.0)
    s.add(b)
    for k in range(3):
        out = run_step(s)
        assert out.num_tokens == [1, 1], k
    assert b.num_computed_tokens == 3 and b.num_output_tokens == 1


def test_slo_no_starvation_under_a_stream_of_tight_requests():
    s = slo_scheduler(budget=4, seats=1)
    old = seq("old", 4, arrival=0.0, ttft=10.0)
    s.add(old)
    admitted_at = None
    for t in range(1, 30):
        s.add(seq(f"tight-{t}", 4, arrival=float(t), ttft=2.0))   # deadline t + 2: earlier than old's, until t > 8
        out = run_step(s, now=float(t))
        for x in out.seqs:
            if x.num_output_tokens == 1:
                s.finish(x, "length")
                if x is old:
                    admitted_at = t
        if admitted_at:
            break
    # the first tight one arrives before old is scheduled; old's deadline (10) beats arrivals from t = 9 on
    assert admitted_at is not None and admitted_at <= 10


def test_slo_request_without_a_ttft_target_is_not_starved():
    s = slo_scheduler(budget=4, seats=1)
    old = seq("old", 4, arrival=0.0)   # no target: ordered as if its deadline were NO_TARGET_TTFT_S
    s.add(old)
    for t in range(1, 40):
        s.add(seq(f"tight-{t}", 4, arrival=float(t), ttft=2.0))
        out = run_step(s, now=float(t))
        for x in out.seqs:
            if x.num_output_tokens == 1:
                s.finish(x, "length")
        if old.is_finished:
            break
    assert old.is_finished and 28 <= t <= 31


def test_slo_resumed_sequences_go_first():
    s = slo_scheduler(budget=64)
    resumed = seq("resumed", 4, arrival=5.0, ttft=100.0)
    resumed.token_ids.append(9)   # had generated a token before it was preempted
    s.add(seq("urgent", 4, arrival=0.0, ttft=0.1))
    s.add(resumed)
    out = run_step(s)
    assert names(out.seqs) == ["resumed", "urgent"] and out.num_tokens == [5, 4]


def test_slo_admission_rejects_what_cannot_be_met():
    s = slo_scheduler(budget=512, admission="reject")
    s.add(seq("ahead", 500, arrival=0.0, ttft=0.1))
    policy = s.policy
    late = seq("late", 50, arrival=0.0, ttft=0.3)
    # 550 tokens at 512 a step: 2 steps of 10 + 512 ms
    assert policy.predicted_ttft(late, s) == pytest.approx(2 * (0.010 + 0.512))
    why = policy.refuse(late, s, now=0.0)
    assert why is not None and "cannot be met" in why and "300 ms" in why
    assert policy.refuse(seq("fine", 50, arrival=0.0, ttft=5.0), s, now=0.0) is None
    assert policy.refuse(seq("no-target", 50), s, now=0.0) is None
    assert SLOPolicy(policy.cost_model, 512, "serve").refuse(late, s, now=0.0) is None
