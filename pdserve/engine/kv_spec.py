"""What one token leaves in one layer's paged KV cache, as the model declares it.

The cache is one tensor, (planes, num_layers, num_slots, heads, dim). Most models keep a K and a
V row per token (2 planes of num_kv_heads x head_dim); multi-head latent attention keeps one
latent row (1 plane of 1 x (kv_lora_rank + qk_rope_head_dim): layers/mla.py). A model class with
a kv_spec(cfg) declares its own (models.kv_spec asks it); the model runner sizes the cache and its
blocks by it, so the block count for a memory budget, and with it the scheduler's admission, follow the model."""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    planes: int   # rows per token and layer: 2 (K and V) or 1 (MLA's latent)
    heads: int
    dim: int

    def shape(self, num_layers: int, num_slots: int) -> tuple[int, ...]:
        return (self.planes, num_layers, num_slots, self.heads, self.dim)

    def bytes_per_token(self, num_layers: int, dtype: torch.dtype) -> int:
        return self.planes * num_layers * self.heads * self.dim * dtype.itemsize


def bind_kv_cache(model: torch.nn.Module, kv_cache: torch.Tensor, attention_types: tuple) -> None:
    """Give each attention layer (a module of attention_types, in model order) its views of the
    cache: its own bind_kv_cache(planes) where it has one (MLA), else k_cache and v_cache."""
    layers = [m for m in model.modules() if isinstance(m, attention_types)]
    assert len(layers) == kv_cache.shape[1], f"{len(layers)} attention layers, a cache of {kv_cache.shape[1]}"
    for i, layer in enumerate(layers):
        if hasattr(layer, "bind_kv_cache"):
            layer.bind_kv_cache(kv_cache[:, i])
        else:
            layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
