"""--profile-steps: every engine step's time is split into phases that add up to the step."""
import logging

from pdserve import LLM, SamplingParams
from pdserve.engine.profiler import PHASES, summarize


def test_phases_add_up_and_summary_counts_every_step(tiny_llama, caplog):
    llm = LLM(tiny_llama, profile_steps=3, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="pdserve.engine"):
        llm.generate(["one two three four five six seven eight nine ten eleven twelve thirteen", "hi"], params)
    steps = llm.engine.profiler.steps
    # a 16-token budget: the longer prompt is chunked, so there are prefill and decode steps
    assert any(s.num_prefill_tokens for s in steps) and any(s.num_decode_tokens for s in steps)
    for s in steps:
        assert set(s.phases) == set(PHASES)
        assert all(v >= 0 for v in s.phases.values())
        assert abs(sum(s.phases.values()) - s.duration) < 1e-6
        assert s.phases["forward"] == s.forward_time > 0
    summary = summarize(steps)
    assert summary["steps"] == len(steps)
    assert abs(summary["mean_overhead_ms"] - 1e3 * sum(s.duration - s.forward_time for s in steps) / len(steps)) < 1e-6
    logged = [r for r in caplog.records if "step profile" in r.getMessage()]
    assert len(logged) == len(steps) // 3


def test_off_by_default(tiny_llama):
    llm = LLM(tiny_llama)
    llm.generate(["hello"], SamplingParams(max_tokens=2))
    assert llm.engine.profiler is None and llm.engine.last_step.phases   # phases are always timed


def test_history_is_bounded_for_long_running_servers():
    from pdserve.engine.outputs import StepStats
    from pdserve.engine.profiler import KEEP_STEPS, StepProfiler
    prof = StepProfiler(log_every=7)
    phases = dict.fromkeys(PHASES, 0.001)
    for i in range(KEEP_STEPS + 50):
        prof.add(StepStats(float(i), 0.005, 1, 0, 1, 0, 0.001, phases))
    assert len(prof.steps) == KEEP_STEPS and prof.steps[0].start_time == 50.0
    assert prof.summary()["steps"] == KEEP_STEPS and len(prof._window) == (KEEP_STEPS + 50) % 7
