"""A model's decoder layers as one C++ call (kernels/decoder_cpu.cpp: DecoderStack), built from the
recipe the model declares (models/decoder_spec.py): each layer's tensors are collected by name
from the modules the recipe names, and the stack checks every name and shape it is given.

Why one call: the same kernels in the same order as the modules, without ~25 module calls and ~20
torch ops per layer between them, and without the GIL for the whole forward."""
import torch
from torch import nn

from pdserve.backends.cpu.kernels import cpu_ops
from pdserve.backends.cpu.packed_linear import PackedLinear
from pdserve.backends.cpu.quant_linear import QuantLinear
from pdserve.layers.attention import PagedAttention
from pdserve.layers.layernorm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.models.decoder_spec import DecoderSpec


class Unsupported(ValueError):
    """The stack cannot run this model: its modules run it layer by layer instead."""


def _norm(m: nn.Module, name: str) -> tuple[str, float, dict[str, torch.Tensor]]:
    """(kind, eps, tensors by name) of a norm module. An RMSNorm's weight_offset (Gemma's norm(x)
    * (1 + w)) is folded into the weight the stack takes."""
    if isinstance(m, RMSNorm):
        weight, offset = m.weight.detach().float(), getattr(m, "weight_offset", 0.0)
        return "rms", m.eps, {f"{name}weight": weight + offset if offset else weight}
    if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
        tensors = {f"{name}{k}": t.detach().float() for k, t in (("weight", m.weight), ("bias", m.bias)) if t is not None}
        return "layer", m.eps, tensors
    raise Unsupported(f"a {type(m).__name__} norm")


def _linear(m: nn.Module, name: str) -> dict[str, torch.Tensor]:
    if not isinstance(m, (PackedLinear, QuantLinear)):
        raise Unsupported(f"{name} is a {type(m).__name__}, not a packed linear")
    tensors = {f"{name}.packed": m.packed}
    if m.scale.numel():
        tensors[f"{name}.scale"] = m.scale
    if isinstance(m, QuantLinear) and m.offset.numel():
        tensors[f"{name}.offset"] = m.offset
    if m.bias is not None:
        tensors[f"{name}.bias"] = m.bias.detach().float()
    return tensors


NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")   # a layer's, by role


def rotary_tables(model: nn.Module, spec: DecoderSpec) -> tuple[list[RotaryEmbedding], list[int]]:
    """The distinct RotaryEmbeddings of the layers (each looked up once per step: backend.py) and
    each layer's index among them, -1 where it has no RoPE."""
    modules, index = [], []
    for i in range(len(model.get_submodule(spec.layers))):
        name = spec.rotary_of(i)
        if name is None:
            index.append(-1)
            continue
        m = model.get_submodule(name)
        if not isinstance(m, RotaryEmbedding):
            raise Unsupported(f"{name} is not a RotaryEmbedding")
        if not any(m is r for r in modules):
            modules.append(m)
        index.append(next(j for j, r in enumerate(modules) if r is m))
    return modules, index


def stack_arguments(model: nn.Module, spec: DecoderSpec) -> dict:
    """DecoderStack's arguments for `model` (packed, its KV cache views bound): the recipe, the
    sizes from the modules, and each layer's tensors by name. Raises Unsupported with the reason
    where a module is not one the stack has a kernel for."""
    layers = model.get_submodule(spec.layers)
    roles = [role for role in NORMS if getattr(spec, role) is not None]
    norms, tensors, windows, caps = set(), [], [], set()
    for layer in layers:
        t = {}
        for role in roles:
            kind, eps, named = _norm(layer.get_submodule(getattr(spec, role)), f"{role}.")
            norms.add((kind, eps))
            t.update(named)
        for role in ("qkv", "o", "up", "down"):
            t.update(_linear(layer.get_submodule(getattr(spec, role)), role))
        attn = layer.get_submodule(spec.attention)
        if not isinstance(attn, PagedAttention) or attn.k_cache is None:
            raise Unsupported(f"{spec.attention} is not a paged attention with its cache bound")
        if getattr(attn, "sinks", None) is not None:
            raise Unsupported("attention sinks (the stack's attention has none)")
        windows.append(attn.sliding_window or 0)
        caps.add(attn.logit_softcap or 0.0)
        t["k_cache"], t["v_cache"] = attn.k_cache, attn.v_cache
        tensors.append(t)
    final = {}
    if spec.final_norm is not None:
        kind, eps, final = _norm(model.get_submodule(spec.final_norm), "")
        norms.add((kind, eps))
    if len(norms) != 1:
        raise Unsupported(f"norms of more than one kind or eps: {sorted(norms)}")
    if len(caps) != 1:
        raise Unsupported(f"layers with different attention soft caps: {sorted(caps)}")
    (kind, eps), = norms
    attn = layers[0].get_submodule(spec.attention)
    return dict(layers=tensors, final_norm=final, has_final_norm=spec.final_norm is not None, norm=kind,
                norm_position=spec.norm_position, norms=roles, rotary=rotary_tables(model, spec)[1],
                activation=spec.activation, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                head_dim=attn.head_dim, intermediate_size=layers[0].get_submodule(spec.down).in_features, eps=eps,
                scale=attn.scale, windows=windows, softcap=caps.pop(), residual_multiplier=spec.residual_multiplier)


def build_stack(model: nn.Module, spec: DecoderSpec):
    """The DecoderStack of `model`; Unsupported with the reason where the stack cannot run it."""
    args = stack_arguments(model, spec)
    try:
        return cpu_ops().DecoderStack(**args)
    except (ValueError, RuntimeError) as e:   # the stack's own checks: a recipe or a tensor it cannot run
        raise Unsupported(str(e).splitlines()[0]) from e
