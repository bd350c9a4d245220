"""Owns the model, the paged KV cache and the sampler; runs one step's flat batch.

prepare() turns the scheduler's output into flat input_ids/positions, the slot mapping and the
attention groups; execute() runs one forward, computes logits only for the sequences whose
scheduled tokens reach their end (a finished prefill or a decode), and samples their next tokens;
a request asking for prompt logprobs also gets the logits of its prompt rows (prompt_logprobs.py).
How the model runs on the device (weights' layout, attention metadata, forward, argmax) is the
backend's (pdserve/backends/), chosen once at start."""
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.backends import select_backend
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine import prompt_logprobs
from pdserve.engine.grammar import forced_tokens
from pdserve.engine.kv_spec import bind_kv_cache
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kv_transfer.shm import shared_kv_cache
from pdserve.layers.attention import PagedAttention
from pdserve.layers.mla import MultiHeadLatentAttention
from pdserve.engine.sampler import Sampler
from pdserve.loader import load_model
from pdserve.models import kv_spec
from pdserve.spec_decode import rejection

DEFAULT_KV_CACHE_CAP = 4 << 30  # bytes, when neither --num-kv-blocks nor --kv-cache-memory is given


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, max_model_len: int,
                 eos_token_ids: list[int]):
        self.model_config, self.config = model_config, config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype(model_config)
        self.block_size = config.block_size
        self.kv_spec = kv_spec(model_config)   # K and V per head, or MLA's latent (engine/kv_spec.py)
        self.backend = select_backend(model_config, config, self.dtype)
        self.model = load_model(model_config, self.dtype, config.device, dense_quantized=not self.backend.takes_codes)
        self.backend.prepare_model(self.model)
        self.num_blocks = self._num_blocks(max_model_len)
        self._allocate_kv_cache()
        self.backend.attach_cache(self.model)
        self.sampler = Sampler(eos_token_ids, self.device, config.seed)
        self.last_forward_time = 0.0
        self.last_times: dict[str, float] = {}
        self._masks: ThreadPoolExecutor | None = None   # started by the first constrained request

    @property
    def weight_format(self) -> str:
        """The linears' weights: "torch" (the modules' own) or the CPU backend's packed fp32|bf16|int8."""
        return self.backend.weight_format

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.kv_spec.bytes_per_token(self.model_config.num_layers, self.dtype)

    def _num_blocks(self, max_model_len: int) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory is not None:
            n = c.kv_cache_memory // self.bytes_per_block
            if n < 1:
                raise ValueError(f"kv_cache_memory={c.kv_cache_memory} bytes holds no block "
                                 f"(one block is {self.bytes_per_block} bytes)")
            return n
        measured = self.backend.kv_cache_blocks(self.model, self.bytes_per_block)   # CUDA: from the GPU's memory
        if measured is not None:
            return measured
        # enough for max_num_seqs full-length sequences, capped
        want = c.max_num_seqs * -(-max_model_len // self.block_size)
        return max(1, min(want, DEFAULT_KV_CACHE_CAP // self.bytes_per_block))

    def _allocate_kv_cache(self):
        shape = self.kv_spec.shape(self.model_config.num_layers, self.num_blocks * self.block_size)
        self.kv_cache_file = None
        if self.config.role == "prefill" and self.config.kv_transport == "shm" and self.device.type == "cpu":
            # in a /dev/shm file that decode workers on this host map (pdserve/kv_transfer/shm.py)
            self.kv_cache_file, self.kv_cache = shared_kv_cache(shape, self.dtype)
        else:
            self.kv_cache = self.backend.allocate_kv_cache(shape, self.dtype, self.device)
        bind_kv_cache(self.model, self.kv_cache, (PagedAttention, MultiHeadLatentAttention))

    def prepare(self, sched: SchedulerOutput):
        """Flat inputs for the step, and which flat rows need logits (with their sequences)."""
        input_ids, positions, slots = [], [], []
        groups = {True: ([], [], [], []), False: ([], [], [], [])}  # decode? -> q_lens, starts, ctx, tables
        logit_rows, sample_seqs, verify = [], [], []
        bs = self.block_size
        for seq, n in zip(sched.seqs, sched.num_tokens):
            start, first = len(input_ids), seq.num_computed_tokens
            table = seq.block_table
            if n == 1:   # a decode (most sequences of a busy step): no slice, range or generator
                input_ids.append(seq.token_ids[first])
                positions.append(first)
                slots.append(table[first // bs] * bs + first % bs)
            else:
                ids = seq.token_ids[first:first + n]
                if len(ids) < n:   # a verification: the last token, then the drafts (pdserve/spec_decode)
                    ids += seq.draft.token_ids[:n - len(ids)]
                input_ids.extend(ids)
                pos = range(first, first + n)
                positions.extend(pos)
                slots.extend(table[p // bs] * bs + p % bs for p in pos)
            g = groups[n == 1]
            g[0].append(n)
            g[1].append(start)
            g[2].append(first + n)
            g[3].append(table)
            if first + n == seq.num_tokens:   # all its tokens are cached after this step: sample
                logit_rows.append(start + n - 1)
                sample_seqs.append(seq)
            elif first + n > seq.num_tokens:   # verifying drafts: logits at all n rows
                verify.append((seq, start, n))
        (input_ids_t, positions_t, _), meta = self.backend.build_metadata(
            [input_ids, positions, slots], [g for g in groups.values() if g[0]], bs, self.device)
        return input_ids_t, positions_t, meta, logit_rows, sample_seqs, verify

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput):
        """Run the step. Returns [(seq, token, logprobs)] for the sequences that sample; appends
        the prompt logprobs of its prefill rows to their sequences (prompt_logprobs.py).
        Times its phases into last_times (prepare, forward, sample), in seconds."""
        t0 = time.perf_counter()
        input_ids, positions, meta, logit_rows, sample_seqs, verify = self.prepare(sched)
        # the grammar masks of the constrained rows, computed while the forward runs
        matchers = [s.matcher for s in sample_seqs if s.matcher is not None]
        masks = self._mask_pool().submit(self.sampler.grammars.fill_masks, matchers) if matchers else None
        t1 = self._now()
        hidden = self.backend.forward(self.model, input_ids, positions, meta)
        verified = self._verify(hidden, verify) if verify else []
        work = prompt_logprobs.rows_needing(sched)
        if work:   # the prompt rows' real logits (never the fused argmax), a bounded slice at a time
            prompt_logprobs.compute(self.backend, self.model, hidden, work, self.model_config.vocab_size)
        logits = tokens = None
        forced: dict[int, int] = {}
        if logit_rows:   # every row samples in a step of decodes only: no gather then
            hidden = hidden if len(logit_rows) == hidden.shape[0] else hidden[logit_rows]
            # A batch whose every sequence only takes the argmax (Sequence.argmax_only) gets its tokens
            # from the backend's fused argmax (the CPU's packed lm_head): the logits (batch x vocab
            # floats) are never made. fp32 rows only: a bf16 model's logits without the decoder
            # stack are rounded to bf16 first. Off (fused_argmax False) the sampler takes the same argmax.
            if self.backend.fused_argmax and hidden.dtype == torch.float32 and all(s.argmax_only for s in sample_seqs):
                tokens = self.backend.argmax(self.model, hidden)   # greedy: the tokens, without the logits
            else:
                if masks is not None:
                    masks, forced = self._forced(sample_seqs, masks)
                rows = [i for i in range(len(sample_seqs)) if i not in forced]
                if rows:
                    logits = self.backend.compute_logits(self.model, hidden if not forced else hidden[rows])
        t2 = self._now()
        self.last_forward_time = t2 - t1
        result = []
        if tokens is not None:
            result = list(zip(sample_seqs, tokens.tolist(), [None] * len(sample_seqs)))
        elif logits is not None or forced:
            sampled = iter(())
            if logits is not None:
                seqs = [sample_seqs[i] for i in rows]
                toks, lps = self.sampler(logits, seqs, masks)
                sampled = zip(toks, lps)
            result = [(seq, self.sampler.take_forced(seq, forced[i]), None) if i in forced else (seq, *next(sampled))
                      for i, seq in enumerate(sample_seqs)]
        self.last_times = {"prepare": t1 - t0, "forward": t2 - t1, "sample": self._now() - t2}
        if verified:
            result.extend(verified)
        return result

    def _verify(self, hidden: torch.Tensor, verify: list) -> list:
        """[(seq, tokens, logprobs)] of the sequences verifying drafts (spec_decode/rejection.py):
        the accepted drafts and one more token each, from the logits of all their rows."""
        rows = [r for _, start, n in verify for r in range(start, start + n)]
        h = hidden[rows]
        if self.backend.fused_argmax and h.dtype == torch.float32 and all(s.argmax_only for s, _, _ in verify):
            return rejection.verify(verify, None, self.backend.argmax(self.model, h).tolist(), self.sampler)
        return rejection.verify(verify, self.backend.compute_logits(self.model, h).float(), None, self.sampler)

    def _forced(self, seqs, pending):
        """The constrained rows' masks, and {row: token} for the rows whose grammar allows one
        token and that need nothing else (no logprobs, no min_tokens mask): they skip the
        lm_head. The masks returned are those of the other constrained rows, in order."""
        try:
            masks = pending.result()
        except Exception:   # the sampler computes them again, and fails the rows that fail
            return None, {}
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        forced, overruns = {}, self.sampler.grammars.overruns   # over budget: the sampler fails them
        for i, tok in zip(rows, forced_tokens(masks)):
            s = seqs[i]
            if (tok is not None and s.params.logprobs is None and s.num_output_tokens >= s.params.min_tokens
                    and id(s.matcher) not in overruns):
                forced[i] = tok
        if forced:
            masks = masks[[k for k, i in enumerate(rows) if i not in forced]]
        return masks, forced

    def _mask_pool(self) -> ThreadPoolExecutor:
        if self._masks is None:
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        return self._masks

    def _now(self) -> float:
        if self.device.type == "cuda":   # kernels are asynchronous: wait, or time lands in the wrong phase
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.inference_mode()
    def forward_logits(self, sched: SchedulerOutput) -> torch.Tensor:
        """All-position logits of one step (for tests comparing against a reference)."""
        input_ids, positions, meta, *_ = self.prepare(sched)
        hidden = self.backend.forward(self.model, input_ids, positions, meta)
        return self.backend.compute_logits(self.model, hidden).float()
