"""The CPU backend: the model on pdserve's kernels (kernels/), chosen where the device is the CPU
and they build.

prepare_model repacks every linear into the kernels' panels (packed_linear.py, on huge pages:
hugepages.py) and swaps the norms, SwiGLU, RoPE and (for the head sizes its kernels take) the
paged attention onto the kernels (layers.py). A greedy batch takes its tokens from the packed
lm_head's fused argmax, without the logits."""
import logging

import torch
from torch import nn

from pdserve.backends.base import Backend
from pdserve.backends.cpu import hugepages, kernels
from pdserve.backends.cpu.layers import use_kernel_layers
from pdserve.backends.cpu.metadata import build_step_metadata
from pdserve.backends.cpu.packed_linear import PackedLinear, pack_model
from pdserve.config import EngineConfig, ModelConfig
from pdserve.layers.attention import attention_context, build_metadata
from pdserve.loader import embed_module_name

log = logging.getLogger("pdserve")

ATTENTION_HEAD_DIMS = (16, 32, 64, 96, 128)   # the head sizes the attention kernels take


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype):
        self.model_config = model_config
        self.weight_format = config.quantization or ("bf16" if dtype == torch.bfloat16 else "fp32")
        self.attention_kernels = model_config.head_dim in ATTENTION_HEAD_DIMS

    def prepare_model(self, model: nn.Module) -> None:
        m = self.model_config
        pack_model(model, self.weight_format, embed_module_name(m) if m.tie_word_embeddings else None)
        use_kernel_layers(model, attention=self.attention_kernels)
        self.fused_argmax = isinstance(model.lm_head, PackedLinear)

    def allocate_kv_cache(self, shape, dtype, device) -> torch.Tensor:
        # marked for huge pages before zeroing touches it (hugepages.py)
        return hugepages.empty(*shape, dtype=dtype, device=device).zero_()

    def build_metadata(self, flat, groups, block_size, sliding_window, device):
        if self.attention_kernels:
            return build_step_metadata(flat, groups, block_size, sliding_window)
        return build_metadata(flat, groups, block_size, sliding_window, device)

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        with attention_context(meta):
            return model(input_ids, positions)

    def argmax(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return model.lm_head.argmax(hidden)   # PackedLinear.argmax: the fused reduction

    def describe(self) -> str:
        linears = f"{self.weight_format} packed linears"
        attention = "attention kernels" if self.attention_kernels else "torch attention"
        return f"cpu backend: {kernels.kernel_path()}, {linears}, {attention}, modules layer by layer"
