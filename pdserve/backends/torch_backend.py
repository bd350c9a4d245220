"""The reference backend: the model's own torch modules on any device (CPU, CUDA), attention by
masked SDPA over the gathered cache (layers/attention.py)."""
import torch
from torch import nn

from pdserve.backends.base import Backend
from pdserve.layers.attention import attention_context, build_metadata


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, device: torch.device, why: str | None = None):
        self.device, self.why = device, why

    def build_metadata(self, flat, groups, block_size, device):
        return build_metadata(flat, groups, block_size, device)

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        with attention_context(meta):
            return model(input_ids, positions)

    def describe(self) -> str:
        return f"torch backend on {self.device}: the model's torch modules" + (f" ({self.why})" if self.why else "")
