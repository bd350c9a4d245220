"""`--baseline hf`: the origin's /basic_generate. One transformers generate() call per request,
one request at a time, with HF's KV cache. Nothing is visible between prefill and the last
token: a streaming client gets every token at the end (TTFT = end-to-end latency)."""
import time

import torch

from pdserve.baselines.baseline import Baseline
from pdserve.engine.outputs import RequestOutput, StepStats


class GenerateBaseline(Baseline):
    name = "hf"
    UNSUPPORTED = ("logprobs", "presence_penalty", "frequency_penalty", "grammar")

    @torch.inference_mode()
    def _step(self) -> list[RequestOutput]:
        if not self.waiting:
            return []
        seq = self.waiting[0]
        start = time.perf_counter()
        self._start([seq], start)
        if seq.params.seed is not None:
            torch.manual_seed(seq.params.seed)   # alone in its call: the seed fixes the output
        ids = torch.tensor([seq.token_ids], device=self.device)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **self._generate_kwargs(seq.params))
        self.num_model_calls += 1
        now = time.perf_counter()
        outputs = self._deliver_all([seq], [out[0, ids.shape[1]:].tolist()], now)
        self.last_step = StepStats(start, now - start, 1, seq.num_prompt_tokens, len(seq.output_token_ids) - 1, 0,
                                   now - start)
        return outputs
