"""`--baseline static`: the origin's /generate. Request-level static batching: up to
`batch_size` waiting requests (the origin used 4) are formed into one batch, optionally after
waiting `batch_wait_ms` for it to fill, and run to completion by one generate() call; requests
that arrive meanwhile wait for the whole batch to finish.

Prompts are padded on the left, so each row's last prompt token sits next to its first
generated one and greedy batched output equals solo output. The origin padded on the right,
which for a decoder-only model puts pad tokens between prompt and continuation and changes
results."""
import time

import torch

from pdserve.baselines.baseline import Baseline
from pdserve.engine.outputs import RequestOutput, StepStats


class StaticBaseline(Baseline):
    name = "static"
    # One generate() call has one set of sampling settings and one RNG for all rows.
    UNSUPPORTED = ("logprobs", "presence_penalty", "frequency_penalty", "seed", "grammar")

    def __init__(self, model: str, batch_size: int = 4, batch_wait_ms: float = 0.0, **kwargs):
        super().__init__(model, **kwargs)
        if batch_size < 1 or batch_wait_ms < 0:
            raise ValueError(f"batch_size must be >= 1 and batch_wait_ms >= 0, got {batch_size}, {batch_wait_ms}")
        self.batch_size, self.batch_wait = batch_size, batch_wait_ms / 1000

    @torch.inference_mode()
    def _step(self) -> list[RequestOutput]:
        if not self.waiting:
            return []
        first = self.waiting[0]
        if len(self.waiting) < self.batch_size and time.perf_counter() - first.metrics.arrival_time < self.batch_wait:
            time.sleep(0.001)   # let the batch fill; new requests are added between steps
            return []
        kwargs = self._generate_kwargs(first.params)
        # FIFO, but only requests whose settings can share this call (max_new_tokens may differ:
        # the batch runs to the longest, each row is cut at its own limit)
        same = lambda s: {**self._generate_kwargs(s.params), "max_new_tokens": 0} == {**kwargs, "max_new_tokens": 0}
        batch = [s for s in self.waiting if same(s)][:self.batch_size]
        kwargs["max_new_tokens"] = max(s.params.max_tokens for s in batch)
        start = time.perf_counter()
        self._start(batch, start)
        width = max(s.num_tokens for s in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(batch):
            ids[i, width - s.num_tokens:] = torch.tensor(s.token_ids)
            mask[i, width - s.num_tokens:] = 1
        out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), **kwargs)
        self.num_model_calls += 1
        now = time.perf_counter()
        outputs = self._deliver_all(batch, out[:, width:].tolist(), now)
        self.last_step = StepStats(start, now - start, len(batch), sum(s.num_prompt_tokens for s in batch),
                                   (out.shape[1] - width - 1) * len(batch), 0, now - start)
        return outputs
