"""An exception anywhere inside one engine step fails only that step's requests, frees their
blocks, and the engine keeps serving; a BaseException escapes (the server treats it as fatal)."""
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from tests.helpers import finish_all

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class Crash(BaseException):
    pass


@pytest.fixture
def engine(tiny_llama):
    # two seats: requests c and d wait while a and b run
    e = LLMEngine(tiny_llama, max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=16, block_size=8)
    for rid in "abcd":
        e.add_request(rid, [5, 6, 7, 8, 9], PARAMS)
    return e


def assert_a_b_failed_c_d_served(engine, finals):
    assert {rid: o.finish_reason for rid, o in finals.items()} == {"a": "error", "b": "error",
                                                                  "c": "length", "d": "length"}
    assert [len(finals[r].token_ids) for r in "cd"] == [8, 8]
    assert not engine.seqs and not engine.scheduler.running and not engine.scheduler.waiting
    engine.block_manager.check_all_free()


def test_fault_hook_fails_the_step_it_raises_in(engine):
    steps = []

    def hook(sched):
        steps.append([s.request_id for s in sched.seqs])
        if len(steps) == 3:   # a decode step of a and b
            raise RuntimeError("injected")
    engine.fault_hook = hook
    finals = finish_all(engine)
    assert steps[2] == ["a", "b"]
    assert [len(finals[r].token_ids) for r in "ab"] == [2, 2]   # the tokens of the two steps before
    assert_a_b_failed_c_d_served(engine, finals)


def test_a_failure_in_output_processing(engine):
    real, calls = engine.processor.append_token, []

    def append_token(seq, *args):
        calls.append(seq.request_id)
        if len(calls) == 4:   # b's token of the second step, after a's was appended and output
            raise ValueError("detokenizer broke")
        return real(seq, *args)
    engine.processor.append_token = append_token
    finals = finish_all(engine)
    # one request's failure in output processing is its own: a, in the same step, goes on
    assert {rid: o.finish_reason for rid, o in finals.items()} == {"a": "length", "b": "error",
                                                                  "c": "length", "d": "length"}
    assert len(finals["b"].token_ids) == 1 and [len(finals[r].token_ids) for r in "acd"] == [8, 8, 8]
    engine.block_manager.check_all_free()


def test_a_failure_in_the_scheduler_fails_the_running(engine):
    real, calls = engine.scheduler.schedule, []

    def schedule(now):
        calls.append(now)
        out = real(now)   # blocks allocated, counters moved: then it breaks
        if len(calls) == 2:
            raise KeyError("scheduler bug")
        return out
    engine.scheduler.schedule = schedule
    assert_a_b_failed_c_d_served(engine, finish_all(engine))


def test_a_base_exception_escapes_the_step(engine):
    engine.fault_hook = lambda sched: (_ for _ in ()).throw(Crash())
    with pytest.raises(Crash):
        engine.step()
