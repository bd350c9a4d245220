"""The CPU fused-MoE kernel (kernels/moe_cpu.cpp) equals the torch reference, layers/moe.py's
FusedMoE, on each kernel build: fp32, bf16, int8 (per channel and per group) and MXFP4 experts,
decode-sized and prefill-sized batches, experts chosen by no token, by one, by many, sizes that are
no multiple of the vector width."""
import pytest
import torch

from pdserve.backends.cpu.kernels import cpu_ops
from pdserve.backends.cpu.layers import CpuFusedMoE
from pdserve.layers.moe import FusedMoE, Routing, select_experts

pytestmark = pytest.mark.usefixtures("cpu_isa")


def experts(E: int, H: int, I: int, dtype: torch.dtype, seed: int = 0) -> FusedMoE:
    torch.manual_seed(seed)
    moe = FusedMoE(E, H, I)
    with torch.no_grad():
        moe.gate_up_proj.copy_(torch.randn(E, 2 * I, H) / H ** 0.5)
        moe.down_proj.copy_(torch.randn(E, H, I) / I ** 0.5)
    return moe.to(dtype)


def routed(T: int, H: int, E: int, k: int, seed: int = 1):
    torch.manual_seed(seed)
    x = torch.randn(T, H)
    logits = torch.randn(T, E) * 2
    weights, ids = select_experts(logits, Routing(num_experts=E, top_k=k, renormalize=True))
    return x, weights, ids


