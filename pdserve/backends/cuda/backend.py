"""The CUDA backend: the model's torch modules on the GPU (cuBLAS GEMMs through torch), with its
paged attention on Triton kernels (kernels.py) that read the KV cache in place, decode steps
replayed from CUDA graphs (graphs.py), and the KV cache sized from the GPU's memory (memory.py).

Attention: prepare_model swaps each PagedAttention's class for CudaPagedAttention (layers.py).
One kernel launch per layer serves the step's prefill chunks (each attending to its cached prefix
and its own earlier tokens) and its decodes, with GQA, sliding windows, logit soft caps and sinks
(a small batch of decodes splits each sequence's keys over several programs, split-KV, and a
second launch combines them);
the step's metadata (metadata.py) is built once per step and copied to the device in one copy.

Graphs: once the cache is bound, the forward of a batch of B decodes is captured for B in
graphs.capture_sizes(max_num_seqs); a step of decodes replays the smallest captured size that
holds it, padded. --enforce-eager turns them off; a model whose forward cannot be captured (a
host sync in it: the MoE layers' routing) runs eagerly, and describe() says why. Prefill and mixed steps always run eagerly.

KV cache: without --num-kv-blocks or --kv-cache-memory, its blocks are what
--gpu-memory-utilization of the GPU leaves after the weights and the activations of the largest
step, measured by one forward before the cache exists (memory.py).

Not yet run on a GPU: the kernels are tested under Triton's interpreter on the CPU, and compiled
for sm_90 there; tests/backends/cuda/test_gpu.py is what a GPU runs."""
import logging

import torch
from torch import nn

from pdserve.backends.base import Backend
from pdserve.backends.cuda import kernels
from pdserve.backends.cuda.graphs import DecodeGraphs, capture_sizes, decode_only
from pdserve.backends.cuda.layers import use_kernel_attention
from pdserve.backends.cuda.memory import kv_cache_blocks, profile_activation_bytes
from pdserve.backends.cuda.metadata import CudaAttentionMetadata, build_step_metadata
from pdserve.config import EngineConfig, ModelConfig
from pdserve.layers.attention import PagedAttention, attention_context
from pdserve.layers.moe import FusedMoE
from pdserve.models import kv_spec

log = logging.getLogger("pdserve")

