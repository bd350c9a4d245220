"""Weights stored as small integer codes in groups along the input dimension: w = q * scale + offset.

The one form every quantized checkpoint is read into (GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K, AWQ,
GPTQ, compressed-tensors W4A16/W8A16): a loader turns the file's packing into codes and per-group
scales and offsets, and the backends take it from there. The torch path multiplies the
dequantized weight (the linear's ordinary `weight`, filled by the loader); the CPU backend packs
the codes into its kernels' layout instead and frees the dense copy.

Codes: 4-bit are uint8 in 0..15 and always have an offset (GPTQ/AWQ zero points z: offset =
-z * scale; a symmetric int4 is z = 8); 8-bit are int8 in -128..127, offset optional (a zero
point becomes one). A linear's `quant` attribute holds its GroupQuantized; a merged linear's is
the concatenation of its shards' along the output dimension (attach_shard + finish_quantized)."""
from dataclasses import dataclass

import torch
from torch import nn


class QuantFormatError(ValueError):
    """A quantized tensor that does not fit the group form (the loader names the file and tensor)."""


@dataclass
class GroupQuantized:
    q: torch.Tensor                 # (N, K) codes: uint8 for bits=4, int8 for bits=8
    scale: torch.Tensor             # (N, K // group_size) fp32
    offset: torch.Tensor | None     # (N, K // group_size) fp32; required for bits=4
    group_size: int
    bits: int

    def __post_init__(self):
        N, K = self.q.shape
        if self.bits not in (4, 8):
            raise QuantFormatError(f"{self.bits}-bit codes (the group form holds 4 or 8)")
        if self.group_size <= 0 or K % self.group_size:
            raise QuantFormatError(f"group size {self.group_size} does not divide the input size {K}")
        want = torch.uint8 if self.bits == 4 else torch.int8
        if self.q.dtype != want:
            raise QuantFormatError(f"{self.bits}-bit codes must be {want}, got {self.q.dtype}")
        if self.bits == 4 and self.offset is None:
            raise QuantFormatError("4-bit codes need an offset per group")
        groups = (N, K // self.group_size)
        for name, t in (("scale", self.scale), ("offset", self.offset)):
            if t is not None and (tuple(t.shape) != groups or t.dtype != torch.float32):
                raise QuantFormatError(f"{name} must be fp32 {groups}, got {t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The (N, K) fp32 weight the codes stand for."""
        N, K = self.q.shape
        g = self.q.view(N, K // self.group_size, self.group_size).float() * self.scale[..., None]
        if self.offset is not None:
            g += self.offset[..., None]
        return g.view(N, K)


def concat(parts: list[GroupQuantized]) -> GroupQuantized:
    """Shards stacked along the output dimension (q/k/v into qkv): they must agree on the grouping."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.q.shape[1]) != (first.bits, first.group_size, first.q.shape[1]):
            raise QuantFormatError(f"shards of one merged linear disagree: {p.bits}-bit group {p.group_size} "
                                   f"vs {first.bits}-bit group {first.group_size}")
        if (p.offset is None) != (first.offset is None):
            raise QuantFormatError("shards of one merged linear disagree on having offsets")
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])
    return GroupQuantized(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), offset,
                          first.group_size, first.bits)


def attach_shard(module: nn.Linear, shard: int | None, gq: GroupQuantized) -> None:
    """Record a linear's (or one shard of a merged linear's) codes; shard None: the whole linear."""
    if shard is None:
        module.quant = gq
    else:
        module.__dict__.setdefault("_quant_shards", {})[shard] = gq


def finish_quantized(model: nn.Module) -> list[str]:
    """Concatenate each merged linear's shards into its `quant`; returns the names of the merged
    linears that got only some of their shards quantized (the loader refuses those)."""
    partial = []
    for name, m in model.named_modules():
        shards = m.__dict__.pop("_quant_shards", None)
        if shards is None:
            continue
        n = len(getattr(m, "output_sizes", [None]))
        if sorted(shards) != list(range(n)):
            partial.append(name)
            continue
        m.quant = concat([shards[i] for i in range(n)])
    return partial


def quantized_linears(model: nn.Module) -> dict[str, GroupQuantized]:
    return {n: m.quant for n, m in model.named_modules() if isinstance(getattr(m, "quant", None), GroupQuantized)}
