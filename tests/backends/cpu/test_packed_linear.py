"""The CPU packed linear kernel: equal to F.linear for every row count and shape, in fp32, bf16
and int8; the engine uses it by default on CPU and still matches transformers (test_exact.py);
int8 weights stay close to fp32 (top-5 agreement, measured in docs/BENCHMARKS.md)."""
import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.backends.cpu.kernels import cpu_ops, cpu_supports_bf16_dot
from pdserve.backends.cpu.layers import CpuPagedAttention, CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul
from pdserve.backends.cpu.packed_linear import PackedLinear, TiedPackedEmbedding
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.attention import PagedAttention
from pdserve.layers.layernorm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding
from tests.helpers import corpus_prompts, tokens_before_divergence

pytestmark = pytest.mark.usefixtures("cpu_isa")


def _linear(n_out, n_in, bias):
    torch.manual_seed(n_out * 7 + n_in)
    lin = torch.nn.Linear(n_in, n_out, bias=bias)
    return lin


# output sizes that are and are not multiples of the 64-channel tile; K not a multiple of the k-block
@pytest.mark.parametrize("n_out,n_in", [(64, 32), (200, 96), (896, 300), (1000, 260)])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 32, 97, 200])
def test_fp32_equals_linear(n_out, n_in, rows):
    lin = _linear(n_out, n_in, bias=True)
    x = torch.randn(rows, n_in)
    got = PackedLinear(lin, "fp32")(x)
    want = F.linear(x, lin.weight, lin.bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_big_outputs_come_from_the_pool_of_freed_buffers():
    ops = cpu_ops()
    lin = _linear(4096, 64, bias=False)
    packed = PackedLinear(lin, "fp32")
    x = torch.randn(777, 64)   # a 12.1 MiB output: pooled (8 MiB and more), in a 14 MiB block
    want = F.linear(x, lin.weight)
    y = packed(x)
    cached = ops.pool_cached_bytes()
    del y   # its buffer goes back to the pool instead of to the OS
    assert ops.pool_cached_bytes() - cached == 14 << 20
    for _ in range(3):   # and the next outputs reuse it: right values, nothing new cached
        torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)
        assert ops.pool_cached_bytes() == cached + (14 << 20)
    act = ops.silu_and_mul(torch.randn(600, 2 * 4096))   # SwiGLU's 9.4 MiB output: pooled too
    act_bytes, cached = act.numel() * 4, ops.pool_cached_bytes()
    del act
    assert ops.pool_cached_bytes() - cached >= act_bytes
    small = packed(torch.randn(2, 64))   # 32 KiB: torch.empty's, not the pool's
    cached = ops.pool_cached_bytes()
    del small
    assert ops.pool_cached_bytes() == cached


