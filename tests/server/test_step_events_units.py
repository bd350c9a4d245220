"""StepEvents without a model: the ring, history, a subscriber that falls behind, close, and a
publish that fails without stopping the engine."""
import asyncio
import contextlib
import json

from pdserve.engine.outputs import EngineStats, RequestMetrics, StepStats
from pdserve.server.step_events import StepEvents


class Engine:
    """What publish() reads: last_step, and no live requests."""
    def __init__(self):
        self.last_step, self.seqs = None, {}

    def step(self, i: int) -> None:
        self.last_step = StepStats(start_time=float(i), duration=0.01, num_seqs=1, num_prefill_tokens=i,
                                   num_decode_tokens=1, num_preemptions=0, forward_time=0.008)


STATS = EngineStats(num_running=1, num_waiting=2, num_free_blocks=6, num_total_blocks=8)


def parse(text: str) -> list[dict]:
    """The data of each `step` event in SSE text."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if not line.startswith(":"))
        if lines.get("event") == "step":
            data = json.loads(lines["data"])
            assert int(lines["id"]) == data["seq"]
            out.append(data)
    return out


def run(coro):
    return asyncio.run(coro)


def test_a_subscriber_gets_history_then_new_steps_and_skips_what_it_fell_behind_on():
    async def main():
        events, engine = StepEvents(ring_size=8), Engine()
        events.start(asyncio.get_running_loop())
        for i in range(5):   # nobody watching: aggregates only
            engine.step(i)
            events.publish(engine, STATS, [])
        sub = events.subscribe(history=3, greeting="event: config\ndata: {}\n\n")
        assert (await anext(sub)).startswith("event: config")
        first = parse(await anext(sub))
        assert [e["seq"] for e in first] == [2, 3, 4]
        assert first[0]["requests"] is None and first[0]["step"]["prefill_tokens"] == 2
        assert first[0]["running"] == 1 and first[0]["waiting"] == 2 and first[0]["kv_cache_usage"] == 0.25
        # the subscriber does not read while 20 steps happen: the ring keeps the last 8
        for i in range(5, 25):
            engine.step(i)
            events.publish(engine, STATS, [])
        await asyncio.sleep(0)
        late = parse(await anext(sub))
        assert [e["seq"] for e in late] == list(range(17, 25))   # 5..16 skipped: a gap in seq
        assert late[0]["requests"] == []   # watched: per-request detail (no live requests here)
        # a step object seen before is not published again (a step that only delivered aborts)
        events.publish(engine, STATS, [])
        events.close()

        async def rest():
            return [chunk async for chunk in sub]
        assert await asyncio.wait_for(rest(), 10) == []   # the stream ends
        assert events.num_subscribers == 0
    run(main())


def test_a_request_that_ended_without_a_step_is_published():
    class Out:
        request_id, finished, finish_reason, prompt_token_ids = "cmpl-1-0", True, "abort", [1, 2, 3]
        metrics = RequestMetrics(arrival_time=0.0)

    async def main():
        events, engine = StepEvents(), Engine()
        events.start(asyncio.get_running_loop())
        sub = events.subscribe()
        waiting = asyncio.ensure_future(anext(sub))
        await asyncio.sleep(0)
        events.publish(engine, STATS, [Out()])   # an abort: no forward ran
        (event,) = parse(await asyncio.wait_for(waiting, 5))
        assert event["step"] is None
        assert event["requests"] == [{"id": "cmpl-1-0", "state": "finished", "finish_reason": "abort",
                                      "step_tokens": 0, "step_prefill": False, "prompt_tokens": 3,
                                      "output_tokens": 0, "preemptions": 0, "ttft_s": None, "tpot_s": None}]
        await sub.aclose()
    run(main())


def test_a_failing_publish_is_logged_not_raised(caplog):
    class Broken(Engine):
        @property
        def seqs(self):
            raise RuntimeError("boom")

        @seqs.setter
        def seqs(self, value):
            pass

    async def main():
        events, engine = StepEvents(), Broken()
        events.start(asyncio.get_running_loop())
        sub = events.subscribe()
        waiting = asyncio.ensure_future(anext(sub))
        await asyncio.sleep(0)
        engine.step(1)
        events.publish(engine, STATS, [])   # must not raise into the engine loop
        engine.step(2)
        events.publish(engine, STATS, [])
        waiting.cancel()   # the stream's client left
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert events.num_subscribers == 0
    run(main())
    assert caplog.text.count("publishing an engine step event failed") == 1
