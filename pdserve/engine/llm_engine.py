"""The engine: admits requests, runs scheduler -> model runner -> sampler steps, and turns
sampled tokens into per-request outputs (detokenized, stop-checked, timed).

Not thread-safe: one thread calls add_request/abort_request/step (the server's engine loop)."""
import logging
import os
import time
from collections.abc import Callable

import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.cost_model import StepCostModel, calibrate, calibration_shapes
from pdserve.engine.grammar import GrammarFailed
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.outputs import EngineStats, RequestOutput, StepStats
from pdserve.engine.policy import make_policy
from pdserve.engine.profiler import StepProfiler
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_hooks import CostModelHook, ProfilerHook, ThreadHook
from pdserve.engine.threads import ThreadTuner
from pdserve.errors import RequestError, SLOUnattainable
from pdserve.quantization import check_requested
from pdserve.kv_transfer import make_connector
from pdserve.sampling_params import SamplingParams
from pdserve.spec_decode.speculator import make_speculator
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger("pdserve.engine")
# a step with nothing to run waits this long at most for a KV pull to end or a lease to be released
IDLE_WAIT_S = 0.01


class LLMEngine:
    """A PagedEngine (engine/interface.py says what its users may call)."""
    name = "engine"
    computes_prompt_logprobs = True   # SamplingParams.prompt_logprobs (the server asks before it admits)

    def __init__(self, model: str, **kwargs):
        config = EngineConfig(model=model, **kwargs)
        model_config = ModelConfig.from_dir(model)
        check_requested(model_config.quantization, config.quantization)
        tokenizer = Tokenizer.from_dir(model)
        if config.device == "cpu":
            torch.set_num_threads(config.threads or len(os.sched_getaffinity(0)))
        limit = model_config.max_position_embeddings
        model_config.max_model_len = min(config.max_model_len or limit, limit)   # the served length longrope follows
        runner = ModelRunner(model_config, config, model_config.max_model_len, tokenizer.eos_token_ids)
        # with no --threads the count follows the machine: fewer while other work takes cores (threads.py)
        threads = None
        if config.device == "cpu" and config.threads is None and torch.get_num_threads() > 1:
            threads = ThreadTuner(torch.get_num_threads(), torch.set_num_threads)
        if config.device == "cpu":
            logger.info("CPU: %d threads%s; %s", torch.get_num_threads(),
                        " (fewer while other work takes the cores)" if threads else "", runner.backend.describe())
        else:
            logger.info("%s", runner.backend.describe())
        self._assemble(config, model_config, tokenizer, runner, threads=threads)

    @classmethod
    def from_parts(cls, config: EngineConfig, model_config: ModelConfig, tokenizer, runner, connector=None,
                   clock: Callable[[], float] = time.perf_counter) -> "LLMEngine":
        """An engine around parts made elsewhere instead of loaded (the simulator's: a runner
        stand-in whose execute() advances `clock` by a step-time model, and a simulated KV
        connector); model_config.max_model_len is the served length. The scheduling, step and
        output code is this class's own."""
        engine = cls.__new__(cls)
        engine._assemble(config, model_config, tokenizer, runner, connector, clock)
        return engine

    def _assemble(self, config: EngineConfig, model_config: ModelConfig, tokenizer, runner, connector=None,
                  clock: Callable[[], float] = time.perf_counter, threads: ThreadTuner | None = None) -> None:
        """Everything around the runner: cache blocks, policy, scheduler, KV connector, outputs, hooks."""
        self.config, self.model_config, self.tokenizer, self.runner = config, model_config, tokenizer, runner
        self.clock = clock   # every timestamp of a request's life and a step's (time.perf_counter seconds)
        self.threads = threads
        self.model_name = os.path.basename(os.path.normpath(config.model))
        self.max_model_len = model_config.max_model_len
        c = self.config
        # the cache namespace: besides tokens and cache_salt, what makes a block's K/V what it is
        namespace = (str(self.runner.dtype), c.quantization)
        self.block_manager = BlockManager(self.runner.num_blocks, c.block_size, c.enable_prefix_caching, namespace)
        # the step-time model the slo policy schedules by, and speculation turns itself down by:
        # fitted here, refitted from every step
        spec = c.speculative()
        self.cost_model = StepCostModel() if c.scheduling_policy == "slo" or spec is not None else None
        if self.cost_model is not None:
            self.calibrate_cost_model()
        self.speculator = None if spec is None else make_speculator(spec, self)
        policy = make_policy(c.scheduling_policy, self.cost_model, c.max_num_batched_tokens, c.slo_admission)
        # prefill/decode roles: the KV connector (None with --role both)
        self.kv_dtype = str(self.runner.dtype).removeprefix("torch.")
        self.connector = connector if connector is not None else make_connector(c, self.runner, self.kv_dtype)
        self.scheduler = Scheduler(self.block_manager, c.max_num_batched_tokens, c.max_num_seqs,
                                   c.max_prefill_tokens_with_decodes, policy, self.connector)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB); prefix caching %s", self.runner.num_blocks,
                    c.block_size, self.runner.num_blocks * self.runner.bytes_per_block / 2**20,
                    "on" if c.enable_prefix_caching else "off")
        self.processor = OutputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.runner.sampler.grammars = self.processor.grammars
        self.seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self.last_step: StepStats | None = None
        self.last_schedule: SchedulerOutput | None = None   # the step's per-request tokens, for the live view
        self.profiler = StepProfiler(self.config.profile_steps) if self.config.profile_steps is not None else None
        # what watches the steps (step_hooks.py): the step-time model refit, the thread count, the profile
        self.hooks = ([CostModelHook(self.cost_model)] if self.cost_model is not None else []) + \
                     ([ThreadHook(self.threads)] if self.threads is not None else []) + \
                     ([ProfilerHook(self.profiler)] if self.profiler is not None else [])
        # Fault injection, for tests only: called with each step's SchedulerOutput before the
        # forward. An Exception it raises fails that step's requests like a real failure; a
        # BaseException escapes step(), as a fatal error would (the server's loop dies).
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        seq = self.processor.new_sequence(request_id, prompt, params,
                                          self.clock() if arrival_time is None else arrival_time)
        n, m = seq.num_prompt_tokens, params.max_tokens
        capacity = self.kv_capacity
        if n + m > capacity:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({m}) = {n + m} exceeds the whole KV cache "
                               f"({capacity} tokens)", param="max_tokens")
        obj, c = params.objectives, self.config
        ttft_ms = obj.ttft_ms if obj is not None and obj.ttft_ms is not None else c.slo_ttft_ms
        tpot_ms = obj.tpot_ms if obj is not None and obj.tpot_ms is not None else c.slo_tpot_ms
        seq.metrics.ttft_target = None if ttft_ms is None else ttft_ms / 1e3
        seq.metrics.tpot_target = None if tpot_ms is None else tpot_ms / 1e3
        kv = params.kv_transfer_params
        if kv is not None and kv.active:
            self._check_kv_transfer(seq, kv)
        why = self.scheduler.policy.refuse(seq, self.scheduler, self.clock())
        if why is not None:
            if seq.kv_transfer is not None:   # refused here: the prefill worker need not keep its KV
                self.connector.discard(seq)
            raise SLOUnattainable(why)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _check_kv_transfer(self, seq: Sequence, kv) -> None:
        role = self.config.role
        if kv.do_remote_decode and role != "prefill":
            raise RequestError(f"kv_transfer_params.do_remote_decode needs a --role prefill worker; this one is "
                               f"--role {role}", param="kv_transfer_params.do_remote_decode")
        if kv.do_remote_decode and not kv.decode_engine_id:   # the lease is for that decode worker only
            raise RequestError("kv_transfer_params.do_remote_decode needs decode_engine_id, the engine id of the "
                               "decode worker that will pull the KV (its GET /v1/kv_transfer says it)",
                               param="kv_transfer_params.decode_engine_id")
        if not kv.do_remote_prefill:
            return
        if role != "decode":
            raise RequestError(f"kv_transfer_params.do_remote_prefill needs a --role decode worker; this one is "
                               f"--role {role}", param="kv_transfer_params.do_remote_prefill")
        if seq.params.prompt_logprobs is not None:   # its prompt is never run here: no logits for it
            raise RequestError("prompt_logprobs cannot be computed by a --role decode worker, which pulls the "
                               "prompt's KV cache instead of running the prompt; send the request to a --role "
                               "both worker", param="prompt_logprobs")
        for name, mine in (("block_size", self.config.block_size), ("dtype", self.kv_dtype)):
            theirs = getattr(kv, name)
            if theirs is not None and theirs != mine:
                raise RequestError(f"kv_transfer_params.{name} {theirs!r} does not match this worker's {mine!r}: "
                                   "the prefill and decode workers must have the same", param=f"kv_transfer_params.{name}")
        if kv.num_tokens != seq.num_prompt_tokens:
            raise RequestError(f"kv_transfer_params.num_tokens {kv.num_tokens} does not match the prompt's "
                               f"{seq.num_prompt_tokens} tokens here (not the prefill worker's prompt)",
                               param="kv_transfer_params.num_tokens")
        self.connector.check_params(kv, seq.prompt_token_ids)
        seq.kv_transfer = kv

    def wake(self) -> None:
        """Cut short a step's idle wait for a KV pull (the one thread-safe method: the server
        calls it when it posts a request or an abort)."""
        if self.connector is not None:
            self.connector.wake()

    def kv_transfer_info(self) -> dict:
        """What GET /v1/kv_transfer answers: the role and where this worker's KV can be pulled from."""
        info = self.connector.info() if self.connector is not None else {
            "role": "both", "engine_id": None, "block_size": self.config.block_size, "dtype": self.kv_dtype,
            "transport": None, "kv_host": None, "kv_port": None}
        return {**info, "model": self.model_name}

    def close(self) -> None:
        """Stop the KV listener and pulls; free the blocks kept under leases."""
        if self.connector is not None:
            for seq in self.connector.close():
                self.block_manager.free(seq)

    @property
    def kv_capacity(self) -> int:
        """The longest sequence (prompt + max_tokens) the whole KV cache holds, in tokens."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_kv_leases(self) -> int:
        return len(self.connector.leases or ()) if self.connector is not None else 0

    def abort_request(self, request_id: str) -> None:
        """Free everything the request holds; its final output comes from the next step()."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.finish(seq, "abort")
        seq.metrics.finished_time = self.clock()
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._aborted)
                or (self.connector is not None and self.connector.has_pending()))

    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        sc, kv = self.scheduler, {}
        if self.connector is not None:
            t = self.connector.stats
            kv = dict(kv_transfer_bytes=t.bytes, kv_transfer_seconds=t.seconds, kv_transfers=t.transfers,
                      kv_transfer_failures=t.failures, kv_leases=len(self.connector.leases or ()))
        if self.threads is not None:
            kv.update(cpu_threads=self.threads.current, cpu_thread_changes=self.threads.num_changes)
        return EngineStats(len(sc.running), len(sc.waiting) + len(sc.loading), bm.num_free_blocks,
                           bm.num_blocks, bm.num_queries, bm.num_hits,
                           None if self.speculator is None else self.speculator.stats, **kv)

    def reset_prefix_cache(self) -> dict:
        """Forget the cached blocks no request holds (BlockManager.reset_prefix_cache)."""
        return self.block_manager.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> process: one forward over the scheduled tokens, each request's
        new tokens turned into its output. Aborts and finished KV pulls are taken first."""
        outputs = [self._finish(seq, None) for seq in self._aborted]
        self._aborted = []
        if self.connector is not None:
            self._poll_connector(outputs)
        start = self.clock()
        sched = None
        try:
            sched = self._schedule(start)
            scheduled = self.clock()
            if not sched.seqs:
                if not outputs and self.connector is not None and self.connector.has_pending():
                    self.connector.wait_for_load(IDLE_WAIT_S)   # nothing to run until a pull ends
                return outputs
            sampled = self._execute(sched)
            self._process(sched, sampled, outputs)
        except Exception:
            # Whatever failed (scheduling, forward, sampling, detokenizing, stop checks), only the
            # requests in this step fail; the engine keeps serving. If scheduling itself failed,
            # the step's requests are not known: the running ones are failed.
            failed = list(self.scheduler.running) if sched is None else sched.seqs
            logger.exception("engine step failed; failing its %d requests", len(failed))
            self._fail(failed, outputs)
            return outputs
        end = self.clock()
        phases = {"schedule": scheduled - start, **self.runner.last_times}
        phases["output"] = end - start - sum(phases.values())
        self.last_step = StepStats(start, end - start, len(sched.seqs), sched.num_prefill_tokens,
                                   sched.num_decode_tokens, len(sched.preempted), self.runner.last_forward_time, phases)
        self.last_schedule = sched
        for hook in self.hooks:
            hook.after_step(sched, self.last_step)
        return outputs

    def _schedule(self, now: float) -> SchedulerOutput:
        if self.speculator is not None:   # drafts first: the scheduler budgets their tokens
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule(now)
        if self.connector is not None:
            self.connector.start_load_kv()
        return sched

    def _execute(self, sched: SchedulerOutput) -> list:
        """The forward and sampling: (sequence, token or tokens or None, logprobs) per sampled row;
        the scheduled tokens marked computed."""
        if self.fault_hook is not None:
            self.fault_hook(sched)
        for hook in self.hooks:
            hook.before_forward(sched)
        forward_start = self.clock()
        try:
            sampled = self.runner.execute(sched)
        finally:
            for hook in self.hooks:
                hook.after_forward(sched, self.clock() - forward_start)
        if self.speculator is not None:   # before mark_computed: rejected drafts are not computed
            self.speculator.verified(sched, sampled)
        self.scheduler.mark_computed(sched)
        return sampled

    def _process(self, sched: SchedulerOutput, sampled: list, outputs: list[RequestOutput]) -> None:
        """Each sampled token appended, detokenized and stop-checked into `outputs`; finished
        sequences freed (or, on a prefill worker, their KV leased)."""
        now = self.clock()
        failed, errors = [], {}
        for seq, token, logprobs in sampled:
            # One request's failure here (its sampling: token None; detokenizing, stop checks)
            # fails it alone; the others of the step go on. A verified speculation brings a
            # list of tokens (and of logprobs).
            try:
                if token is None:
                    why = self.processor.grammars.failure(seq.matcher, seq.params.grammar)
                    raise why or RuntimeError("its sampling failed")
                if type(token) is list:
                    token = self._append_tokens(seq, token, logprobs, now)
                else:
                    self.processor.append_token(seq, token, logprobs, now)
                    token = [token]
                if seq.finish_reason is None:
                    if not seq.final_only:
                        outputs.append(self.processor.make_output(seq, token))
                    continue
            except GrammarFailed as e:   # its client hears why; the sampler logged it, in one line
                errors[seq.request_id] = e
                failed.append(seq)
                continue
            except Exception:
                logger.exception("request %s failed in this step; only it fails", seq.request_id)
                failed.append(seq)
                continue
            kept = self.connector.request_finished(seq) if self.connector is not None else None
            self.scheduler.finish(seq, seq.finish_reason, free_blocks=kept is None)   # in this step
            if kept is not None:   # a prefill worker's: leased to a decode worker
                self.connector.save_kv(seq, kept)
            out = self._finish(seq, token)
            out.kv_transfer_params = kept
            outputs.append(out)
        if failed:
            self._fail(failed, outputs, errors)

    def _poll_connector(self, outputs: list[RequestOutput]) -> None:
        """Free the blocks of leases that ended; resume (or fail) the sequences whose pull ended."""
        loads, freed = self.connector.get_finished()
        for seq in freed:
            self.block_manager.free(seq)
        for r in loads:
            seq = r.seq
            if seq.is_finished:   # aborted while its pull ran: the blocks are free to go now
                self.block_manager.free(seq)
            elif r.error is None:
                self.scheduler.resume_loaded(seq, r.end)
            else:
                policy = self.config.kv_load_failure_policy
                logger.warning("request %s: pulling its prompt KV failed (%s); %s", seq.request_id, r.error,
                               "recomputing the prompt here" if policy == "recompute" else "failing it")
                self.scheduler.resume_loaded(seq, r.start)   # what was cached here is still valid
                if policy == "fail":
                    self._fail([seq], outputs)
                    outputs[-1].kv_transfer_params = {"error": f"pulling the prompt's KV cache from the prefill "
                                                               f"worker failed: {r.error}"}

    def calibrate_cost_model(self) -> StepCostModel:
        """Fit self.cost_model on a few timed steps of fake sequences (seconds on a 0.5B CPU model).
        Only while no request is live: it borrows the KV cache."""
        c = self.config
        shapes = calibration_shapes(c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len)
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        shapes = [(n, ctx) for n, ctx in shapes
                  if sum(-(-(a + b) // c.block_size) for a, b in zip(n, ctx)) * c.block_size <= capacity]
        t0 = time.perf_counter()
        calibrate(self.cost_model, self._fake_step, shapes, repeats=1, clock=self.clock)
        logger.info("step-time model calibrated in %.1f s: %s", time.perf_counter() - t0, self.cost_model.describe())
        return self.cost_model

    def _fake_step(self, num_tokens: list[int], contexts: list[int]) -> None:
        """One forward of sequences with these scheduled tokens after these cached ones (any ids)."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        vocab = self.model_config.vocab_size
        sched, seqs = SchedulerOutput(), []
        try:
            for i, (n, ctx) in enumerate(zip(num_tokens, contexts)):
                seq = Sequence(f"calibration-{i}", [(7 * j + i) % vocab for j in range(ctx + n)], params, 0.0)
                seq.num_computed_tokens, seq.prefill_len = ctx, (ctx + n if n > 1 else 0)
                seqs.append(seq)
                self.block_manager.allocate(seq, ctx + n)
                sched.add(seq, n, n > 1)
            self.runner.execute(sched)
        finally:
            for seq in seqs:
                self.block_manager.free(seq)

    def _fail(self, seqs: list[Sequence], outputs: list[RequestOutput], errors: dict | None = None) -> None:
        """Finish with "error" (blocks freed) each of `seqs` not already finished in this step;
        `errors`: request id -> the RequestError its output carries, where it was its own fault.

        An exception in here (e.g. a block freed twice) leaves the engine inconsistent: it
        propagates, and the server's engine loop dies and reports it."""
        now = self.clock()
        for seq in seqs:
            if seq.is_finished or seq.request_id not in self.seqs:
                continue
            self.scheduler.finish(seq, "error")
            seq.metrics.finished_time = now
            outputs.append(self._finish(seq, None))
            outputs[-1].error = (errors or {}).get(seq.request_id)

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list | None, now: float) -> list[int]:
        """A verification's tokens, one at a time until one stops the sequence; those appended."""
        for i, token in enumerate(tokens):
            self.processor.append_token(seq, token, None if logprobs is None else logprobs[i], now)
            if seq.finish_reason is not None:
                return tokens[:i + 1]
        return tokens

    def _finish(self, seq: Sequence, new_tokens: list[int] | None) -> RequestOutput:
        """The final output of a sequence the scheduler has finished (new_tokens: this step's).
        If making it fails, the request still gets one, an error, rather than none."""
        del self.seqs[seq.request_id]
        try:
            if seq.final_only:   # its only output: everything is new
                return self.processor.make_output(seq, seq.output_token_ids)
            return self.processor.make_output(seq, new_tokens or [])
        except Exception:
            logger.exception("the final output of request %s failed", seq.request_id)
            seq.finish_reason, seq.stop_reason = "error", None
            return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, seq.output.text, [], "",
                                 None, True, "error", seq.metrics, None)
