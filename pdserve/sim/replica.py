"""One simulated engine: pdserve's own LLMEngine (LLMEngine.from_parts) around a timed runner
stand-in (runner.py) and, for a prefill or decode worker, a simulated KV connector
(connector.py), stepped on the simulator's clock.

The engine loop as the server runs it: a step starts when the replica is idle and something
arrives, a pull ends or a lease is freed, and again at once after each step while the engine
has unfinished work. LLMEngine.step runs whole at the step's start (schedule, the runner's
forward, outputs), its clock reading the step's end after the forward; the outputs reach the
clients at the end. Requests that arrive during a step join the next one."""
import dataclasses
from collections.abc import Callable

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.errors import RequestError
from pdserve.sampling_params import SamplingParams
from pdserve.sim.connector import SimConnector
from pdserve.sim.events import EventLoop
from pdserve.sim.runner import PlaceholderTokenizer, StepClock, TimedRunner


def sim_model_config(cfg: EngineConfig, vocab_size: int, max_model_len: int) -> ModelConfig:
    """What the engine reads of a model around a runner stand-in: its vocabulary and served length."""
    return ModelConfig(path=cfg.model, architecture="simulated", vocab_size=vocab_size, hidden_size=0, num_layers=0,
                       num_heads=0, num_kv_heads=0, head_dim=0, intermediate_size=0,
                       max_position_embeddings=max_model_len, tie_word_embeddings=False, torch_dtype=None, raw={},
                       max_model_len=max_model_len)


class Replica:
    def __init__(self, loop: EventLoop, name: str, cfg: EngineConfig, step_time, num_blocks: int, max_model_len: int,
                 vocab_size: int, on_output: Callable, role: str = "both", kv_bytes_per_token: int = 0,
                 pull_seconds: Callable[[int], float] | None = None, pulled: Callable | None = None):
        """on_output(replica, output, now): a request's final output (RequestOutput) reached its
        client; role prefill or decode: a P/D worker with a simulated connector, whose pulls take
        pull_seconds(tokens) and end a lease through pulled(kv_transfer_params)."""
        self.loop, self.name, self.on_output = loop, name, on_output
        self.clock = StepClock(loop)
        runner = TimedRunner(step_time, self.clock, num_blocks, cfg.block_size, kv_bytes_per_token, vocab_size)
        self.connector = None
        if role != "both":
            cfg = dataclasses.replace(cfg, role=role, kv_transfer_secret="simulated")
            self.connector = SimConnector(role, loop, name, cfg.block_size, self._kick, pull_seconds, pulled)
        self.engine = LLMEngine.from_parts(cfg, sim_model_config(cfg, vocab_size, max_model_len),
                                           PlaceholderTokenizer(), runner, self.connector, self.clock)
        self.clock.settle()   # the slo policy's start-up calibration ran steps on it
        self.busy = False
        self.in_flight = 0   # requests added and not yet answered
        self.num_steps = 0
        self.busy_time = 0.0
        self.num_preemptions = 0

    @property
    def load(self) -> int:
        return self.in_flight

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> str | None:
        """Hand a request to the engine now; the refusal's message, if it refuses (the server's 400)."""
        try:
            self.engine.add_request(request_id, prompt, params, arrival_time=self.loop.now)
        except RequestError as e:
            return str(e)
        self.in_flight += 1
        self._kick()
        return None

    def _kick(self) -> None:
        """Run steps as the engine loop does while the engine has work: one that runs a forward
        ends later (_step_done); one that runs none but changed the scheduler's state (it
        preempted, parked a pull, freed a lease) is followed by another at once; otherwise the
        replica idles until something arrives or a pull ends."""
        while not self.busy and self.engine.has_unfinished_requests():
            start, before = self.loop.now, self._state()
            outputs = self.engine.step()
            end = self.clock.settle()
            if end is not None:
                self.busy = True
                self.num_steps += 1
                self.busy_time += end - start
                self.loop.at(end, self._step_done, outputs)
                return
            self._deliver(outputs)
            if not outputs and self._state() == before:
                return

    def _state(self) -> tuple:
        s = self.engine.scheduler
        return len(s.waiting), len(s.running), len(s.loading), self.engine.block_manager.num_free_blocks

    def _step_done(self, outputs: list[RequestOutput]) -> None:
        self.busy = False
        self._deliver(outputs)
        self._kick()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.in_flight -= 1
                self.num_preemptions += out.metrics.num_preemptions
                self.on_output(self, out, self.loop.now)