# query rows of a tile (query tokens x the heads sharing a KV head): a tensor-core tile needs 16
DECODE_TILE_ROWS, PREFILL_TILE_ROWS = 16, 64


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype,
                 device: torch.device | None = None):
        self.model_config, self.config, self.dtype = model_config, config, dtype
        self.device = torch.device(device or config.device)
        self.num_sms = None   # the GPU's SMs, which split-KV fills (kernels.kv_splits)
        if self.device.type == "cuda":   # Triton launches on the current device: cuda:N must be it
            torch.cuda.set_device(self.device)
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        group = model_config.num_heads // model_config.num_kv_heads
        group_pad = 1 << (group - 1).bit_length()
        prefill_rows = PREFILL_TILE_ROWS if model_config.head_dim <= 128 else PREFILL_TILE_ROWS // 2   # registers
        self.block_q = {True: max(1, DECODE_TILE_ROWS // group_pad), False: max(1, prefill_rows // group_pad)}
        self.graphs: DecodeGraphs | None = None
        self.why_eager = "--enforce-eager" if config.enforce_eager else None

    def prepare_model(self, model: nn.Module) -> None:
        use_kernel_attention(model)

    def kv_cache_blocks(self, model: nn.Module, bytes_per_block: int) -> int | None:
        if self.device.type != "cuda":
            return None
        c = self.config
        free, total = torch.cuda.mem_get_info(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        peak = profile_activation_bytes(lambda: self._largest_step(model), self.device)
        blocks = kv_cache_blocks(total, free, weights, peak, c.gpu_memory_utilization, bytes_per_block)
        log.info("KV cache: %d blocks (%.2f GiB): %.2f of %.1f GiB, less %.2f GiB weights and %.2f GiB activations",
                 blocks, blocks * bytes_per_block / 2**30, c.gpu_memory_utilization, total / 2**30,
                 weights / 2**30, peak / 2**30)
        return blocks

    def _largest_step(self, model: nn.Module) -> None:
        """One prefill of max_num_batched_tokens tokens against a one-block cache that nothing is
        written to (slots -1), and the logits of max_num_seqs rows with their log-softmax."""
        c, m = self.config, self.model_config
        n, bs = c.max_num_batched_tokens, c.block_size
        layers = [x for x in model.modules() if isinstance(x, PagedAttention)]
        scratch = torch.zeros(kv_spec(m).shape(len(layers), bs), dtype=self.dtype, device=self.device)
        bound = [(layer.k_cache, layer.v_cache) for layer in layers]
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = scratch[0, i], scratch[1, i]
        max_len = getattr(m, "max_model_len", None) or m.max_position_embeddings
        flat = [[0] * n, [p % max_len for p in range(n)], [-1] * n]
        tables = [[0] * -(-n // bs)]
        (ids, pos, _), meta = self.build_metadata(flat, [([n], [0], [n], tables)], bs, self.device)
        with torch.inference_mode():
            hidden = self.forward(model, ids, pos, meta)
            rows = hidden[-min(n, c.max_num_seqs):]
            torch.log_softmax(self.compute_logits(model, rows).float(), dim=-1)
        for layer, (k, v) in zip(layers, bound):
            layer.k_cache, layer.v_cache = k, v

    def attach_cache(self, model: nn.Module) -> None:
        """Capture the decode graphs, where the device is CUDA and they are not turned off."""
        self.graphs = None
        if self.device.type != "cuda" or self.why_eager:
            return
        if any(isinstance(x, FusedMoE) for x in model.modules()):
            # its experts' loop reads the routing on the host (bincount().tolist()): no capture
            self.why_eager = "mixture-of-experts layers route on the host"
            return
        m, c = self.model_config, self.config
        max_len = getattr(m, "max_model_len", None) or m.max_position_embeddings
        graphs = DecodeGraphs(capture_sizes(c.max_num_seqs), -(-max_len // c.block_size), c.block_size,
                              self.block_q[True], self.device, self._kv_splits)
        try:
            with torch.inference_mode():
                graphs.capture(lambda ids, pos, meta: self._eager(model, ids, pos, meta))
        except Exception as e:   # e.g. a layer that syncs with the host: .item(), a data-dependent shape
            self.why_eager = f"the forward could not be captured: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log.warning("CUDA backend: decode steps run eagerly (%s)", self.why_eager)
            torch.cuda.synchronize(self.device)
            return
        self.graphs = graphs

    def build_metadata(self, flat, groups, block_size, device):
        if self.graphs is not None:
            replay = self.graphs.prepare(flat, groups)
            if replay is not None:
                return replay
        decodes = decode_only(groups)
        tensors, meta = build_step_metadata(flat, groups, block_size, device, self.block_q[decodes])
        if decodes:   # one program per sequence and KV head: a small batch leaves SMs idle without split-KV
            meta.kv_splits = self._kv_splits(len(flat[-1]))
        return tensors, meta

    def _kv_splits(self, num_decodes: int) -> int:
        return kernels.kv_splits(num_decodes, self.model_config.num_kv_heads, self.num_sms)

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        if isinstance(meta, CudaAttentionMetadata) and meta.graph_batch is not None:
            return self.graphs.replay(meta, input_ids.shape[0])
        return self._eager(model, input_ids, positions, meta)

    @staticmethod
    def _eager(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        with attention_context(meta):
            return model(input_ids, positions)

    def describe(self) -> str:
        interp = " (Triton's interpreter)" if kernels.interpreted() else ""
        if self.graphs is not None:
            graphs = f"decode CUDA graphs for batches {self.graphs.sizes[0]}..{self.graphs.sizes[-1]}"
        else:
            graphs = f"no CUDA graphs ({self.why_eager or 'not a CUDA device'})"
        return f"cuda backend on {self.device}: torch modules, Triton paged attention{interp}, {graphs}"