def test_keeps_leading_dims_and_dtype():
    lin = _linear(128, 64, bias=False)
    x = torch.randn(3, 4, 64)
    assert PackedLinear(lin, "fp32")(x).shape == (3, 4, 128)
    xb = x.bfloat16()
    out = PackedLinear(lin.bfloat16(), "bf16")(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(xb, lin.weight.bfloat16()), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n_in", [96, 95])   # odd K: no k-pairs, the widening path
def test_bf16_weights_are_the_bf16_rounding(n_in):
    lin = _linear(200, n_in, bias=True)
    x = torch.randn(9, n_in)
    packed = PackedLinear(lin, "bf16")
    # with AVX512-BF16 and even K the activations are rounded to bf16 too (bf16 dot products)
    assert packed.fmt == ("bf16x2" if n_in % 2 == 0 and cpu_supports_bf16_dot() else "bf16")
    xs = x.bfloat16().float() if packed.fmt == "bf16x2" else x
    want = F.linear(xs, lin.weight.bfloat16().float(), lin.bias)   # exact bf16 products, fp32 sums
    torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("bf16_dot")
@pytest.mark.parametrize("rows", [1, 6, 7, 13, 200])
def test_bf16_pairs_for_every_row_count(rows):
    lin = _linear(1000, 260, bias=False)
    x = torch.randn(rows, 260).bfloat16()
    got = PackedLinear(lin, "bf16")(x)
    want = F.linear(x.float(), lin.weight.bfloat16().float()).bfloat16()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_int8_is_per_channel_symmetric_quantization():
    lin = _linear(200, 96, bias=False)
    x = torch.randn(9, 96)
    w = lin.weight.detach()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    dequant = torch.round(w / scale).clamp(-127, 127) * scale
    got = PackedLinear(lin, "int8")(x)
    torch.testing.assert_close(got, F.linear(x, dequant), rtol=1e-4, atol=1e-4)
    assert (got - F.linear(x, w)).abs().max() > 0   # it really is quantized


# bf16 at an even K is packed in k-pairs where the CPU has AVX512-BF16; at an odd K it keeps
# 16-channel panels: each layout's rows have their own index formula in packed_rows
@pytest.mark.parametrize("fmt,K", [("fp32", 64), ("bf16", 64), ("bf16", 63), ("int8", 64)])
def test_tied_embedding_reads_packed_rows(fmt, K):
    lin = _linear(300, K, bias=False)
    packed = PackedLinear(lin, fmt)
    assert K % 2 == 0 or packed.fmt == fmt
    ids = torch.tensor([0, 15, 16, 17, 299, 5])
    rows = TiedPackedEmbedding(packed, torch.float32)(ids)
    eye = packed(torch.eye(K)).t()   # row i of W, as the packed linear computes it
    torch.testing.assert_close(rows, eye[ids], rtol=1e-6, atol=1e-6)


def test_engine_packs_by_default_on_cpu_and_can_opt_out(tiny_qwen2):
    packed, plain = LLM(tiny_qwen2), LLM(tiny_qwen2, cpu_kernels=False)
    assert packed.engine.runner.weight_format == "fp32" and plain.engine.runner.weight_format == "torch"
    assert any(isinstance(m, PackedLinear) for m in packed.engine.runner.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.engine.runner.model.modules())
    prompts = corpus_prompts(packed.tokenizer, lens=[3, 30, 90])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in packed.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]



def test_backend_swaps_the_layer_kernels_in_with_the_linear_kernel(tiny_llama):
    """SwiGLU, add + RMSNorm, RoPE and the paged attention run on their kernels exactly when the
    linears are packed (the CPU backend)."""
    from pdserve.engine.llm_engine import LLMEngine
    on = LLMEngine(tiny_llama, num_kv_blocks=8)
    off = LLMEngine(tiny_llama, num_kv_blocks=8, cpu_kernels=False)
    assert on.runner.backend.name == "cpu" and off.runner.backend.name == "torch"
    def kinds(e, kind):
        return [type(m) for m in e.runner.model.modules() if isinstance(m, kind)]
    for kind, kernel in ((SiluAndMul, CpuSiluAndMul), (RMSNorm, CpuRMSNorm), (RotaryEmbedding, CpuRotaryEmbedding),
                         (PagedAttention, CpuPagedAttention)):
        assert kinds(on, kind) and set(kinds(on, kind)) == {kernel}
        assert kinds(off, kind) and set(kinds(off, kind)) == {kind}


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_int8_close_to_fp32(make_tiny, arch):
    """vLLM's rule for reduced precision: at the first differing greedy token, each side's token is
    among the other's top-5; and most tokens agree."""
    path = make_tiny(arch)
    fp32, int8 = LLM(path), LLM(path, quantization="int8")
    assert int8.engine.runner.weight_format == "int8"
    prompts = corpus_prompts(fp32.tokenizer, lens=[5, 17, 40, 100])
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=5, ignore_eos=True)
    same = tokens_before_divergence(fp32.generate(prompts, params), int8.generate(prompts, params))
    assert same >= 16


def test_quantization_needs_the_cpu_kernel(tiny_llama):
    with pytest.raises(ValueError, match="int8"):
        LLM(tiny_llama, quantization="int8", cpu_kernels=False)
    with pytest.raises(ValueError, match="quantization"):
        LLM(tiny_llama, quantization="fp4")
