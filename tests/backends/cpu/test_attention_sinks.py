"""Attention sinks (gpt-oss: a learned logit per head in every query's softmax denominator): the
torch path equals transformers' gpt-oss eager attention, and the CPU kernels (decode and prefill
chunks, sliding window, fp32 and bf16 caches, sinks far above and below the scores) equal the
torch path, on each kernel build."""
import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from pdserve.backends.cpu import layers
from pdserve.layers.attention import PagedAttention, attention_context, build_metadata
from tests.helpers import attention_torch_and_kernels


def with_sinks(monkeypatch, scale: float):
    """The helper's attention layers get sinks of N(0, scale^2), one per head."""
    class Sunk(layers.CpuPagedAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, sinks=True, **kwargs)
            with torch.no_grad():
                self.sinks.copy_(torch.randn(self.num_heads) * scale)
    monkeypatch.setattr(layers, "CpuPagedAttention", Sunk)


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (8, 2, 64)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink_scale", [2.0, 30.0])   # 30: sinks far past the scores, both ways
def test_kernels_with_sinks_equal_torch(monkeypatch, H, Hkv, D, window, dtype, sink_scale):
    with_sinks(monkeypatch, sink_scale)
    # decodes and prefill chunks in one step: first chunks, later chunks, one-token contexts
    q_lens, ctx = [1, 1, 1, 5, 17, 40], [1, 16, 60, 5, 33, 70]
    want, got = attention_torch_and_kernels(H, Hkv, D, 16, window, dtype, q_lens, ctx, seed=D + H)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [None, 6])
def test_torch_path_equals_transformers_eager_attention(window):
    """One sequence of 23 tokens in a paged cache: our gather + explicit softmax with the sink equals
    transformers' gpt-oss eager attention (its mask: causal, and the window where given)."""
    torch.manual_seed(0)
    H, Hkv, D, T, bs = 4, 2, 16, 23, 8
    attn = PagedAttention(H, Hkv, D, scale=D ** -0.5, sliding_window=window, sinks=True)
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(H))
    cache = torch.zeros(2, 4 * bs, Hkv, D)
    attn.k_cache, attn.v_cache = cache[0], cache[1]
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    table = [2, 0, 3]
    slots = [table[p // bs] * bs + p % bs for p in range(T)]
    _, meta = build_metadata([slots], [([T], [0], [T], [table])], bs, "cpu")
    with attention_context(meta):
        ours = attn(q, k, v).view(T, H, D)

    class Module:   # what eager_attention_forward reads off the attention module
        num_key_value_groups, training, sinks = H // Hkv, False, attn.sinks.detach()
    pos = torch.arange(T)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    want, _ = eager_attention_forward(Module(), q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], mask, scaling=D ** -0.5)
    torch.testing.assert_close(ours, want[0], rtol=1e-5, atol=1e-6)
    # and the sink is not a no-op: without it the output differs
    with attention_context(meta), torch.no_grad():
        attn.sinks.fill_(-1e4)
        assert not torch.allclose(attn(q, k, v).view(T, H, D), ours, atol=1e-3)