@pytest.mark.parametrize("T, E, k, H, I", [
    (1, 8, 2, 64, 32),        # a decode step
    (5, 8, 2, 64, 32),
    (37, 16, 3, 72, 40),      # H and I no multiple of the vector width, experts with no token
    (200, 64, 8, 128, 48),    # a prefill chunk, Qwen3-MoE's top 8
    (3, 4, 4, 33, 17),        # every expert, odd sizes
])
def test_fp32_experts_equal_torch(T, E, k, H, I):
    moe = experts(E, H, I, torch.float32)
    x, weights, ids = routed(T, H, E, k)
    want = moe(x, weights, ids)
    got = cpu_ops().fused_moe(x, weights, ids, moe.gate_up_proj.detach(), moe.down_proj.detach())
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T, E, k", [(1, 8, 2), (64, 16, 4)])
def test_bf16_experts_equal_torch_on_their_values(T, E, k):
    """bf16 experts: the kernel widens each weight exactly and computes in fp32, as torch does on
    the same values in fp32."""
    moe = experts(E, 96, 64, torch.bfloat16)
    x, weights, ids = routed(T, 96, E, k)
    got = cpu_ops().fused_moe(x, weights, ids, moe.gate_up_proj.detach(), moe.down_proj.detach())
    want = moe.float()(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_layer_swap_runs_the_kernel_in_the_models_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        moe = experts(8, 64, 32, dtype)
        x, weights, ids = routed(9, 64, 8, 2)
        want = moe(x.to(dtype), weights, ids)
        moe.__class__ = CpuFusedMoE
        got = moe(x.to(dtype), weights, ids)
        assert got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 5e-2   # torch's bf16 products round each step
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_many_tokens_an_expert_take_the_gemms_few_the_kernel(monkeypatch):
    """A step whose selected experts get GEMM_TOKENS_PER_EXPERT pairs each (a prefill chunk) runs
    the torch layer's per-expert GEMMs; a decode-sized step runs the kernel."""
    from pdserve.backends.cpu import layers
    calls = []
    ops = cpu_ops()

    class Counting:
        def fused_moe(self, *args, **kwargs):
            calls.append(args[0].shape[0])
            return ops.fused_moe(*args, **kwargs)

    monkeypatch.setattr(layers, "cpu_ops", lambda: Counting())
    for dtype in (torch.float32, torch.bfloat16):
        moe = experts(8, 64, 32, dtype)
        for T, kernel in ((1, True), (3, True), (64, False)):   # 2 or 6 pairs on distinct experts; 128 on 8
            x, weights, ids = routed(T, 64, 8, 2)
            want = moe(x.to(dtype), weights, ids)
            moe.__class__ = CpuFusedMoE
            calls.clear()
            got = moe(x.to(dtype), weights, ids)
            moe.__class__ = FusedMoE
            assert calls == ([T] if kernel else []), (dtype, T)
            if not kernel:   # the torch layer itself
                assert torch.equal(got, want)


def test_experts_move_onto_huge_pages_unchanged():
    from pdserve.backends.cpu.layers import experts_on_hugepages
    moe = gpt_oss_experts(8, 64, 32, mxfp4=True)
    moe.__class__ = CpuFusedMoE
    before = {n: (t.detach().clone(), t.data_ptr()) for n, t in moe.named_parameters()}
    assert experts_on_hugepages(torch.nn.ModuleDict({"mlp": moe})) == 4   # blocks and scales of both stacks
    for n, t in moe.named_parameters():
        assert torch.equal(t, before[n][0])
        assert (t.data_ptr() != before[n][1]) == (not n.endswith("_bias")), n
    x, weights, ids = routed(2, 64, 8, 2)
    assert torch.isfinite(moe(x, weights, ids)).all()


def test_bad_arguments_are_refused():
    moe = experts(4, 32, 16, torch.float32)
    x, weights, ids = routed(3, 32, 4, 2)
    w13, w2 = moe.gate_up_proj.detach(), moe.down_proj.detach()
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops().fused_moe(x, weights, torch.full_like(ids, 4), w13, w2)
    with pytest.raises(RuntimeError, match="of one dtype"):
        cpu_ops().fused_moe(x, weights, ids, w13, w2.bfloat16())
    with pytest.raises(RuntimeError, match="w13 must be"):
        cpu_ops().fused_moe(x[:, :16].contiguous(), weights, ids, w13, w2)


# ---------------------------------------------------------------- int8 experts (--quantization int8)

def dequantized(moe: CpuFusedMoE) -> FusedMoE:
    """The torch layer on the values the int8 codes stand for."""
    ref = FusedMoE(moe.num_experts, moe.hidden_size, moe.intermediate_size)
    pairs = [moe.expert(e, torch.float32) for e in range(moe.num_experts)]
    with torch.no_grad():
        ref.gate_up_proj.copy_(torch.stack([p[0] for p in pairs]))
        ref.down_proj.copy_(torch.stack([p[1] for p in pairs]))
    return ref


@pytest.mark.parametrize("group", [None, 16], ids=["per-channel", "g16"])
@pytest.mark.parametrize("T, E, k, H, I", [(1, 8, 2, 64, 32), (37, 16, 3, 80, 48), (200, 64, 8, 128, 96)])
def test_int8_experts_equal_torch_on_their_values(group, T, E, k, H, I):
    moe = experts(E, H, I, torch.float32)
    dense = moe.gate_up_proj.detach().clone()
    moe.__class__ = CpuFusedMoE
    moe.quantize_int8(group)
    assert moe.int8 and not hasattr(moe, "gate_up_proj") and moe.gate_up_proj_q.dtype == torch.int8
    assert moe.gate_up_proj_scale.shape == (E, 2 * I, H // (group or H))
    ref = dequantized(moe)
    assert 0 < (ref.gate_up_proj - dense).abs().max() < 0.02   # the codes round, a little
    x, weights, ids = routed(T, H, E, k)
    torch.testing.assert_close(moe(x, weights, ids), ref(x, weights, ids), rtol=1e-5, atol=1e-5)


def test_int8_experts_of_odd_sizes_per_channel():
    moe = experts(4, 33, 17, torch.float32)
    moe.__class__ = CpuFusedMoE
    moe.quantize_int8()
    x, weights, ids = routed(3, 33, 4, 4)
    torch.testing.assert_close(moe(x, weights, ids), dequantized(moe)(x, weights, ids), rtol=1e-5, atol=1e-5)


def test_bad_int8_scales_are_refused():
    moe = experts(4, 32, 16, torch.float32)
    moe.__class__ = CpuFusedMoE
    moe.quantize_int8(16)
    x, weights, ids = routed(3, 32, 4, 2)
    q13, q2, s13, s2 = moe.gate_up_proj_q, moe.down_proj_q, moe.gate_up_proj_scale, moe.down_proj_scale
    with pytest.raises(RuntimeError, match="int8 scales"):
        cpu_ops().fused_moe(x, weights, ids, q13, q2, s13=s13[:, :, :1].repeat(1, 1, 3).contiguous(), s2=s2)
    with pytest.raises(RuntimeError, match="int8 scales"):
        cpu_ops().fused_moe(x, weights, ids, q13, q2, s13=s13.double(), s2=s2)
    with pytest.raises(RuntimeError, match="both scales"):
        cpu_ops().fused_moe(x, weights, ids, q13, q2, s13=s13)


# ---------------------------------------------------------------- gpt-oss's experts: biases, clamped SwiGLU, MXFP4

def gpt_oss_experts(E: int, H: int, I: int, mxfp4: bool, seed: int = 2) -> FusedMoE:
    """Experts with biases and gpt-oss's clamp (a limit the products pass), dense fp32 or MXFP4."""
    from pdserve.quantization.mxfp4 import quantize
    torch.manual_seed(seed)
    moe = FusedMoE(E, H, I, bias=True, swiglu=(1.702, 1.0), mxfp4=mxfp4)
    w13, w2 = torch.randn(E, 2 * I, H) * 2 / H ** 0.5, torch.randn(E, H, I) / I ** 0.5
    with torch.no_grad():
        if mxfp4:
            for name, w in (("gate_up_proj", w13), ("down_proj", w2)):
                blocks, scales = quantize(w)
                # every FP4 code, -0 (8) included, in both nibbles: each decodes in the kernel
                assert len((blocks & 15).unique()) == len((blocks >> 4).unique()) == 16
                getattr(moe, f"{name}_blocks").copy_(blocks)
                getattr(moe, f"{name}_scales").copy_(scales)
        else:
            moe.gate_up_proj.copy_(w13)
            moe.down_proj.copy_(w2)
        moe.gate_up_proj_bias.copy_(torch.randn(E, 2 * I) * 0.5)
        moe.down_proj_bias.copy_(torch.randn(E, H) * 0.5)
    return moe


@pytest.mark.parametrize("mxfp4", [False, True], ids=["dense", "mxfp4"])
@pytest.mark.parametrize("T, E, k, H, I", [(1, 8, 2, 64, 32), (37, 16, 4, 96, 64), (200, 32, 4, 128, 96)])
def test_gpt_oss_experts_equal_torch(mxfp4, T, E, k, H, I):
    moe = gpt_oss_experts(E, H, I, mxfp4)
    x, weights, ids = routed(T, H, E, k)
    want = moe(x * 2, weights, ids)
    h = torch.nn.functional.linear(x * 2, moe.expert(int(ids[0, 0]), torch.float32)[0])
    assert (h.abs() > 1.0).any()   # the clamp bites
    moe.__class__ = CpuFusedMoE
    got = moe(x * 2, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_experts_with_biases_and_clamp_equal_torch_on_their_values():
    moe = gpt_oss_experts(8, 64, 32, mxfp4=False)
    moe.gate_up_proj.data, moe.down_proj.data = moe.gate_up_proj.data.bfloat16(), moe.down_proj.data.bfloat16()
    x, weights, ids = routed(19, 64, 8, 2)
    got = cpu_ops().fused_moe(x, weights, ids, moe.gate_up_proj.detach(), moe.down_proj.detach(),
                              b13=moe.gate_up_proj_bias.detach(), b2=moe.down_proj_bias.detach(),
                              swiglu_alpha=1.702, swiglu_limit=1.0)
    moe.gate_up_proj.data, moe.down_proj.data = moe.gate_up_proj.data.float(), moe.down_proj.data.float()
    torch.testing.assert_close(got, moe(x, weights, ids), rtol=1e-5, atol=1e-5)


def test_mxfp4_experts_stay_mxfp4_and_bad_blocks_are_refused():
    moe = gpt_oss_experts(4, 64, 32, mxfp4=True)
    assert {p.dtype for n, p in moe.named_parameters() if "bias" not in n} == {torch.uint8}
    x, weights, ids = routed(3, 64, 4, 2)
    b, s = moe.gate_up_proj_blocks.detach(), moe.gate_up_proj_scales.detach()
    with pytest.raises(RuntimeError, match="scales"):
        cpu_ops().fused_moe(x, weights, ids, b, moe.down_proj_blocks.detach(), s13=s[:, :, :1].contiguous(),
                            s2=moe.down_proj_scales.detach())
