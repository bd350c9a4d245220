"""The simulator on pdserve's real scheduler with a hand-computable step-time model."""
import pytest

from pdserve.bench import bench_metrics
from pdserve.sim.cluster import Placement
from pdserve.sim.report import summarize
from pdserve.sim.workload import SimRequest
from tests.sim.helpers import FAKE, requests, simulate, spec


def test_steps_are_the_real_schedulers():
    """The step-time model sees the scheduler's own steps: budget 10, prompts of 3 and 25 give
    [3, 7], then [1, 9] (a decodes first), as tests/engine/test_scheduler.py expects."""
    seen = []

    def recording(out):
        seen.append((tuple(s.request_id for s in out.seqs), tuple(out.num_tokens)))
        return FAKE(out)

    simulate(requests((0.0, 3, 4), (0.0, 25, 2)), sp=spec(num_blocks=100, block_size=4, budget=10, seats=8),
             step_time=recording)
    # b arrives at the same instant but after a's step started: a's first step carries a alone
    assert seen[0] == (("req-0",), (3,))
    assert seen[1] == (("req-0", "req-1"), (1, 9))
    assert seen[2] == (("req-0", "req-1"), (1, 9))


@pytest.mark.parametrize("policy, order", [("fcfs", ["a", "b", "c"]), ("priority", ["b", "c", "a"])])
def test_the_policy_decides_the_order(policy, order):
    """One seat: fcfs serves in arrival order; priority lets b (0) and c (1) preempt a (2)."""
    reqs = requests((0.0, 8, 5, 2), (0.001, 8, 5, 0), (0.002, 8, 5, 1))
    sim, res = simulate(reqs, sp=spec(seats=1, scheduling_policy=policy))
    ends = sorted(range(3), key=lambda i: res.results[i].start_time + res.results[i].latency)
    assert ["abc"[i] for i in ends] == order
    assert sum(r["preemptions"] for r in res.replicas) == (0 if policy == "fcfs" else 1)


def test_single_request_by_hand():
    """Prompt 100, 11 output tokens, step = 10 ms + 1 ms a token."""
    _, res = simulate(requests((0.0, 100, 11)))
    r = res.results[0]
    assert r.ttft == pytest.approx(0.110)          # one prefill step of 100 tokens
    assert r.tpot == pytest.approx(0.011)          # decode steps of 1 token
    assert r.latency == pytest.approx(0.220)
    # 1P1D: the prefill (110 ms), the hand-off (2 ms + 99 tokens' K/V in 1 ms), then the decode
    # worker computes the last prompt token itself (11 ms) and samples the first token
    _, res = simulate(requests((0.0, 100, 11)), Placement(prefill=1, decode=1))
    r = res.results[0]
    assert r.ttft == pytest.approx(0.110 + 0.003 + 0.011)
    assert r.tpot == pytest.approx(0.011)


def test_disaggregation_trades_ttft_for_tpot():
    """Long prompts arriving while others decode: on 2 colocated replicas a prompt's 410 ms
    prefill lands in its neighbour's decode steps; 1P1D keeps decode steps short but queues the
    prefills on one worker."""
    reqs = requests(*[(0.1 * i, 400, 21) for i in range(4)])
    colo = summarize(simulate(reqs, Placement(replicas=2))[1], None)
    pd = summarize(simulate(reqs, Placement(prefill=1, decode=1))[1], None)
    assert pd["mean_tpot_ms"] < 15 < colo["mean_tpot_ms"]
    assert colo["mean_ttft_ms"] < pd["mean_ttft_ms"]


@pytest.mark.parametrize("placement", [Placement(replicas=1), Placement(replicas=3), Placement(prefill=2, decode=1)])
def test_conservation_under_preemption(placement):
    """Every request finishes with all its tokens, and every block comes back, even with a KV
    cache small enough to preempt."""
    reqs = requests(*[(0.01 * i, 20 + 7 * i, 5 + i) for i in range(12)])
    sim, res = simulate(reqs, placement, sp=spec(num_blocks=30, block_size=4, budget=64, seats=8))
    assert all(r.success for r in res.results)
    assert [r.output_tokens for r in res.results] == [5 + i for i in range(12)]
    assert [r.prompt_len for r in res.results] == [20 + 7 * i for i in range(12)]
    m = summarize(res, None)
    assert m["completed"] == 12 and m["total_output_tokens"] == sum(5 + i for i in range(12))
    assert sum(r["preemptions"] for r in res.replicas) > 0
    for replica in sim.prefill + sim.decode:
        assert not replica.engine.has_unfinished_requests()   # nothing waiting, running, loading or leased
        replica.engine.block_manager.check_all_free()


