"""The decoder stack's optional parts (models/decoder_spec.py): q/k norms over each head (Qwen3,
Gemma 3) or the whole projection (OLMo 2), blocks without a pre-norm (OLMo 2), post-block norms
(Gemma, OLMo 2) with Gemma's weight offset, a residual multiplier (Granite), per-layer rotary
tables (Gemma 3's two bases, SmolLM3's layers without RoPE), a partial rotary (Phi-4-mini), GeGLU,
soft-capped attention (Gemma 2) and head size 256.

The families that use them land separately, so each test model is the tiny Llama with the parts
added to its live modules (random norm weights). The modules run them on the kernels the stack
calls, in the same order (their q/k norms, offset norms and GeGLU call the same kernels; the soft
cap is the attention kernels' own), so in fp32 the stack must equal them bitwise, in steps that
mix decodes and prefill chunks. The kernels themselves are checked against torch in
test_activation.py, test_rotary.py, test_norm.py and the attention tests."""
import dataclasses

import pytest
import torch
from torch import nn

from pdserve import LLM
from pdserve.backends.cpu.kernels import cpu_ops
from pdserve.backends.cpu.layers import CpuRotaryEmbedding, use_kernel_layers
from pdserve.backends.cpu.stack import Unsupported, stack_arguments
from pdserve.layers.layernorm import RMSNorm
from pdserve.layers.rotary import apply_rotary
from pdserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel
from tests.backends.cpu.test_decoder_stack import CountingStack, generate, logprob_error, stack_owner
from tests.helpers import corpus_prompts

pytestmark = pytest.mark.usefixtures("cpu_isa")


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: norm(x) * (1 + w). In fp32 on the norm kernels with the weight 1 + w, as
    the stack folds it; torch's ops otherwise."""
    weight_offset = 1.0

    def forward(self, x, residual=None):
        w = self.weight.float() + self.weight_offset   # in fp32, as Gemma's reference
        if x.dtype != torch.float32:
            if residual is not None:
                residual = x + residual
                x = residual
            h = x.float()
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)
            return h if residual is None else (h, residual)
        if residual is None:
            return cpu_ops().rms_norm(x.contiguous(), w, self.eps)
        x = x.contiguous()
        cpu_ops().fused_add_rms_norm(x, residual, w, self.eps)
        return x, residual


class GeluTanhAndMul(nn.Module):
    """GeGLU: gelu(gate, approximate="tanh") * up; in fp32 by the kernel the stack calls."""

    def forward(self, x):
        if x.dtype == torch.float32:
            return cpu_ops().gelu_tanh_and_mul(x.contiguous())
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up


def join(norm, x, residual):
    """x joins the stream (x is the stream where residual is None): (the block's input, the stream)."""
    if residual is None:
        return (x if norm is None else norm(x)), x
    if norm is not None:
        return norm(x, residual)
    residual = x + residual
    return residual, residual


class PartsAttention(LlamaAttention):
    """q_norm, k_norm: set by add_parts (None: none)."""

    def forward(self, rope, x):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], dim=-1)
        q, k = self.norm_heads(self.q_norm, q), self.norm_heads(self.k_norm, k)
        q, k = q.view(T, self.H, self.D), k.view(T, self.Hkv, self.D)
        if rope is not None:
            q, k = apply_rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v.view(T, self.Hkv, self.D)))

    @staticmethod
    def norm_heads(norm, x):
        """norm over rows of its weight's size: each head's, or the whole projection's."""
        return x if norm is None else norm(x.reshape(-1, norm.weight.numel())).view(x.shape[0], -1)


class PartsLayer(LlamaDecoderLayer):
    """post_attn_norm, post_mlp_norm, r: set by add_parts (None: no norm)."""

    def forward(self, rope, x, residual):
        h, residual = join(self.input_layernorm, x, residual)
        h, residual = join(self.post_attention_layernorm, self.leave(self.post_attn_norm, self.self_attn(rope, h)),
                           residual)
        return self.leave(self.post_mlp_norm, self.mlp(h)), residual

    def leave(self, norm, y):
        if norm is not None:
            y = norm(y)
        return y * self.r if self.r != 1.0 else y


