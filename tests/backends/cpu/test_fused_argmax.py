"""Greedy tokens straight from the packed lm_head (PackedLinear.argmax, the kernel's fused argmax):
the same index as torch.argmax of the logits the unfused path computes, ties and NaNs included;
the runner takes it for batches that only need the argmax and the sampler's path for the rest."""
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.backends.cpu.kernels import cpu_supports_bf16_dot
from pdserve.backends.cpu.packed_linear import PackedLinear
from tests.helpers import corpus_prompts

pytestmark = pytest.mark.usefixtures("cpu_isa")

FORMATS = ["fp32", "bf16", "int8"]   # bf16 is k-pairs (bf16x2) where the CPU has AVX512-BF16 and K is even


def _packed(n_out, n_in, fmt, bias=False, seed=0):
    torch.manual_seed(seed)
    return PackedLinear(torch.nn.Linear(n_in, n_out, bias=bias), fmt)


def _check(packed, x):
    want = packed(x).argmax(dim=-1)   # the logits as the unfused path makes them
    got = packed.argmax(x)
    assert got.dtype == torch.long and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


# vocab sizes that are and are not multiples of the 64-channel group (padding must never win),
# K on and off the k-block, row counts over one and several row tiles and past a 96-row block
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n_out,n_in", [(64, 32), (1000, 260), (2330, 96), (5000, 600)])
@pytest.mark.parametrize("rows", [1, 5, 7, 32, 100])
def test_equals_argmax_of_the_logits(fmt, n_out, n_in, rows):
    packed = _packed(n_out, n_in, fmt, seed=rows)
    _check(packed, torch.randn(rows, n_in))


@pytest.mark.parametrize("fmt", FORMATS)
def test_bias_is_added_before_the_argmax(fmt):
    packed = _packed(700, 64, fmt, bias=True)
    with torch.no_grad():
        packed.bias.copy_(torch.linspace(-50, 50, 700))   # large enough to decide the argmax
    x = torch.randn(9, 64) * 0.01
    _check(packed, x)
    assert (packed.argmax(x) > 600).all()
    with torch.no_grad():
        packed.bias.fill_(-100.0)   # every logit negative: the 4 padding columns (zeros) must not win
    _check(packed, x)
    assert (packed.argmax(x) < 700).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_go_to_the_first_index_across_groups_and_threads(fmt):
    """Equal logits in one group, in two groups, and at both ends of the vocabulary (the two threads'
    halves): the first index wins, as in torch.argmax."""
    packed = _packed(4000, 64, fmt)
    with torch.no_grad():
        packed.packed.zero_()   # every logit 0 ...
    x = torch.randn(6, 64)
    assert packed.argmax(x).tolist() == [0] * 6
    w = torch.zeros(4000, 64)
    w[[70, 71, 3990]] = 1.0          # ... or three equal maxima, the last in the other thread's half
    tied = PackedLinear(_set_weight(w), fmt)
    _check(tied, torch.ones(3, 64))
    assert tied.argmax(torch.ones(3, 64)).tolist() == [70, 70, 70]


def _set_weight(w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_nan_counts_as_the_maximum(fmt):
    """torch.argmax (and numpy's, the sampler's) give the first NaN: a NaN row of x makes every logit
    NaN (index 0); a NaN weight row makes its column NaN; infinities order as numbers."""
    w = torch.randn(900, 32)
    w[500] = float("nan")
    w[700] = float("nan")
    w[100, 0] = float("inf")
    packed = PackedLinear(_set_weight(w), fmt)
    x = torch.randn(4, 32)
    x[1] = float("nan")
    x[2, 0] = 0.0   # inf * 0: NaN in column 100 too, before the NaN rows
    x[3, 0] = 1.0   # column 100 is +inf, but the NaN columns still win
    got = packed.argmax(x)
    _check(packed, x)
    assert got.tolist() == [500 if x[0, 0] != 0 else 100, 0, 100, 500]


@pytest.mark.usefixtures("bf16_dot")
def test_pairs_round_x_to_bf16_as_the_layer_does():
    packed = _packed(3000, 200, "bf16")
    assert packed.fmt == "bf16x2"
    _check(packed, torch.randn(13, 200) * 3)


def test_rejects_rows_that_are_not_fp32():
    packed = _packed(100, 32, "fp32")
    with pytest.raises(ValueError, match="fp32"):
        packed.argmax(torch.randn(2, 32).bfloat16())


def _count_logits(llm):
    """Wrap the model's compute_logits: how many times the runner made logits."""
    model, calls = llm.engine.runner.model, []
    real = model.compute_logits
    model.compute_logits = lambda h: calls.append(h.shape[0]) or real(h)
    return calls


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_runner_takes_greedy_tokens_without_logits(make_tiny, arch):
    path = make_tiny(arch)
    fused, plain = LLM(path), LLM(path)
    plain.engine.runner.backend.fused_argmax = False
    assert fused.engine.runner.backend.fused_argmax
    calls = _count_logits(fused)
    prompts = corpus_prompts(fused.tokenizer, lens=[3, 30, 90])
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in fused.generate(prompts, greedy)] == \
        [o.token_ids for o in plain.generate(prompts, greedy)]
    assert calls == []   # every step's tokens came from the fused argmax
    # a batch with one request that needs the logits (logprobs, sampling) takes them for all
    mixed = [greedy, SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)]
    want = [o.token_ids for o in plain.generate(prompts, mixed)]
    assert [o.token_ids for o in fused.generate(prompts, mixed)] == want
    assert calls and all(n >= 1 for n in calls)


def test_bf16_model_without_the_stack_keeps_the_sampler(tiny_llama):
    """Without the decoder stack a bf16 model's hidden rows (and logits) are bf16: the logits the
    sampler sees are rounded, so the fused fp32 argmax is not taken."""
    llm = LLM(tiny_llama, dtype="bfloat16")
    runner = llm.engine.runner
    runner.backend.stack = None   # the Python layers: bf16 hidden rows
    calls = _count_logits(llm)
    llm.generate(corpus_prompts(llm.tokenizer, lens=[5]), SamplingParams(max_tokens=3, temperature=0))
    assert len(calls) == 3
