"""What watches the engine's steps without being part of one: the step-time model, the CPU thread
tuner and the profiler. Each is a StepHook that LLMEngine.step calls at three named points, so
the step itself reads schedule -> execute -> process, and a new watcher is one more hook."""
from pdserve.engine.cost_model import StepCostModel, step_features
from pdserve.engine.outputs import StepStats
from pdserve.engine.profiler import StepProfiler
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.threads import ThreadTuner


class StepHook:
    def before_forward(self, sched: SchedulerOutput) -> None:
        """The step is scheduled; its forward is next (num_computed_tokens not yet advanced)."""

    def after_forward(self, sched: SchedulerOutput, seconds: float) -> None:
        """The forward (model and sampling) ran in `seconds`, or failed."""

    def after_step(self, sched: SchedulerOutput, stats: StepStats) -> None:
        """The step succeeded: its outputs are made and its times known."""


class CostModelHook(StepHook):
    """Refits the step-time model (engine/cost_model.py) from every step's wall time."""

    def __init__(self, model: StepCostModel):
        self.model, self.features = model, None

    def before_forward(self, sched):
        self.features = step_features(sched.num_tokens, [seq.num_computed_tokens for seq in sched.seqs])

    def after_step(self, sched, stats):
        self.model.observe(self.features, stats.duration)


class ThreadHook(StepHook):
    """Gives the thread tuner (engine/threads.py) each forward's shape and time."""

    def __init__(self, tuner: ThreadTuner):
        self.tuner, self.shape = tuner, None

    def before_forward(self, sched):
        self.shape = (sched.num_prefill_tokens + sched.num_decode_tokens, len(sched.seqs))
        self.tuner.before_step(self.shape)

    def after_forward(self, sched, seconds):
        self.tuner.after_step(self.shape, seconds)


class ProfilerHook(StepHook):
    def __init__(self, profiler: StepProfiler):
        self.profiler = profiler

    def after_step(self, sched, stats):
        self.profiler.add(stats)
