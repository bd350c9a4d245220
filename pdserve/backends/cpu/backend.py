"""The CPU backend: the model on pdserve's kernels (kernels/), chosen where the device is the CPU
and they build.

prepare_model repacks every linear into the kernels' panels (packed_linear.py, on huge pages:
hugepages.py; the codes of a quantized checkpoint or of --quantization int4|int8 stay 4/8-bit:
quant_linear.py) and swaps the norms, SwiGLU (GeGLU), RoPE and (for the head sizes its kernels take,
soft-capped or not) the paged attention onto the kernels (layers.py). Once the KV cache is bound, the layers run as one
C++ call (stack.py), built from the recipe the model declares (models/decoder_spec.py); a model the
stack cannot run keeps its modules, layer by layer, and the log says why in one line. A greedy
batch takes its tokens from the packed lm_head's fused argmax, without the logits."""
import logging

import torch
from torch import nn

from pdserve.backends.base import Backend
from pdserve.backends.cpu import hugepages, kernels
from pdserve.backends.cpu.layers import experts_on_hugepages, quantize_experts, use_kernel_layers
from pdserve.backends.cpu.metadata import build_step_metadata
from pdserve.backends.cpu.packed_linear import PackedLinear, pack_model
from pdserve.backends.cpu.quant_linear import QuantLinear
from pdserve.backends.cpu.stack import Unsupported, build_stack, rotary_tables
from pdserve.config import EngineConfig, ModelConfig
from pdserve.layers.attention import attention_context, build_metadata
from pdserve.loader import embed_module_name

log = logging.getLogger("pdserve")

ATTENTION_HEAD_DIMS = (16, 32, 64, 96, 128, 256)   # the head sizes the attention kernels take


class CpuBackend(Backend):
    name = "cpu"
    takes_codes = True   # QuantLinear packs a quantized linear's codes; its dense weight is never made

    def __init__(self, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype):
        self.model_config = model_config
        self.weight_format = config.quantization or ("bf16" if dtype == torch.bfloat16 else "fp32")
        self.attention_kernels = model_config.head_dim in ATTENTION_HEAD_DIMS
        self.stack, self.rotaries, self.why_no_stack = None, [], None

    def prepare_model(self, model: nn.Module) -> None:
        m = self.model_config
        pack_model(model, self.weight_format, embed_module_name(m) if m.tie_word_embeddings else None)
        use_kernel_layers(model, attention=self.attention_kernels)
        int8_experts = self.weight_format == "int8" and quantize_experts(model)   # the MoE layers' experts too
        experts_on_hugepages(model)
        self.fused_argmax = isinstance(model.lm_head, PackedLinear)   # a quantized lm_head: argmax of its logits
        formats = {m.fmt for n, m in model.named_modules()
                   if isinstance(m, (PackedLinear, QuantLinear)) and n != "lm_head"}
        self.linear_formats = f"{', '.join(sorted(formats)) or self.weight_format} packed linears"
        head = getattr(model, "lm_head", None)
        if isinstance(head, (PackedLinear, QuantLinear)) and head.fmt not in formats:
            self.linear_formats += f" (lm_head {head.fmt})"
        if int8_experts:
            self.linear_formats += ", w8 per-channel experts"

    def allocate_kv_cache(self, shape, dtype, device) -> torch.Tensor:
        # marked for huge pages before zeroing touches it (hugepages.py)
        return hugepages.empty(*shape, dtype=dtype, device=device).zero_()

    def attach_cache(self, model: nn.Module) -> None:
        """The decoder stack over the model's packed weights and cache views, where it can run it."""
        self.stack, self.rotaries, self.why_no_stack = None, [], None
        declares = all(hasattr(model, a) for a in ("decoder_spec", "embed", "finish"))
        spec = model.decoder_spec() if declares else None
        if not self.attention_kernels:
            self.why_no_stack = (f"head size {self.model_config.head_dim}: the attention kernels take "
                                 f"{', '.join(map(str, ATTENTION_HEAD_DIMS))}; attention by torch's SDPA")
        elif not declares:
            self.why_no_stack = f"{type(model).__name__} declares no decoder_spec, embed and finish"
        elif spec is None:   # e.g. Ministral 3's query scaled by position
            self.why_no_stack = getattr(model, "why_no_decoder_spec",
                                        f"{type(model).__name__}'s layers have a part its recipe cannot express")
        else:
            try:
                self.stack = build_stack(model, spec)
                self.rotaries = rotary_tables(model, spec)[0]
            except Unsupported as e:
                self.why_no_stack = str(e)
        if self.why_no_stack:
            log.warning("CPU backend: the decoder stack cannot run %s (%s); its torch modules run layer by layer",
                        self.model_config.architecture, self.why_no_stack)

    def build_metadata(self, flat, groups, block_size, device):
        if self.attention_kernels:
            return build_step_metadata(flat, groups, block_size)
        return build_metadata(flat, groups, block_size, device)

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        if self.stack is None:
            with attention_context(meta):
                return model(input_ids, positions)
        x = model.embed(input_ids, positions)
        # each distinct rotary table once per step (Gemma 3: two bases; a partial rotary's is narrower)
        ropes = [r.lookup(positions, torch.float32) for r in self.rotaries]
        cos, sin = [r.cos for r in ropes], [r.sin for r in ropes]
        # activations fp32 throughout: with a bf16 model only the weights and the KV cache are bf16
        return model.finish(self.stack.forward(x.float().contiguous(), cos, sin, meta.step))

    def argmax(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return model.lm_head.argmax(hidden)   # PackedLinear.argmax: the fused reduction

    def describe(self) -> str:
        linears = self.linear_formats
        attention = "attention kernels" if self.attention_kernels else "torch attention"
        layers = "the decoder stack" if self.stack is not None else "modules layer by layer"
        return f"cpu backend: {kernels.kernel_path()}, {linears}, {attention}, {layers}"
