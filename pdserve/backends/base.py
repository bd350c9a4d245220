"""The seam between the model runner and the device: what the runner asks of a backend.

The runner owns the step (the scheduler's output -> flat inputs, sampling); a backend owns how a
model runs on its device: the weights' layout, the KV cache's memory, the attention metadata its
attention reads, the forward, the logits and the greedy argmax. TorchBackend (torch_backend.py),
the model's own torch modules, is the reference on every device; the CPU backend (backends/cpu/)
runs the same model on pdserve's kernels. One is chosen at start (backends.select_backend)."""
import torch
from torch import nn


class Backend:
    name = "torch"
    weight_format = "torch"   # the linears' weights: "torch" (the modules' own) or a packed format
    fused_argmax = False      # argmax() takes greedy tokens without the logits (fp32 hidden rows)
    takes_codes = False       # prepare_model runs a quantized checkpoint's codes: no dense weights are loaded

    def prepare_model(self, model: nn.Module) -> None:
        """Once, after loading and before the KV cache: re-lay weights, swap modules."""

    def kv_cache_blocks(self, model: nn.Module, bytes_per_block: int) -> int | None:
        """The KV cache's blocks where the backend sizes it from its device's memory (CUDA:
        --gpu-memory-utilization); None: the runner's default (--num-kv-blocks and
        --kv-cache-memory, which are asked first, or max-num-seqs full sequences, capped)."""
        return None

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The zeroed KV cache, [2, num_layers, slots, kv_heads, head_dim]."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def attach_cache(self, model: nn.Module) -> None:
        """Once the attention layers hold their views of the KV cache."""

    def build_metadata(self, flat: list[list[int]], groups: list[tuple], block_size: int,
                       device) -> tuple[list[torch.Tensor], object]:
        """One step's flat integer lists as tensors and the attention metadata of the forward
        (layers/attention.py: build_metadata's arguments)."""
        raise NotImplementedError

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Flat batch of T tokens -> hidden states (T, hidden)."""
        raise NotImplementedError

    def compute_logits(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return model.compute_logits(hidden)

    def argmax(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1), where fused_argmax, without making the logits."""
        return self.compute_logits(model, hidden).argmax(-1)

    def describe(self) -> str:
        """One line for the startup log: the backend and its kernel path."""
        raise NotImplementedError
