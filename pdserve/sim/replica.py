"""One simulated engine: pdserve's own Scheduler, BlockManager and policy over real Sequences,
stepped on the simulator's clock, with the forward replaced by a step-time model.

A step mirrors LLMEngine.step: schedule at the step's start (requests that arrived during the
previous step join here), take the step-time model's duration, then mark the scheduled tokens
computed, and every sequence whose tokens are all cached samples one token (a placeholder id:
outputs run to their max_tokens, as with ignore_eos). A finished sequence frees its blocks in
the same step. The engine loop starts the next step at once while anything is unfinished."""
from collections import deque
from collections.abc import Callable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.cost_model import StepCostModel, calibration_shapes, step_features
from pdserve.engine.policy import make_policy
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.sampling_params import SamplingParams
from pdserve.sim.events import EventLoop


def policy_cost_model(step_time, cfg, max_model_len: int) -> StepCostModel:
    """The slo policy's step-time model: the fitted one itself, or one fitted on the datasheet
    model's times of the shapes the engine calibrates on at start-up."""
    model = getattr(step_time, "model", None)
    if model is not None:
        return model
    model, params = StepCostModel(), SamplingParams(max_tokens=1)
    for num_tokens, contexts in calibration_shapes(cfg.max_num_batched_tokens, cfg.max_num_seqs, max_model_len):
        out = SchedulerOutput()
        for i, (n, c) in enumerate(zip(num_tokens, contexts)):
            seq = Sequence("calibration", [0] * (c + n), params, 0.0)
            seq.num_computed_tokens = c
            out.add(seq, n, n > 1)
        model.add_calibration(step_features(num_tokens, contexts), step_time(out))
    model.fit()
    return model


class Replica:
    def __init__(self, loop: EventLoop, name: str, cfg, step_time: Callable[[SchedulerOutput], float],
                 num_blocks: int, max_model_len: int, vocab_size: int, on_finish: Callable):
        """cfg: an EngineConfig (the fields the scheduler reads); on_finish(replica, seq, now) is
        called once a sequence is done."""
        self.loop, self.name, self.cfg, self.step_time = loop, name, cfg, step_time
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        cost = policy_cost_model(step_time, cfg, max_model_len) if cfg.scheduling_policy == "slo" else None
        policy = make_policy(cfg.scheduling_policy, cost, cfg.max_num_batched_tokens, cfg.slo_admission)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                   cfg.max_prefill_tokens_with_decodes, policy)
        self.vocab_size = vocab_size
        self.on_finish = on_finish
        self.busy = False
        self.hold_kv = False       # a prefill worker: a finished sequence keeps its blocks (a lease)
        self.remote: deque = deque()   # waiting for blocks to load K/V into
        self.loading = 0
        self.num_steps = 0
        self.busy_time = 0.0
        self.num_preemptions = 0
        self._token = 0

    @property
    def load(self) -> int:
        s = self.scheduler
        return len(s.waiting) + len(s.running) + len(self.remote) + self.loading

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self._kick()

    def add_remote(self, seq: Sequence, transfer_s: float, on_loaded: Callable[[], None]) -> None:
        """A request whose prompt a prefill worker computed (docs/SIMULATOR.md): it takes blocks
        for its prompt and a seat, waits transfer_s while the K/V of all but its last prompt token
        arrive, then joins the running sequences with that last token to compute itself (and
        on_loaded() is called: the prefill worker may free them)."""
        self.remote.append((seq, transfer_s, on_loaded))
        self._admit_remote()

    def release(self, seq: Sequence) -> None:
        """End the lease on a finished prefill's blocks."""
        self.block_manager.free(seq)
        self._admit_remote()
        self._kick()

    def _admit_remote(self) -> None:
        bm, cfg = self.block_manager, self.cfg
        while self.remote and len(self.scheduler.running) + self.loading < cfg.max_num_seqs:
            seq, transfer_s, on_loaded = self.remote[0]
            if not bm.try_allocate(seq, seq.num_tokens):
                break
            self.remote.popleft()
            self.loading += 1
            self.loop.at(self.loop.now + transfer_s, self._loaded, seq, on_loaded)

    def _loaded(self, seq: Sequence, on_loaded: Callable[[], None]) -> None:
        self.loading -= 1
        on_loaded()
        seq.status = SequenceStatus.RUNNING
        seq.prefill_len = seq.num_tokens
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.metrics.first_scheduled_time = self.loop.now
        self.scheduler.running.append(seq)
        self._kick()

    def _kick(self) -> None:
        if self.busy or not self.scheduler.has_unfinished():
            return
        now = self.loop.now
        out = self.scheduler.schedule(now)
        self.num_preemptions += len(out.preempted)
        if not out.seqs:   # nothing fits now: a finish, a release or an arrival kicks again
            return
        self.busy = True
        duration = self.step_time(out)
        self.num_steps += 1
        self.busy_time += duration
        self.loop.at(now + duration, self._step_done, out)

    def _step_done(self, out: SchedulerOutput) -> None:
        now = self.loop.now
        self.scheduler.mark_computed(out)
        for seq in out.seqs:
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != seq.num_tokens:
                continue
            self._token = (self._token + 1) % self.vocab_size
            seq.token_ids.append(self._token)
            m = seq.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            if seq.num_output_tokens >= seq.params.max_tokens:
                m.finished_time = now
                if self.hold_kv:
                    self.scheduler.running.remove(seq)
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
                else:
                    self.scheduler.finish(seq, "length")
                self.on_finish(self, seq, now)
        self.busy = False
        self._admit_remote()
        self._kick()
