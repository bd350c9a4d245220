"""The simulator is the engine: the same workload, on the same clock, through pdserve's LLMEngine
with its real ModelRunner (the bundled model) and through a simulated replica, is scheduled
step for step alike; and a P/D decode worker's pulled request waits for a seat, as the real
scheduler makes it."""
import pytest

from pdserve.engine.args import DEFAULT_MODEL
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.sim.cluster import Placement
from tests.sim.helpers import FAKE, requests, simulate, spec

FLAGS = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=40)


def step_of(sched) -> tuple:
    return (tuple((s.request_id, n) for s, n in zip(sched.seqs, sched.num_tokens)),
            tuple(s.request_id for s in sched.preempted))


def engine_steps(reqs) -> list[tuple]:
    """The real engine as the server loop runs it, on a clock that each step moves on by FAKE's
    time for it: requests that have arrived are added, then one step."""
    engine = LLMEngine(DEFAULT_MODEL, device="cpu", threads=1, **FLAGS)
    seen, clock, forward = [], [0.0], engine.runner.execute

    def execute(sched):
        seen.append(step_of(sched))
        clock[0] += FAKE(sched)
        return forward(sched)
    engine.runner.execute = execute
    pending = list(enumerate(reqs))
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            clock[0] = max(clock[0], pending[0][1].arrival)
        while pending and pending[0][1].arrival <= clock[0]:
            i, r = pending.pop(0)
            engine.add_request(f"req-{i}", r.prompt, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
        engine.step()
    engine.block_manager.check_all_free()
    return seen


def test_the_simulator_schedules_as_the_engine_does():
    """Chunked prefills, decodes beside them, a full cache (preemption and recompute), arrivals
    between steps (never on a step's end: FAKE's steps are whole milliseconds)."""
    reqs = requests(*[(0.0005 + 0.013 * i, 20 + 9 * (i % 5), 8 + 3 * (i % 4)) for i in range(10)])
    real = engine_steps(reqs)
    simulated = []

    def recording(out):
        simulated.append(step_of(out))
        return FAKE(out)
    sim, _ = simulate(reqs, sp=spec(num_blocks=FLAGS["num_kv_blocks"], block_size=4, budget=32, seats=4),
                      step_time=recording)
    assert any(preempted for _, preempted in real)   # the case that matters is in it
    assert simulated == real


def test_a_pulled_request_waits_for_a_decode_seat():
    """1P1D, one decode seat: the second request's K/V is pulled while the first decodes (the
    scheduler parks it outside the seats), and it takes the seat in the step after the first
    finishes: its first token comes one decode step (11 ms) later, with no pull in between."""
    reqs = requests((0.0, 99, 30), (0.2, 99, 3))
    sim, res = simulate(reqs, Placement(prefill=1, decode=1), sp=spec(seats=1))
    first, second = res.results
    first_end = first.start_time + first.latency
    assert second.start_time + second.ttft == pytest.approx(first_end + 0.011)
