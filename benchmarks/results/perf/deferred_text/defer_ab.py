"""Final-only text deferred (Sequence.defer_text) on and off by turns in one process (../step_ab.py),
tiny model. Usage: defer_ab.py BATCH ROUNDS STEPS"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from step_ab import decoding_engine, run  # noqa: E402

from pdserve.engine.output_processor import OutputProcessor  # noqa: E402

batch, rounds, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
engine = decoding_engine("pdserve/data/default-model", batch, True, rounds, steps)


def switch(v: bool) -> None:
    for seq in engine.scheduler.running:
        OutputProcessor.catch_up_text(seq)   # the text so far, so either path goes on from it
        seq.defer_text = v


run(engine, switch, rounds, steps)
