"""The engine-step A/B loop that fused_argmax/, deferred_text/ and step_metadata/ share: decode
steps of B requests (prompt 128 ids), a switch between two variants of the code by turns in one
process (the order reversed every other round); prints each variant's median step and overhead
(engine.step() minus the runner's forward) and on / off per round.

Their result files were printed by earlier copies of this loop: the same numbers, other labels
("fused=True", "defer=True", "now"), and defer_ab.txt without the step columns."""
import statistics
import time

from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams


def decoding_engine(model: str, batch: int, final_only: bool, rounds: int, steps: int) -> LLMEngine:
    """An engine whose `batch` requests are all decoding, with tokens left for every round."""
    engine = LLMEngine(model, max_model_len=2048)
    params = SamplingParams(max_tokens=rounds * (2 * steps + 2) + 50, temperature=0, ignore_eos=True,
                            final_only=final_only)
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(100, 228)), params)
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    return engine


def run(engine: LLMEngine, switch, rounds: int, steps: int) -> None:
    """switch(True) selects the variant under test, switch(False) the one it is measured against."""
    res = {True: ([], []), False: ([], [])}
    r_step, r_ovh = [], []
    for r in range(rounds):
        per = {}
        for v in ((True, False) if r % 2 == 0 else (False, True)):
            switch(v)
            engine.step()   # the first step after a switch is not timed
            st, ov = [], []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                t = time.perf_counter() - t0
                st.append(t)
                ov.append(t - engine.runner.last_forward_time)
            per[v] = (statistics.median(st), statistics.median(ov))
            res[v][0].append(per[v][0])
            res[v][1].append(per[v][1])
        r_step.append(per[True][0] / per[False][0])
        r_ovh.append(per[True][1] / per[False][1])
    for v in (False, True):
        print(f"{'on' if v else 'off'}: step {statistics.median(res[v][0]) * 1e3:.3f} ms, "
              f"overhead {statistics.median(res[v][1]) * 1e3:.3f} ms")
    print("on/off step per round", " ".join(f"{x:.3f}" for x in r_step), "median", f"{statistics.median(r_step):.3f}")
    print("on/off overhead per round", " ".join(f"{x:.3f}" for x in r_ovh), "median", f"{statistics.median(r_ovh):.3f}")
