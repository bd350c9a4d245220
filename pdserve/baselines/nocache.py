"""`--baseline nocache`: the origin's /generate_stream. A token loop that re-runs the whole
sequence with use_cache=False at every step, so every decode step costs a prefill of the
sequence so far; each token is streamed as soon as it exists.

Every step advances each running request by one token with its own forward (the origin ran
one loop per request; nothing is batched). Sampling uses the engine's Sampler: greedy unless
the request asks for sampling (the origin always sampled at temperature 0.7), and it stops at
EOS (the origin's EOS check never fired)."""
import time

import torch

from pdserve.baselines.baseline import Baseline
from pdserve.engine.outputs import RequestOutput, StepStats
from pdserve.engine.sampler import Sampler


class NoCacheBaseline(Baseline):
    name = "nocache"
    def __init__(self, model: str, **kwargs):
        super().__init__(model, **kwargs)
        self.sampler = Sampler(self.tokenizer.eos_token_ids, self.device, self.config.seed)
        self.sampler.grammars = self.processor.grammars

    @torch.inference_mode()
    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self._start(list(self.waiting), start)
        if not self.running:
            return []
        outputs, prefill_tokens = [], 0
        for seq in list(self.running):
            ids = torch.tensor([seq.token_ids], device=self.device)
            logits = self.model(ids, use_cache=False).logits[:, -1]
            self.num_model_calls += 1
            prefill_tokens += seq.num_tokens
            (token,), (logprobs,) = self.sampler(logits, [seq])
            if token is None:   # the sampler failed this request (and logged why)
                raise RuntimeError(f"sampling failed for request {seq.request_id}")
            self.processor.append_token(seq, token, logprobs, time.perf_counter())
            if seq.finish_reason is not None:
                self.running.remove(seq)
                self._set_finished(seq, None, time.perf_counter())
                outputs.append(self._finish(seq, [token]))
            else:
                outputs.append(self.processor.make_output(seq, [token]))
        now = time.perf_counter()
        # every token of every sequence went through the model again: all of it is prefill work
        self.last_step = StepStats(start, now - start, len(outputs), prefill_tokens, 0, 0, now - start)
        return outputs
