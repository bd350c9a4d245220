"""The engine: admits requests, runs scheduler -> model runner -> sampler steps, and turns
sampled tokens into per-request outputs (detokenized, stop-checked, timed).

Not thread-safe: one thread calls add_request/abort_request/step (the server's engine loop)."""
import logging
import os
import time

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import EngineStats, RequestOutput, StepStats
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.errors import RequestError
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("pdserve.engine")


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
        self.model_config = ModelConfig.from_dir(model)
        self.tokenizer = Tokenizer.from_dir(model)
        self.model_name = os.path.basename(os.path.normpath(model))
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        self.runner = ModelRunner(self.model_config, self.config, self.max_model_len, self.tokenizer.eos_token_ids)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self.last_step: StepStats | None = None

    # --- admission --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []  # "" is empty even with a BOS
        else:
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary "
                                   f"[0, {self.model_config.vocab_size})", param="prompt")
        if not ids:
            raise RequestError("prompt is empty", param="prompt")
        n, m, limit = len(ids), params.max_tokens, self.max_model_len
        if n >= limit:
            raise RequestError(f"prompt has {n} tokens; this model's maximum context length is {limit} tokens",
                               param="prompt")
        if n + m > limit:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({m}) = {n + m} exceeds this model's maximum "
                               f"context length of {limit} tokens", param="max_tokens")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if n + m > capacity:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({m}) = {n + m} exceeds the whole KV cache "
                               f"({capacity} tokens)", param="max_tokens")
        seq = Sequence(request_id, ids, params, time.perf_counter() if arrival_time is None else arrival_time)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        seq.text = ""
        seq.sent_text_len = 0
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

    # --- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = [self._output(seq, []) for seq in self._aborted]
        for seq in self._aborted:
            del self.seqs[seq.request_id]
        self._aborted = []
        start = time.perf_counter()
        sched = self.scheduler.schedule(start)
        if not sched.seqs:
            return outputs
        try:
            sampled = self.runner.execute(sched, self.block_manager)
        except Exception:
            # A failed forward fails only the requests in this step; the engine keeps serving.
            logger.exception("engine step failed; failing its %d requests", len(sched.seqs))
            now = time.perf_counter()
            for seq in sched.seqs:
                self.scheduler.finish(seq, "error")
                seq.metrics.finished_time = now
                outputs.append(self._output(seq, []))
                del self.seqs[seq.request_id]
            return outputs
        for seq, n in zip(sched.seqs, sched.num_tokens):
            seq.num_computed_tokens += n
        now = time.perf_counter()
        for seq, token, logprobs in sampled:
            outputs.append(self._append_token(seq, token, logprobs, now))
        self.last_step = StepStats(start, time.perf_counter() - start, len(sched.seqs), sched.num_prefill_tokens,
                                   sched.num_decode_tokens, len(sched.preempted), self.runner.last_forward_time)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: dict | None, now: float) -> RequestOutput:
        seq.token_ids.append(token)
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        seq.text += seq.detokenizer.add(token)
        self._check_stop(seq, token)
        if seq.finish_reason is not None:
            if seq.status.value != "finished":
                self.scheduler.finish(seq, seq.finish_reason)
            m.finished_time = now
            del self.seqs[seq.request_id]
        return self._output(seq, [token])

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        n_out = seq.num_output_tokens
        reason = stop = None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
                reason = "stop"
            elif token in p.stop_token_ids:
                reason, stop = "stop", token
            elif p.stop:
                reason, stop = self._check_stop_strings(seq)
        if reason is None and (n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop
            if not isinstance(stop, str):  # emit bytes held back for an incomplete character
                seq.text += seq.detokenizer.flush()

    @staticmethod
    def _check_stop_strings(seq: Sequence):
        # only the tail can hold a new match: the last token's text plus the longest stop string
        longest = max(len(s) for s in seq.params.stop)
        tail_start = max(0, len(seq.text) - longest - 32)
        hits = [(seq.text.find(s, tail_start), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None, None
        i, s = min(hits)
        seq.text = seq.text[:i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        return "stop", s

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        # While a stop string could still be forming, hold back its possible prefix from the stream.
        if seq.is_finished:
            upto = len(seq.text)
        else:
            hold = max((len(s) for s in seq.params.stop), default=1) - 1
            upto = max(seq.sent_text_len, len(seq.text) - hold)
        new_text = seq.text[seq.sent_text_len:upto]
        seq.sent_text_len = upto
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            token_ids=seq.output_token_ids, text=seq.text, new_token_ids=new_tokens, new_text=new_text,
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
            finished=seq.is_finished, finish_reason=seq.finish_reason, metrics=seq.metrics,
            stop_reason=seq.stop_reason)