def test_too_long_requests_are_refused_not_lost():
    reqs = requests((0.0, 10, 5), (0.0, 60, 10), (0.0, 10, 5))
    _, res = simulate(reqs, sp=spec(num_blocks=4, block_size=16))   # 64 tokens of cache
    assert [r.success for r in res.results] == [True, False, True]
    assert "exceeds the whole KV cache (64 tokens)" in res.results[1].error   # the engine's own 400


def test_max_concurrency_is_a_closed_loop():
    """Cap 1: each request is sent when the previous one has finished, its clock starting then."""
    reqs = requests(*[(0.0, 100, 11)] * 3)
    _, res = simulate(reqs, max_concurrency=1)
    assert [r.start_time for r in res.results] == pytest.approx([0.0, 0.220, 0.440])
    assert [r.ttft for r in res.results] == pytest.approx([0.110] * 3)


def test_goodput_is_bench_goodput():
    reqs = requests((0.0, 100, 11), (0.0, 100, 11))
    _, res = simulate(reqs)
    # the second waits behind the first's prefill step: TTFT 110 ms, then 211 ms
    slos = {"ttft": 150.0}
    m = summarize(res, slos)
    assert m["goodput_attainment"] == 0.5
    assert m["request_goodput"] == pytest.approx(
        bench_metrics.compute_metrics(res.results, res.duration, slos)["request_goodput"])
    assert m["request_goodput"] == pytest.approx(1 / res.duration)


def test_least_loaded_routing_avoids_the_busy_replica():
    """A long request on replica 0: round-robin still sends the third there, least-loaded does not."""
    reqs = requests((0.0, 50, 200), (0.001, 50, 3), (0.1, 50, 3))
    rr = simulate(reqs, Placement(replicas=2))[1]
    ll = simulate(reqs, Placement(replicas=2), router="least-loaded")[1]
    assert ll.results[2].ttft < rr.results[2].ttft


def test_prefix_aware_routing_finds_the_cached_prefix():
    """A prompt that extends an earlier one: the Ray app's prefix-aware router sends it to the
    replica that served the earlier one (a prefix-cache hit there); round-robin, to the other."""
    shared = [(7 * j) % 1000 for j in range(256)]
    reqs = [SimRequest(0.0, shared, 4), SimRequest(1.0, shared + [1, 2, 3], 4)]
    sp = spec(enable_prefix_caching=True)
    sim_rr, rr = simulate(reqs, Placement(replicas=2), sp)
    sim_pa, pa = simulate(reqs, Placement(replicas=2), sp, router="prefix-aware")
    assert [r.num_steps for r in sim_rr.decode] == [4, 4]
    assert [r.num_steps for r in sim_pa.decode] == [8, 0]
    assert pa.results[1].ttft < rr.results[1].ttft
    assert set(sim_pa.router._kv.in_flight.values()) == {0}   # every request's completion reached the router


def test_prefill_workers_have_their_own_step_time():
    """xPyD with a prefill pool twice as slow: the prompts take longer (TTFT), the decodes do not."""
    from pdserve.engine.cost_model import StepCostModel
    from pdserve.sim.costs import FittedStepTime
    slow = FittedStepTime(StepCostModel((0.020, 0.002, 0.0, 0.0)))
    reqs = requests((0.0, 99, 5))
    one = simulate(reqs, Placement(prefill=1, decode=1))[1].results[0]
    two = simulate(reqs, Placement(prefill=1, decode=1), prefill_step_time=slow)[1].results[0]
    # the prefill step: 10 ms + 99 ms, or 20 ms + 198 ms; the rest is the same
    assert two.ttft - one.ttft == pytest.approx(0.218 - 0.109)
    assert two.latency - two.ttft == pytest.approx(one.latency - one.ttft)


@pytest.mark.parametrize("placement", [Placement(replicas=2), Placement(prefill=1, decode=1)])
def test_router_latency_delays_the_request_not_its_decode(placement):
    reqs = requests((0.0, 99, 5), (0.5, 40, 3))
    base = simulate(reqs, placement)[1].results
    late = simulate(reqs, placement, router_latency_s=0.005)[1].results
    for a, b in zip(base, late):
        assert b.ttft == pytest.approx(a.ttft + 0.005)
        assert b.itl == pytest.approx(a.itl)
