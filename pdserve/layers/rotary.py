"""Rotary position embedding (the rotate-half layout HF checkpoints use), with every rope type of
HF configs: default, linear, dynamic, yarn, longrope, llama3; and partial rotary (only the first
rotary_dim dims of each head are rotated, as Phi-3/Phi-4-mini and GPT-NeoX).

The frequencies follow transformers' ROPE_INIT_FUNCTIONS; a type's attention scaling (yarn,
longrope) is folded into the cached cos/sin tables, as HF multiplies them, so a backend's kernel
reading the tables gets it too.

Sequence-length-dependent types: transformers recomputes dynamic's and longrope's frequencies per
forward from the sequence length; keys already in a paged KV cache cannot follow, so the tables
here are fixed at load (see docs/API.md, "RoPE scaling"):
  dynamic   transformers' frequencies equal plain RoPE up to max_position_embeddings, and pdserve
            never serves beyond it: exact for every position served.
  longrope  the short factors when the served length (max_model_len) fits in
            original_max_position_embeddings: exact. Longer: the long factors for every position,
            vLLM's static choice; transformers uses them too once a sequence passes the original
            length, but the short ones before (a startup warning says so).

q and k are rotated by torch's ops, or in place by a backend's kernel that the Rope carries
(the CPU backend's: one pass over the views of the qkv product, backends/cpu/layers.py)."""
import logging
import math
from typing import Callable, NamedTuple

import torch
from torch import nn

logger = logging.getLogger("pdserve")

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def default_inv_freq(theta: float, dim: int, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(theta: float, dim: int, p: dict, device=None) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate (divide by factor) the dims that rotate fewer than beta_slow times over the
    original context, keep (extrapolate) those rotating more than beta_fast times, ramp between."""
    factor, old_len = p["factor"], p["original_max_position_embeddings"]
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else yarn_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def dim_of(rotations):   # the dim that turns `rotations` times over the original context
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def longrope_inv_freq(theta: float, dim: int, p: dict, served_len: int, device=None) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-dim rescale factors, the short set within original_max_position_embeddings,
    the long set beyond; chosen once by the served length (module docstring): the rope dict's
    max_model_len (ModelConfig puts the engine's there), else served_len."""
    old_len, served_len = p["original_max_position_embeddings"], p.get("max_model_len") or served_len
    factor = p["factor"]
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(p["long_factor"] if served_len > old_len else p["short_factor"], dtype=torch.float32,
                       device=device)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext * theta ** shape), float(attention)


def rope_inv_freq(params: dict, dim: int, served_len: int, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of the rotary_dim // 2 pairs, attention scaling of cos/sin) for a
    normalised rope dict (ModelConfig.rope_parameters: rope_type, rope_theta and the type's keys)."""
    kind, theta = params.get("rope_type", params.get("type", "default")), params["rope_theta"]
    if kind in ("default", "dynamic"):   # dynamic: plain RoPE at every position served (module docstring)
        return default_inv_freq(theta, dim, device), 1.0
    if kind == "linear":
        return default_inv_freq(theta, dim, device) / params["factor"], 1.0
    if kind == "llama3":
        return llama3_inv_freq(default_inv_freq(theta, dim, device), params), 1.0
    if kind == "yarn":
        return yarn_inv_freq(theta, dim, params, device)
    if kind == "longrope":
        return longrope_inv_freq(theta, dim, params, served_len, device)
    raise ValueError(f"rope type {kind!r} is not one of {', '.join(ROPE_TYPES)}")


class Rope(NamedTuple):
    """cos and sin of each token's position, (T, 1, rotary_dim), and the in-place rotation
    rotate(q, k, cos, sin) of a backend's kernel (None: torch's ops)."""
    cos: torch.Tensor
    sin: torch.Tensor
    rotate: Callable | None = None


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_position). scaling: a rope dict as ModelConfig.rope_scaling
    returns (None: plain RoPE); rotary_dim: the leading dims of each head rotated (default: all)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None, *,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not (0 < self.rotary_dim <= head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {self.rotary_dim}")
        self.params = {**(scaling or {}), "rope_theta": theta}
        kind = self.params.get("rope_type", self.params.get("type", "default"))
        served = self.params.get("max_model_len") or max_position
        old_len = self.params.get("original_max_position_embeddings")
        if kind == "longrope" and served > old_len:
            logger.warning("longrope: serving up to %d positions, past original_max_position_embeddings %d: the "
                           "long factors rotate every position (as vLLM); transformers uses the short ones for "
                           "sequences up to %d tokens (--max-model-len %d serves those exactly)",
                           served, old_len, old_len, old_len)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.init_buffers()

    def init_buffers(self, device=None):
        """cos/sin for every position, looked up by index: no per-step trigonometry. Called again
        by the loader after the model is materialised from the meta device."""
        inv_freq, self.attention_scaling = rope_inv_freq(self.params, self.rotary_dim, self.max_position, device)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32, device=device), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and sin of each position: looked up once per forward for all layers."""
        return Rope(self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))


def get_rope(cfg, layer_type: str | None = None, rotary_dim: int | None = None,
             head_dim: int | None = None) -> RotaryEmbedding:
    """The RotaryEmbedding a model file wants for `cfg` (a ModelConfig): its (layer type's) rope
    parameters, rotary_dim from partial_rotary_factor unless given (head_dim: cfg.head_dim unless given)."""
    params = cfg.rope_parameters(layer_type)
    head_dim = head_dim or cfg.head_dim
    if rotary_dim is None:
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    kind = params["rope_type"]
    return RotaryEmbedding(head_dim, cfg.max_position_embeddings, params["rope_theta"],
                           None if kind == "default" else params, rotary_dim=rotary_dim)


def apply_rotary(rope: Rope, q: torch.Tensor, k: torch.Tensor):
    """rope: RotaryEmbedding.lookup(positions); q: (T, H, D), k: (T, Hkv, D). With a kernel q and
    k are rotated in place (they are views of this step's qkv product). A table narrower than the
    head rotates its leading dims only (partial rotary) and passes the rest through."""
    if rope.rotate is not None:
        rope.rotate(q, k, rope.cos, rope.sin)
        return q, k
    return rotate(q, rope.cos, rope.sin), rotate(k, rope.cos, rope.sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
