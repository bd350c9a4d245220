"""The lm_head's screened argmax on and off by turns in one process (../step_ab.py): whole engine
steps of BATCH decoding requests, `lm_head.use_screen` switched.
Usage: screen_ab.py MODEL BATCH final|stream ROUNDS STEPS"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from step_ab import decoding_engine, run  # noqa: E402

model, batch, kind, rounds, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
engine = decoding_engine(model, batch, kind == "final", rounds, steps)
lm_head = engine.runner.model.lm_head
assert lm_head.screen is not None, "no screen on this model's lm_head"
run(engine, lambda v: setattr(lm_head, "use_screen", v), rounds, steps)