class PartsModel(LlamaModel):
    layer_rotary: list = None   # each layer's rotary module's name here, None: no RoPE

    def forward(self, input_ids, positions):
        x = self.embed_tokens(input_ids)
        ropes = {name: self.get_submodule(name).lookup(positions, x.dtype) for name in set(self.layer_rotary) - {None}}
        residual = None
        for name, layer in zip(self.layer_rotary, self.layers):
            x, residual = layer(ropes.get(name), x, residual)
        return self.norm(x, residual)[0]


def add_parts(model, qk_norm=None, pre_norms=True, post_norms=False, offset=False, r=1.0, rotary=("rotary",) * 2,
              partial=None, local_theta=None, geglu=False, softcap=None):
    """Give the tiny Llama `model` (loaded, packed, its cache bound) the parts; returns its recipe.
    qk_norm: "head" | "projection"; rotary: each layer's rotary module ("rotary", "local" with
    local_theta, "partial" of `partial` dims, None: no RoPE)."""
    g = torch.Generator().manual_seed(0)
    inner, (H, Hkv, D) = model.model, (lambda a: (a.H, a.Hkv, a.D))(model.model.layers[0].self_attn)
    eps, dtype = inner.norm.eps, inner.norm.weight.dtype
    inner.__class__ = PartsModel
    inner.layer_rotary = [None if n is None else f"rotary_{n}" if n != "rotary" else "rotary" for n in rotary]
    if local_theta is not None:
        inner.rotary_local = CpuRotaryEmbedding(D, inner.rotary.max_position, local_theta)
    if partial is not None:   # a partial rotary's tables: the inverse frequencies of its first dims only
        inner.rotary_partial = CpuRotaryEmbedding(partial, inner.rotary.max_position, inner.rotary.theta)
    norm_class = OffsetRMSNorm if offset else RMSNorm

    def new_norm(n):
        m = norm_class(n, eps)
        with torch.no_grad():
            m.weight.copy_((0.0 if offset else 1.0) + 0.1 * torch.randn(n, generator=g))
        return m.to(dtype)
    if offset:
        for m in inner.modules():
            if isinstance(m, RMSNorm):
                m.__class__ = OffsetRMSNorm
    for layer in inner.layers:
        layer.__class__, layer.self_attn.__class__ = PartsLayer, PartsAttention
        layer.r, layer.post_attn_norm, layer.post_mlp_norm = r, None, None
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
        if not pre_norms:
            layer.input_layernorm = layer.post_attention_layernorm = None
        if post_norms:
            layer.post_attn_norm, layer.post_mlp_norm = new_norm(inner.norm.weight.numel()), new_norm(inner.norm.weight.numel())
        if qk_norm is not None:
            per = {"head": (D, D), "projection": (H * D, Hkv * D)}[qk_norm]
            layer.self_attn.q_norm, layer.self_attn.k_norm = new_norm(per[0]), new_norm(per[1])
        if geglu:
            layer.mlp.act = GeluTanhAndMul()
        layer.self_attn.attn.logit_softcap = softcap
    use_kernel_layers(model, attention=True)   # the new RMSNorms onto the kernels
    spec = model.decoder_spec()
    names = [None if n is None else f"model.{n}" for n in inner.layer_rotary]
    return dataclasses.replace(
        spec, attn_norm=spec.attn_norm if pre_norms else None, mlp_norm=spec.mlp_norm if pre_norms else None,
        q_norm=qk_norm and "self_attn.q_norm", k_norm=qk_norm and "self_attn.k_norm",
        post_attn_norm="post_attn_norm" if post_norms else None, post_mlp_norm="post_mlp_norm" if post_norms else None,
        residual_multiplier=r, activation="gelu_tanh_and_mul" if geglu else spec.activation,
        rotary=None, layer_rotary=tuple(names))


GEMMA = dict(qk_norm="head", post_norms=True, offset=True, geglu=True, softcap=5.0, local_theta=100.0,
             rotary=("local", "rotary"))
VARIANTS = {   # name: (tiny Llama config overrides, parts, engine arguments)
    "qwen3-qk-norm": ({}, dict(qk_norm="head"), {}),
    "olmo2": ({}, dict(qk_norm="projection", pre_norms=False, post_norms=True), {}),
    "granite": ({}, dict(r=0.5), {}),
    "smollm3-no-rope-layer": ({}, dict(rotary=("rotary", None)), {}),
    "phi4-partial-rotary": ({}, dict(partial=12, rotary=("partial", "partial")), {}),
    "gemma": ({}, GEMMA, {}),
    "gemma-head-256": ({"head_dim": 256}, GEMMA, {}),
    "gemma-int8": ({}, GEMMA, {"quantization": "int8"}),
    "olmo2-int8": ({}, dict(qk_norm="projection", pre_norms=False, post_norms=True, r=0.7), {"quantization": "int8"}),
}


