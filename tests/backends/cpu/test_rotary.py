"""The CPU rotary kernel rotates q and k in place exactly as torch's ops do (the CPU backend
swaps it in: test_packed_linear.py)."""
import pytest
import torch

from pdserve.backends.cpu.kernels import cpu_ops
from pdserve.backends.cpu.layers import CpuRotaryEmbedding
from pdserve.layers.rotary import Rope, RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.usefixtures("cpu_isa")


@pytest.mark.parametrize("T,H,Hkv,D", [(1, 14, 2, 64), (37, 8, 4, 32), (5, 4, 4, 128), (3, 2, 1, 20), (300, 16, 8, 16)])
def test_kernel_equals_torch_on_qkv_views(T, H, Hkv, D):
    torch.manual_seed(0)
    rotary = RotaryEmbedding(D, 4096, 10000.0)
    positions = torch.randint(0, 4096, (T,))
    qkv = torch.randn(T, (H + 2 * Hkv) * D) * 3
    def split(t):
        q, k, v = t.split([H * D, Hkv * D, Hkv * D], dim=-1)
        return q.view(T, H, D), k.view(T, Hkv, D), v
    rope = rotary.lookup(positions, torch.float32)
    assert rope.rotate is None
    want_q, want_k = apply_rotary(rope, *split(qkv)[:2])
    got = qkv.clone()
    q, k, v = split(got)
    rope = Rope(rope.cos, rope.sin, cpu_ops().rotary_embedding)
    out_q, out_k = apply_rotary(rope, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()   # in place, in the qkv product
    assert torch.equal(out_q, want_q) and torch.equal(out_k, want_k)   # the same roundings as torch's ops
    assert torch.equal(v, split(qkv)[2])                                # v untouched


def test_lookup_asks_for_the_kernel_only_in_fp32():
    rotary = CpuRotaryEmbedding(32, 64, 10000.0)
    positions = torch.arange(4)
    assert rotary.lookup(positions, torch.float32).rotate is cpu_ops().rotary_embedding
    assert rotary.lookup(positions, torch.bfloat16).rotate is None
    assert RotaryEmbedding(32, 64, 10000.0).lookup(positions, torch.float32).rotate is None


@pytest.mark.parametrize("T,H,Hkv,D,R", [(1, 14, 2, 64, 48), (37, 8, 4, 32, 16), (5, 4, 1, 256, 128), (3, 2, 1, 20, 6)])
def test_partial_rotary_rotates_the_first_dims(T, H, Hkv, D, R):
    """A partial rotary (Phi-4-mini): cos/sin R wide rotate dims i and i + R/2 of the first R; the rest pass through."""
    torch.manual_seed(0)
    rotary = RotaryEmbedding(R, 4096, 10000.0)   # a partial rotary's tables: the frequencies of R dims
    rope = rotary.lookup(torch.randint(0, 4096, (T,)), torch.float32)
    qkv = torch.randn(T, (H + 2 * Hkv) * D) * 3
    got = qkv.clone()
    q, k = got[:, :H * D].view(T, H, D), got[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    cpu_ops().rotary_embedding(q, k, rope.cos, rope.sin)
    for x, ref in ((q, qkv[:, :H * D].view(T, H, D)), (k, qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D))):
        want_rot = apply_rotary(rope, ref[..., :R], ref[..., :R])[0]
        assert torch.equal(x[..., :R], want_rot)
        assert torch.equal(x[..., R:], ref[..., R:])
    assert torch.equal(got[:, (H + Hkv) * D:], qkv[:, (H + Hkv) * D:])


def test_rotary_tables_wider_than_the_head_are_refused():
    q, k = torch.zeros(2, 2, 16), torch.zeros(2, 1, 16)
    with pytest.raises(RuntimeError, match="as wide as the head or narrower"):
        cpu_ops().rotary_embedding(q, k, torch.zeros(2, 1, 32), torch.zeros(2, 1, 32))
