"""What the baselines share: a transformers model, our tokenizer and output processor,
a FIFO queue of Sequences, aborts, stats."""
import collections
import logging
import os
import time

import torch
from transformers import AutoModelForCausalLM

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.outputs import EngineStats, RequestOutput, StepStats
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.errors import CheckpointError, RequestError
from pdserve.loader import weight_files
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger("pdserve.baselines")


class Baseline:
    """Base of the baselines: everything but step()."""
    name = ""   # the --baseline value
    # SamplingParams fields a baseline cannot honour: refused with a 400 naming the field.
    UNSUPPORTED: tuple[str, ...] = ()

    def __init__(self, model: str, dtype: str = "auto", device: str | None = None, max_model_len: int | None = None,
                 seed: int = 0, **_engine_only_options):
        self.config = EngineConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed)
        self.model_config = ModelConfig.from_dir(model)       # same checks and errors as the engine
        if self.model_config.gguf_file:
            raise CheckpointError(f"{model}: a GGUF model is served by the engine, not by "
                                  f"--baseline {self.name}, which runs transformers on an HF checkpoint")
        self.tokenizer = Tokenizer.from_dir(model)
        self.model_name = os.path.basename(os.path.normpath(model))
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(max_model_len or limit, limit)
        self.device = torch.device(self.config.device)
        weight_files(model)   # the engine's checks: weights only from inside the directory, no .bin
        self.model = AutoModelForCausalLM.from_pretrained(
            model, dtype=self.config.torch_dtype(self.model_config), trust_remote_code=False,
            local_files_only=True).to(self.device).eval()
        # We decide when to stop (EOS, stop tokens, ignore_eos); generate() must not fall back to
        # the checkpoint's EOS when a request passes none.
        self.model.generation_config.eos_token_id = None
        self.pad_id = next((t for t in (self.tokenizer.token_to_id("<pad>"), *self.tokenizer.eos_token_ids)
                            if t is not None), 0)
        self.processor = OutputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self.last_step: StepStats | None = None
        self.num_model_calls = 0   # generate() calls or forwards, for tests and docs

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        for name in self.UNSUPPORTED:
            default = SamplingParams.__dataclass_fields__[name].default
            if getattr(params, name) != default:
                raise RequestError(f"{name} is not supported by the {self.name} baseline", param=name)
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        seq = self.processor.new_sequence(request_id, prompt, params,
                                          time.perf_counter() if arrival_time is None else arrival_time)
        self.seqs[request_id] = seq
        self.waiting.append(seq)

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return
        # A request inside a running generate() call cannot be cut out of it: it is dropped
        # from the results when the call returns (the origin could not abort at all).
        (self.waiting.remove if seq.status == SequenceStatus.WAITING else self.running.remove)(seq)
        self._set_finished(seq, "abort", time.perf_counter())
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    def get_stats(self) -> EngineStats:
        # No paged KV cache here (HF allocates one per generate call): usage reads 0.
        return EngineStats(len(self.running), len(self.waiting), num_free_blocks=1, num_total_blocks=1)

    def step(self) -> list[RequestOutput]:
        outputs = [self._finish(seq, []) for seq in self._aborted]
        self._aborted = []
        try:
            return outputs + self._step()
        except Exception:
            # as in the engine: a failed model call fails only the requests it was running
            logger.exception("%s baseline step failed; failing its %d requests", self.name, len(self.running))
            now = time.perf_counter()
            for seq in list(self.running):
                self.running.remove(seq)
                self._set_finished(seq, "error", now)
                outputs.append(self._finish(seq, []))
            return outputs

    def _step(self) -> list[RequestOutput]:
        raise NotImplementedError

    # --- helpers for subclasses --------------------------------------------------------------------
    def _start(self, seqs: list[Sequence], now: float) -> None:
        for seq in seqs:
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            seq.metrics.first_scheduled_time = now
            seq.metrics.num_prefill_steps += 1

    def _set_finished(self, seq: Sequence, reason: str | None, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq.finish_reason is None:
            seq.finish_reason = reason
        seq.metrics.finished_time = seq.metrics.finished_time or now

    def _finish(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        self.seqs.pop(seq.request_id, None)
        return self.processor.make_output(seq, new_tokens)

    def _deliver_all(self, seqs: list[Sequence], tokens: list[list[int]], now: float) -> list[RequestOutput]:
        """Feed whole generations through the output processor (stop rules, text), all at `now`:
        nothing reaches the client before the call returns, so TTFT equals end-to-end latency."""
        outputs = []
        for seq, toks in zip(seqs, tokens):
            if seq.status != SequenceStatus.RUNNING:   # aborted while generate() ran
                continue
            for t in toks:
                self.processor.append_token(seq, t, None, now)
                if seq.finish_reason is not None:
                    break
            if seq.finish_reason is None:   # generate() stopped early (an EOS we asked it to stop at)
                seq.finish_reason = "stop"
            self.running.remove(seq)
            self._set_finished(seq, None, now)
            outputs.append(self._finish(seq, seq.output_token_ids))
        return outputs

    def _generate_kwargs(self, p: SamplingParams) -> dict:
        """SamplingParams as transformers generate() arguments."""
        kw = dict(max_new_tokens=p.max_tokens, do_sample=not p.greedy, pad_token_id=self.pad_id)
        if not p.greedy:
            kw.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or None, min_p=p.min_p or None)
        if p.repetition_penalty != 1.0:
            kw["repetition_penalty"] = p.repetition_penalty
        if p.min_tokens:
            kw["min_new_tokens"] = p.min_tokens
        eos = ([] if p.ignore_eos else list(self.tokenizer.eos_token_ids)) + list(p.stop_token_ids)
        if eos:
            kw["eos_token_id"] = eos
        return kw