def parts_llm(make_tiny, variant, **kwargs) -> LLM:
    overrides, parts, engine_kwargs = VARIANTS[variant]
    # a small budget: long prompts are prefilled in chunks while the short ones decode
    llm = LLM(make_tiny("llama", **overrides), max_num_batched_tokens=48, max_num_seqs=8, **engine_kwargs, **kwargs)
    model, backend = llm.engine.runner.model, stack_owner(llm)
    spec = add_parts(model, **parts)
    model.decoder_spec = lambda: spec
    backend.attach_cache(model)   # the stack again, from the new recipe
    assert backend.stack is not None, backend.why_no_stack
    return llm


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stack_parts_equal_modules(make_tiny, variant):
    llm = parts_llm(make_tiny, variant)
    backend = stack_owner(llm)
    prompts = corpus_prompts(llm.tokenizer, lens=[3, 70, 17, 1, 40])
    backend.stack = CountingStack(backend.stack)
    fused = generate(llm, prompts)
    calls, first_rows, stack = backend.stack.calls, backend.stack.first_rows, backend.stack.stack
    backend.stack = None
    llm.engine.reset_prefix_cache()   # the same schedule again: nothing from the first run's cache
    modules = generate(llm, prompts)
    backend.stack = stack
    assert calls > 10 and {-1, 0} <= first_rows, (calls, first_rows)
    assert fused == modules
    llm.engine.block_manager.check_all_free()


def test_bfloat16_stack_parts_as_close_to_float32_as_modules(make_tiny):
    """bf16 weights and cache: the stack keeps fp32 activations (the modules run bf16 torch ops)."""
    fp32, bf16 = parts_llm(make_tiny, "gemma"), parts_llm(make_tiny, "gemma", dtype="bfloat16")
    backend = stack_owner(bf16)
    assert bf16.engine.runner.kv_cache.dtype.itemsize == 2
    prompts = corpus_prompts(fp32.tokenizer, lens=[3, 70, 17, 1, 40])
    ref = generate(fp32, prompts)
    stacked = generate(bf16, prompts)
    backend.stack, stack = None, backend.stack
    modules = generate(bf16, prompts)
    backend.stack = stack
    stack_error, modules_error = logprob_error(stacked, ref), logprob_error(modules, ref)
    assert stack_error < modules_error, (stack_error, modules_error)


def test_the_stack_checks_the_parts(make_tiny):
    """Each part's tensors are checked by name and size, and a recipe the stack cannot run is refused."""
    llm = parts_llm(make_tiny, "olmo2")
    model = llm.engine.runner.model
    good = stack_arguments(model, model.decoder_spec())
    assert good["norms"] == ["q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"]
    assert cpu_ops().DecoderStack(**good).num_layers == 2

    def broken(layer=None, **changes):
        args = {**good, **changes}
        if layer is not None:
            args["layers"] = [dict(good["layers"][0]), layer(dict(good["layers"][1]))]
        return args
    cases = [
        (broken(lambda t: {**t, "q_norm.weight": t["q_norm.weight"][:7]}), "q_norm.weight must be a contiguous fp32 vector"),
        (broken(lambda t: {k: v for k, v in t.items() if k != "k_norm.weight"}), "needs the tensor k_norm.weight"),
        (broken(lambda t: {**t, "attn_norm.weight": t["post_attn_norm.weight"]}), "takes no tensor attn_norm.weight"),
        (broken(norms=good["norms"] + ["pre_norm"]), "no norm named pre_norm"),
        (broken(norm="layer"), "q_norm and k_norm are RMSNorms"),
        (broken(norm_position="post", has_final_norm=False, final_norm={}), "a post-norm stack has both block norms"),
        (broken(rotary=[0]), "one rotary table per layer"),
        (broken(softcap=-1.0), "softcap must be >= 0"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            cpu_ops().DecoderStack(**args)
    for a in model.modules():
        if hasattr(a, "logit_softcap"):
            a.logit_softcap = 3.0
            break
    with pytest.raises(Unsupported, match="different attention soft caps"):
        stack_arguments(model, model.decoder_spec())
