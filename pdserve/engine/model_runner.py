"""Owns the model, the paged KV cache and the sampler; runs one step's flat batch.

prepare() turns the scheduler's output into flat input_ids/positions, the slot mapping and the
attention groups; execute() runs one forward under the attention context, computes logits only
for the sequences whose scheduled tokens reach their end (a finished prefill or a decode), and
samples their next tokens."""
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve import hugepages
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.grammar import forced_tokens
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kernels import cpu_ops
from pdserve.kv_transfer.shm import shared_kv_cache
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.attention import PagedAttention, attention_context, build_metadata
from pdserve.layers.layernorm import RMSNorm
from pdserve.engine.sampler import Sampler
from pdserve.layers.packed_linear import PackedLinear, pack_model
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.loader import embed_module_name, load_model

DEFAULT_KV_CACHE_CAP = 4 << 30  # bytes, when neither --num-kv-blocks nor --kv-cache-memory is given


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, max_model_len: int,
                 eos_token_ids: list[int]):
        self.model_config, self.config = model_config, config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype(model_config)
        self.block_size = config.block_size
        self.model = load_model(model_config, self.dtype, config.device)
        self.weight_format = self._pack_linears()
        # attention groups then skip their mask and run kernels/attention_cpu.cpp (decode) and
        # kernels/prefill_attention_cpu.cpp (prefill), for the head sizes they have
        self.attention_kernels = self.weight_format != "torch" and model_config.head_dim in (16, 32, 64, 96, 128)
        self.num_blocks = self._num_blocks(max_model_len)
        self._allocate_kv_cache()
        if self.attention_kernels:
            self.model.use_stack()   # the layers as one C++ call (kernels/decoder_cpu.cpp)
        self.sampler = Sampler(eos_token_ids, self.device, config.seed)
        # A batch whose every sequence only takes the argmax (Sequence.argmax_only) gets its tokens
        # from the packed lm_head's fused argmax: the logits (batch x vocab floats) are never made.
        # Off (fused_argmax = False) the sampler takes the same argmax of the logits.
        self.fused_argmax = isinstance(self.model.lm_head, PackedLinear)
        self.sliding_window = model_config.sliding_window
        self.last_forward_time = 0.0
        self.last_times: dict[str, float] = {}
        self._masks: ThreadPoolExecutor | None = None   # started by the first constrained request

    def _pack_linears(self) -> str:
        """Swap the linears onto the CPU packed kernel where it helps and builds; the format used."""
        c = self.config
        if self.device.type != "cpu" or c.cpu_kernels is False or self.dtype == torch.float16:
            return "torch"
        if cpu_ops() is None:
            if c.cpu_kernels or c.quantization:
                raise RuntimeError("pdserve's CPU kernels could not be built (see the warning above)")
            return "torch"
        fmt = c.quantization or ("bf16" if self.dtype == torch.bfloat16 else "fp32")
        embed = embed_module_name(self.model_config) if self.model_config.tie_word_embeddings else None
        pack_model(self.model, fmt, embed)
        for m in self.model.modules():
            if isinstance(m, (SiluAndMul, RMSNorm, RotaryEmbedding)):
                m.use_kernel = True
        return fmt

    @property
    def bytes_per_block(self) -> int:
        m = self.model_config
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

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
        # enough for max_num_seqs full-length sequences, capped
        want = c.max_num_seqs * -(-max_model_len // self.block_size)
        return max(1, min(want, DEFAULT_KV_CACHE_CAP // self.bytes_per_block))

    def _allocate_kv_cache(self):
        m = self.model_config
        slots = self.num_blocks * self.block_size
        shape = (2, m.num_layers, slots, m.num_kv_heads, m.head_dim)
        self.kv_cache_file = None
        if self.config.role == "prefill" and self.config.kv_transport == "shm" and self.device.type == "cpu":
            # in a /dev/shm file that decode workers on this host map (pdserve/kv_transfer/shm.py)
            self.kv_cache_file, self.kv_cache = shared_kv_cache(shape, self.dtype)
        else:   # marked for huge pages before zeroing touches it (pdserve/hugepages.py; a no-op off CPU)
            self.kv_cache = hugepages.empty(*shape, dtype=self.dtype, device=self.device).zero_()
        layers = [mod for mod in self.model.modules() if isinstance(mod, PagedAttention)]
        assert len(layers) == m.num_layers
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def prepare(self, sched: SchedulerOutput):
        """Flat inputs for the step, and which flat rows need logits (with their sequences)."""
        input_ids, positions, slots = [], [], []
        groups = {True: ([], [], [], []), False: ([], [], [], [])}  # decode? -> q_lens, starts, ctx, tables
        logit_rows, sample_seqs = [], []
        bs = self.block_size
        for seq, n in zip(sched.seqs, sched.num_tokens):
            start, first = len(input_ids), seq.num_computed_tokens
            table = seq.block_table
            if n == 1:   # a decode (most sequences of a busy step): no slice, range or generator
                input_ids.append(seq.token_ids[first])
                positions.append(first)
                slots.append(table[first // bs] * bs + first % bs)
            else:
                input_ids.extend(seq.token_ids[first:first + n])
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
        (input_ids_t, positions_t, _), meta = build_metadata(
            [input_ids, positions, slots], [g for g in groups.values() if g[0]], bs, self.sliding_window,
            self.device, with_mask=not self.attention_kernels)
        return input_ids_t, positions_t, meta, logit_rows, sample_seqs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput):
        """Run the step. Returns [(seq, token, logprobs)] for the sequences that sample.
        Times its phases into last_times (prepare, forward, sample), in seconds."""
        t0 = time.perf_counter()
        input_ids, positions, meta, logit_rows, sample_seqs = self.prepare(sched)
        # the grammar masks of the constrained rows, computed while the forward runs
        matchers = [s.matcher for s in sample_seqs if s.matcher is not None]
        masks = self._mask_pool().submit(self.sampler.grammars.fill_masks, matchers) if matchers else None
        t1 = self._now()
        with attention_context(meta):
            hidden = self.model(input_ids, positions)
        logits = tokens = None
        forced: dict[int, int] = {}
        if logit_rows:   # every row samples in a step of decodes only: no gather then
            hidden = hidden if len(logit_rows) == hidden.shape[0] else hidden[logit_rows]
            # fp32 rows only: a bf16 model's logits without the decoder stack are rounded to bf16 first
            if self.fused_argmax and hidden.dtype == torch.float32 and all(s.argmax_only for s in sample_seqs):
                tokens = self.model.compute_argmax(hidden)   # greedy: the tokens, without the logits
            else:
                if masks is not None:
                    masks, forced = self._forced(sample_seqs, masks)
                rows = [i for i in range(len(sample_seqs)) if i not in forced]
                if rows:
                    logits = self.model.compute_logits(hidden if not forced else hidden[rows])
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
        return result

    def _forced(self, seqs, pending):
        """The constrained rows' masks, and {row: token} for the rows whose grammar allows one
        token and that need nothing else (no logprobs, no min_tokens mask): they skip the
        lm_head. The masks returned are those of the other constrained rows, in order."""
        try:
            masks = pending.result()
        except Exception:   # the sampler computes them again, and fails the rows that fail
            return None, {}
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        forced = {}
        for i, tok in zip(rows, forced_tokens(masks)):
            s = seqs[i]
            if tok is not None and s.params.logprobs is None and s.num_output_tokens >= s.params.min_tokens:
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
        input_ids, positions, meta, _, _ = self.prepare(sched)
        with attention_context(meta):
            return self.model.compute_logits(self.model(input_ids, positions)).float()
