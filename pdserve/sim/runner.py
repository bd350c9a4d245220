"""What stands in for the model in a simulated engine: a timed ModelRunner, its clock, and a
tokenizer that makes no text. Everything else in a simulated replica is pdserve's own LLMEngine
(LLMEngine.from_parts): its scheduling, step, KV-connector and output code run as they are.

The runner's execute() samples for the sequences the real ModelRunner samples for (those whose
scheduled tokens reach their end), a placeholder id each, and moves the replica's clock on by the
step-time model's duration of the step, so every time the engine stamps after the forward (first
token, token times, finish) is the step's end."""
from types import SimpleNamespace

import torch

from pdserve.engine.scheduler import SchedulerOutput
from pdserve.sim.events import EventLoop


class StepClock:
    """A replica's clock: the event loop's time, but inside a step the step's end once the
    runner has run (the engine reads it for its timestamps)."""

    def __init__(self, loop: EventLoop):
        self.loop = loop
        self.step_end: float | None = None

    def __call__(self) -> float:
        return self.loop.now if self.step_end is None else self.step_end

    def advance(self, seconds: float) -> None:
        self.step_end = self() + seconds

    def settle(self) -> float | None:
        """The end of the step just run (None: no forward ran); the clock follows the loop again."""
        end, self.step_end = self.step_end, None
        return end


class TimedRunner:
    """A ModelRunner stand-in: no model, no cache tensor; a step costs step_time(sched) seconds."""
    kv_cache_file = None

    def __init__(self, step_time, clock: StepClock, num_blocks: int, block_size: int, kv_bytes_per_token: int,
                 vocab_size: int):
        self.step_time, self.clock = step_time, clock
        self.num_blocks, self.block_size = num_blocks, block_size
        self.bytes_per_block = kv_bytes_per_token * block_size
        self.dtype = torch.float32   # names the cache's blocks (prefix-cache namespace, KV dtype): not a size
        self.vocab_size = vocab_size
        self.sampler = SimpleNamespace(grammars=None)   # the engine hands its grammars to the sampler
        self.last_forward_time = 0.0
        self.last_times: dict[str, float] = {}
        self._token = 0

    def execute(self, sched: SchedulerOutput) -> list:
        seconds = self.step_time(sched)   # before mark_computed: the contexts the step starts from
        self.clock.advance(seconds)
        sampled = []
        for seq, n in zip(sched.seqs, sched.num_tokens):
            if seq.num_computed_tokens + n == seq.num_tokens:   # all its tokens cached after this step
                self._token = (self._token + 1) % self.vocab_size
                sampled.append((seq, self._token, None))
        self.last_forward_time = seconds
        self.last_times = {"forward": seconds}
        return sampled


class _NoBytes(dict):
    def __missing__(self, token_id: int) -> bytes:
        return b""


class PlaceholderTokenizer:
    """The engine's tokenizer where there is no text: prompts are ids, outputs make no characters
    (detokenizing is not modelled beyond what the step-time model saw), no EOS (outputs run to
    their max_tokens)."""
    eos_token_ids: list[int] = []

    def byte_pieces(self, skip_special_tokens: bool = True) -> dict:
        return _NoBytes()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""
