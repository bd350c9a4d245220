"""Rotary position embedding (the rotate-half layout HF checkpoints use), with llama3 scaling.

q and k are rotated by torch's ops, or in place by a backend's kernel that the Rope carries
(the CPU backend's: one pass over the views of the qkv product, backends/cpu/layers.py)."""
import math
from typing import Callable, NamedTuple

import torch
from torch import nn


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency remap: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class Rope(NamedTuple):
    """cos and sin of each token's position, (T, 1, D), and the in-place rotation
    rotate(q, k, cos, sin) of a backend's kernel (None: torch's ops)."""
    cos: torch.Tensor
    sin: torch.Tensor
    rotate: Callable | None = None


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.init_buffers()

    def init_buffers(self, device=None):
        """cos/sin for every position, looked up by index: no per-step trigonometry. Called again
        by the loader after the model is materialised from the meta device."""
        D = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D))
        if self.scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, self.scaling)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32, device=device), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and sin of each position: looked up once per forward for all layers."""
        return Rope(self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))


def apply_rotary(rope: Rope, q: torch.Tensor, k: torch.Tensor):
    """rope: RotaryEmbedding.lookup(positions); q: (T, H, D), k: (T, Hkv, D). With a kernel q and
    k are rotated in place (they are views of this step's qkv product)."""
    if rope.rotate is not None:
        rope.rotate(q, k, rope.cos, rope.sin)
        return q, k
    cos, sin = rope.cos, rope.sin
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
