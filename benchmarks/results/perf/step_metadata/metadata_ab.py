"""The step's metadata functions before (attention_before.py.txt: build_metadata and kernel_step as
of 7e6543b) and now, swapped by turns in one process: engine.step() overhead and whole step, tiny
model, decode batch B (../step_ab.py). Usage: metadata_ab.py MODEL B final|stream ROUNDS STEPS"""
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from step_ab import decoding_engine, run  # noqa: E402

import pdserve.engine.model_runner as runner_mod  # noqa: E402
import pdserve.layers.attention as new_mod  # noqa: E402
import pdserve.models.llama as llama_mod  # noqa: E402

old_mod = types.ModuleType("attention_before")
src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_before.py.txt")).read()
exec(compile(src, "attention_before.py", "exec"), old_mod.__dict__)


def use(new: bool):
    m = new_mod if new else old_mod
    runner_mod.build_metadata = m.build_metadata
    llama_mod.kernel_step = m.kernel_step
    # the metadata objects must be the classes the chosen functions build
    llama_mod.get_attention_metadata = m.get_attention_metadata
    runner_mod.attention_context = m.attention_context


model, batch, kind, rounds, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
engine = decoding_engine(model, batch, kind == "final", rounds, steps)
run(engine, use, rounds, steps)
