"""AsyncEngine against the fake engine: admission, sharing steps, aborts, failures. Fast unit
tests; the same behaviour through real HTTP and the real engine is in the other files."""
import asyncio

import pytest

from pdserve.errors import RequestError
from pdserve.sampling_params import SamplingParams
from pdserve.server.async_engine import AsyncEngine, EngineDead
from pdserve.server.errors import Overloaded
from pdserve.server.metrics import ServerMetrics
from tests.server.fake_engine import FakeEngine

M = {"model_name": "pdserve"}   # the label ServerMetrics puts on every series


def run(engine, coro_fn, max_waiting=8):
    async def main():
        ae = AsyncEngine(engine, max_waiting, ServerMetrics())
        ae.start()
        try:
            return await asyncio.wait_for(coro_fn(ae), 10)
        finally:
            ae.stop()
    return asyncio.run(main())


def test_concurrent_submissions_share_steps_and_finish():
    engine = FakeEngine(max_num_seqs=8)

    async def go(ae):
        subs = [await ae.submit([[1, 2, 3]], [SamplingParams(max_tokens=3 + i)], [f"r{i}"], 0.0) for i in range(6)]
        results = await asyncio.gather(*(s.collect() for s in subs))
        return [r[0] for r in results], ae.metrics
    results, metrics = run(engine, go)
    assert [r.text for r in results] == ["abcdefgh"[:3 + i] for i in range(6)]
    assert [len(r.token_ids) for r in results] == [3 + i for i in range(6)]
    seqs = metrics.registry.get_sample_value("pdserve:step_num_seqs_bucket", {**M, "le": "1.0"})
    assert metrics.registry.get_sample_value("pdserve:step_num_seqs_count", M) > seqs   # steps with > 1 sequence
    assert metrics.registry.get_sample_value("pdserve:request_success_total", {**M, "finished_reason": "length"}) == 6


def test_cancel_aborts_the_unfinished():
    engine = FakeEngine()

    async def go(ae):
        sub = await ae.submit([[1], [2]], [SamplingParams(max_tokens=50), SamplingParams(max_tokens=50)],
                              ["a", "b"], 0.0)
        outs = sub.outputs()
        await outs.__anext__()
        sub.cancel()
        while ae.metrics.registry.get_sample_value("pdserve:kv_cache_usage_perc", M) > 0 or ae.num_waiting:
            await asyncio.sleep(0.01)
        return ae.metrics
    metrics = run(engine, go)
    assert metrics.registry.get_sample_value("pdserve:request_success_total", {**M, "finished_reason": "abort"}) == 2


def test_a_group_is_admitted_all_or_none():
    engine = FakeEngine(max_model_len=20)

    async def go(ae):
        with pytest.raises(RequestError) as e:
            await ae.submit([[1], [1] * 19], [SamplingParams(max_tokens=5)] * 2, ["ok", "too-long"], 0.0)
        assert e.value.param == "max_tokens"
        while ae.engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        assert ae.num_waiting == 0
    run(engine, go)
    assert engine.all_ids == ["ok"] and engine.num_steps >= 1   # added, then aborted by the rollback


def test_waiting_queue_bound_and_shutdown_refuse_immediately():
    engine = FakeEngine(max_num_seqs=1, step_time=0.01, max_model_len=2000)

    async def go(ae):
        running = await ae.submit([[1]], [SamplingParams(max_tokens=1000)], ["run"], 0.0)
        await running.outputs().__anext__()   # it is running: the waiting queue is empty
        waiting = await ae.submit([[1], [2]], [SamplingParams(max_tokens=5)] * 2, ["w1", "w2"], 0.0)
        with pytest.raises(Overloaded) as e:
            await ae.submit([[3]], [SamplingParams(max_tokens=5)], ["w3"], 0.0)
        assert e.value.status == 503 and e.value.code == "queue_full" and e.value.headers == {"Retry-After": "1"}
        ae.accepting = False
        with pytest.raises(Overloaded) as e:
            await ae.submit([[3]], [SamplingParams(max_tokens=5)], ["w4"], 0.0)
        assert e.value.code == "shutting_down"
        running.cancel()
        waiting.cancel()
    run(engine, go, max_waiting=2)


def test_engine_failure_fails_requests_and_health():
    engine = FakeEngine(fail_at_step=3)

    async def go(ae):
        sub = await ae.submit([[1]], [SamplingParams(max_tokens=50)], ["x"], 0.0)
        with pytest.raises(EngineDead):
            await sub.collect()
        await asyncio.sleep(0.05)
        assert not ae.alive and isinstance(ae.error, RuntimeError)
        with pytest.raises(EngineDead):
            await ae.submit([[1]], [SamplingParams()], ["y"], 0.0)
    run(engine, go)
