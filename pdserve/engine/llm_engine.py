"""The engine: admits requests, runs scheduler -> model runner -> sampler steps, and turns
sampled tokens into per-request outputs (detokenized, stop-checked, timed).

Not thread-safe: one thread calls add_request/abort_request/step (the server's engine loop)."""
import logging
import os
import time
from collections.abc import Callable

import torch

from pdserve import kernels
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.outputs import EngineStats, RequestOutput, StepStats
from pdserve.engine.profiler import StepProfiler
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.errors import RequestError
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger("pdserve.engine")


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
        self.model_config = ModelConfig.from_dir(model)
        self.tokenizer = Tokenizer.from_dir(model)
        self.model_name = os.path.basename(os.path.normpath(model))
        if self.config.device == "cpu":
            torch.set_num_threads(self.config.threads or len(os.sched_getaffinity(0)))
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        self.runner = ModelRunner(self.model_config, self.config, self.max_model_len, self.tokenizer.eos_token_ids)
        if self.config.device == "cpu":
            path = kernels.kernel_path() if self.runner.weight_format != "torch" else "torch ops"
            logger.info("CPU: %d threads, %s, weights %s", torch.get_num_threads(), path, self.runner.weight_format)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                   self.config.max_prefill_tokens_with_decodes)
        self.processor = OutputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self.last_step: StepStats | None = None
        self.last_schedule: SchedulerOutput | None = None   # the step's per-request tokens, for the live view
        self.profiler = StepProfiler(self.config.profile_steps) if self.config.profile_steps is not None else None
        # Fault injection, for tests only: called with each step's SchedulerOutput before the
        # forward. An Exception it raises fails that step's requests like a real failure; a
        # BaseException escapes step(), as a fatal error would (the server's loop dies).
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        seq = self.processor.new_sequence(request_id, prompt, params,
                                          time.perf_counter() if arrival_time is None else arrival_time)
        n, m = seq.num_prompt_tokens, params.max_tokens
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if n + m > capacity:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({m}) = {n + m} exceeds the whole KV cache "
                               f"({capacity} tokens)", param="max_tokens")
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Free everything the request holds; its final output comes from the next step()."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.finish(seq, "abort")
        seq.metrics.finished_time = time.perf_counter()
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def get_stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           self.block_manager.num_free_blocks, self.block_manager.num_blocks)

    def step(self) -> list[RequestOutput]:
        outputs = [self._finish(seq, None) for seq in self._aborted]
        self._aborted = []
        start = time.perf_counter()
        sched = None
        try:
            sched = self.scheduler.schedule(start)
            scheduled = time.perf_counter()
            if not sched.seqs:
                return outputs
            if self.fault_hook is not None:
                self.fault_hook(sched)
            sampled = self.runner.execute(sched)
            for seq, n in zip(sched.seqs, sched.num_tokens):
                seq.num_computed_tokens += n
            now = time.perf_counter()
            for seq, token, logprobs in sampled:
                self.processor.append_token(seq, token, logprobs, now)
                if seq.finish_reason is not None:
                    self.scheduler.finish(seq, seq.finish_reason)   # frees its blocks in this step
                    outputs.append(self._finish(seq, token))
                elif not seq.final_only:
                    outputs.append(self.processor.make_output(seq, [token]))
        except Exception:
            # Whatever failed (scheduling, forward, sampling, detokenizing, stop checks), only the
            # requests in this step fail; the engine keeps serving. If scheduling itself failed,
            # the step's requests are not known: the running ones are failed.
            failed = list(self.scheduler.running) if sched is None else sched.seqs
            logger.exception("engine step failed; failing its %d requests", len(failed))
            self._fail(failed, outputs)
            return outputs
        end = time.perf_counter()
        phases = {"schedule": scheduled - start, **self.runner.last_times}
        phases["output"] = end - start - sum(phases.values())
        self.last_step = StepStats(start, end - start, len(sched.seqs), sched.num_prefill_tokens,
                                   sched.num_decode_tokens, len(sched.preempted), self.runner.last_forward_time, phases)
        self.last_schedule = sched
        if self.profiler is not None:
            self.profiler.add(self.last_step)
        return outputs

    def _fail(self, seqs: list[Sequence], outputs: list[RequestOutput]) -> None:
        """Finish with "error" (blocks freed) each of `seqs` not already finished in this step.

        An exception in here (e.g. a block freed twice) leaves the engine inconsistent: it
        propagates, and the server's engine loop dies and reports it."""
        now = time.perf_counter()
        for seq in seqs:
            if seq.is_finished or seq.request_id not in self.seqs:
                continue
            self.scheduler.finish(seq, "error")
            seq.metrics.finished_time = now
            outputs.append(self._finish(seq, None))

    def _finish(self, seq: Sequence, token: int | None) -> RequestOutput:
        del self.seqs[seq.request_id]
        if seq.final_only:   # its only output: everything is new
            return self.processor.make_output(seq, seq.output_token_ids)
        return self.processor.make_output(seq, [] if token is None else [token])
