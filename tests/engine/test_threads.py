"""The CPU forward's thread count follows the machine (engine/threads.py): probes of a neighbouring
count, a switch when one is clearly faster in repeated probes, probes spaced to cost ~2%. The
step times here are given, not measured: nothing depends on this machine's speed or load."""
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine import threads
from pdserve.engine.threads import ThreadTuner

SHAPE = (32, 32)   # a decode step of 32 sequences


class Machine:
    """Step times by thread count, as a machine gives them: `busy` cores taken by a neighbour."""

    def __init__(self, busy: int = 0):
        self.busy, self.count, self.calls = busy, 2, []

    def set_threads(self, n):
        self.count = n
        self.calls.append(n)

    def step_time(self) -> float:
        if self.busy:   # two workers and one core taken: every barrier waits for a descheduled one
            return {1: 0.105, 2: 0.300}[self.count]
        return {1: 0.105, 2: 0.062}[self.count]


def run(tuner: ThreadTuner, machine: Machine, steps: int) -> float:
    """Steps of one shape; the time they took in all."""
    total = 0.0
    for _ in range(steps):
        tuner.before_step(SHAPE)
        t = machine.step_time()
        total += t
        tuner.after_step(SHAPE, t)
    return total


def test_a_quiet_machine_keeps_every_core_and_probes_cost_little():
    m = Machine()
    tuner = ThreadTuner(2, m.set_threads)
    total = run(tuner, m, 5000)
    assert tuner.current == 2 and tuner.num_changes == 0
    probes = m.calls.count(1)
    assert probes > 10    # it keeps looking
    extra = probes * (0.105 - 0.062)
    assert extra / total < 1.5 * threads.PROBE_SHARE
    assert m.count == 2   # every probe is undone


def test_a_busy_neighbour_moves_it_to_fewer_threads_and_back_when_it_leaves():
    m = Machine(busy=1)
    tuner = ThreadTuner(2, m.set_threads)
    run(tuner, m, 60)
    assert tuner.current == 1 and m.count == 1 and tuner.num_changes == 1
    run(tuner, m, 2000)
    assert tuner.current == 1   # probes of 2 threads keep losing
    m.busy = 0
    run(tuner, m, 200)
    assert tuner.current == 2 and m.count == 2 and tuner.num_changes == 2


def test_one_fast_probe_alone_does_not_switch():
    m = Machine()
    tuner = ThreadTuner(2, m.set_threads)
    for _ in range(threads.MIN_GAP - 1):
        tuner.before_step(SHAPE)
        tuner.after_step(SHAPE, 0.062)
    tuner.before_step(SHAPE)
    assert m.count == 1            # this step probes one thread ...
    tuner.after_step(SHAPE, 0.01)  # ... and happens to be fast once
    assert tuner.current == 2 and m.count == 2
    for _ in range(threads.MIN_GAP):
        tuner.before_step(SHAPE)
        tuner.after_step(SHAPE, 0.105 if m.count == 1 else 0.062)
    assert tuner.current == 2


def test_only_steps_of_a_known_shape_are_probed():
    m = Machine()
    tuner = ThreadTuner(2, m.set_threads)
    for i in range(100):   # every step a new shape: nothing to compare a probe with
        tuner.before_step((i, 1))
        tuner.after_step((i, 1), 0.05)
    assert m.calls == []


def test_the_engine_adapts_only_when_the_count_is_its_to_choose(tiny_llama, monkeypatch):
    import torch
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)   # as on a 2-core machine, whatever runs the test
    llm = LLM(tiny_llama, num_kv_blocks=64)
    tuner = llm.engine.threads
    assert tuner is not None and tuner.max_threads == 2
    seen = []
    monkeypatch.setattr(tuner, "before_step", lambda shape: seen.append(shape))
    monkeypatch.setattr(tuner, "after_step", lambda shape, t: seen.append(("done", shape)))
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert seen[:4] == [(4, 1), ("done", (4, 1)), (1, 1), ("done", (1, 1))]
    assert llm.engine.get_stats().cpu_threads == 2
    assert LLM(tiny_llama, num_kv_blocks=64, threads=2).engine.threads is None


def test_metrics_show_the_thread_count_and_its_changes():
    from prometheus_client import generate_latest
    from pdserve.engine.outputs import EngineStats
    from pdserve.server.metrics import ServerMetrics
    m = ServerMetrics()
    for threads_now, changes in ((2, 0), (1, 1), (1, 1)):
        m.record_step(None, EngineStats(0, 0, 10, 10, cpu_threads=threads_now, cpu_thread_changes=changes), [])
    text = generate_latest(m.registry).decode()
    assert 'pdserve:cpu_threads{model_name="pdserve"} 1.0' in text
    assert 'pdserve:cpu_thread_changes_total{model_name="pdserve"} 1.0' in text
