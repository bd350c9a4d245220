"""The fp32 lm_head's argmax screened on a bf16 copy (PackedLinear with screen=True, the kernel's
packed_linear_argmax_screened): the bf16 dot products only pick the candidates, whose exact fp32
logits then decide, so the index is the one torch.argmax gives on the unfused path's logits, including
where bf16 alone would pick another column, ties, NaNs and infinities."""
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.backends.cpu.kernels import cpu_ops, cpu_supports_bf16_dot
from pdserve.backends.cpu.packed_linear import PackedLinear
from tests.helpers import corpus_prompts

pytestmark = pytest.mark.usefixtures("cpu_isa", "bf16_dot")


def _linear(w, bias=None):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def _screened(w):
    layer = PackedLinear(_linear(w), "fp32", screen=True)
    assert layer.use_screen
    return layer


def _run(layer, x):
    """(tokens, candidates checked per row: -1 where the kernel fell back to the full fp32 argmax)."""
    counts = torch.empty(x.shape[0], dtype=torch.long)
    got = cpu_ops().packed_linear_argmax_screened(x.contiguous(), layer.packed, layer.screen, layer.col_norm,
                                                  layer.col_norm_max, layer.out_features, counts)
    want = layer(x).argmax(dim=-1)   # the unfused path's logits
    assert torch.equal(got, want), (got, want)
    assert torch.equal(layer.argmax(x), want)
    return got, counts


@pytest.mark.parametrize("n_out,n_in", [(64, 32), (1000, 260), (2330, 96), (5000, 600)])
@pytest.mark.parametrize("rows", [1, 7, 32, 100])
def test_equals_argmax_of_the_logits(n_out, n_in, rows):
    torch.manual_seed(rows)
    layer = _screened(torch.randn(n_out, n_in) / n_in ** 0.5 * 4)
    _, counts = _run(layer, torch.randn(rows, n_in))
    # it screened: a few candidates per row, not the fallback nor the whole vocabulary
    assert (counts >= 1).all() and (counts <= 32).all(), counts


def test_exact_logits_overrule_the_bf16_ones():
    """Column 20's weights are 1 + 0.49 ulp (bf16 rounds them to 1), column 10's are 1 but for one
    exact bf16 step up: in bf16 column 10 is larger, in fp32 column 20 is (64.245 against 64.008).
    A screen without an error radius, or one that trusted the bf16 argmax, picks 10."""
    torch.manual_seed(0)
    sign = torch.where(torch.rand(64) < 0.5, -1.0, 1.0)
    w = torch.randn(300, 64) * 0.1
    w[20] = sign * (1 + 0.49 * 2 ** -7)
    w[10] = sign
    w[10, 0] = sign[0] * (1 + 2 ** -7)
    assert torch.equal(w[20].bfloat16(), sign.bfloat16())   # bf16 cannot tell column 20 from all-ones
    x = sign.repeat(3, 1)
    assert (_linear(w)(x).argmax(-1) == 20).all() and ((x.bfloat16().float() @ w.bfloat16().float().T).argmax(-1) == 10).all()
    got, counts = _run(_screened(w), x)
    assert got.tolist() == [20, 20, 20] and (counts >= 2).all()
    w[[10, 20]] = w[[20, 10]]   # and the other way round
    assert _run(_screened(w), x)[0].tolist() == [10, 10, 10]


def test_exact_logits_of_many_candidates_across_panels():
    """40 columns bf16 cannot tell apart, one per panel, 40 panels (the exact pass sums four panels at
    a time, 16 columns each): the one that fp32 ranks first must win, wherever its lane is."""
    torch.manual_seed(4)
    sign = torch.where(torch.rand(64) < 0.5, -1.0, 1.0)
    w = torch.randn(3000, 64) * 0.1
    cols = list(range(3, 3000, 73))[:40]
    x = sign.repeat(2, 1)
    for target in (cols[0], cols[17], cols[-1]):
        w[cols] = sign
        w[target] = sign * (1 + 0.49 * 2 ** -7)
        got, counts = _run(_screened(w), x)
        assert got.tolist() == [target, target] and (counts >= 40).all()


def test_ties_go_to_the_first_index():
    """Equal columns in one group, another group and the other thread's half: the first wins."""
    torch.manual_seed(1)
    w = torch.randn(4000, 64) * 0.1
    w[[70, 71, 3990]] = 1.0
    got, counts = _run(_screened(w), torch.ones(3, 64))
    assert got.tolist() == [70, 70, 70] and (counts >= 3).all()


def test_non_finite_rows_fall_back_to_the_full_argmax():
    """A NaN row makes every logit NaN (index 0, as torch.argmax); +-inf and huge rows might
    overflow the bounds: the full fp32 argmax answers, for the whole batch."""
    torch.manual_seed(2)
    layer = _screened(torch.randn(900, 32) * 0.2)
    for bad in (float("nan"), float("inf"), -float("inf"), 1e31):
        x = torch.randn(4, 32)
        x[2, 5] = bad
        _, counts = _run(layer, x)
        assert counts.tolist() == [-1] * 4


def test_flat_rows_fall_back_instead_of_checking_every_column():
    """A row of near-equal logits (every column a candidate) gets the full fp32 argmax; the other
    rows of its batch stay screened."""
    torch.manual_seed(3)
    w = torch.randn(2000, 32) * 0.2
    w[:, 0] = 0   # x = e_0 makes every logit 0
    x = torch.randn(4, 32)
    x[1] = 0
    x[1, 0] = 1.0
    got, counts = _run(_screened(w), x)
    assert got[1] == 0 and counts[1] == -1
    assert counts[[0, 2, 3]].min() >= 1


def test_screen_only_for_an_fp32_lm_head_without_bias():
    w = torch.randn(256, 64)
    assert PackedLinear(_linear(w), "fp32").screen is None   # not asked
    assert PackedLinear(_linear(w, bias=torch.zeros(256)), "fp32", screen=True).screen is None
    assert PackedLinear(_linear(w), "int8", screen=True).screen is None
    assert PackedLinear(_linear(w), "bf16", screen=True).screen is None
    w[3, 3] = float("inf")
    assert PackedLinear(_linear(w), "fp32", screen=True).screen is None


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_runner_greedy_tokens_with_and_without_the_screen(make_tiny, arch):
    path = make_tiny(arch)
    screened, plain = LLM(path), LLM(path)
    lm_head = screened.engine.runner.model.lm_head
    assert lm_head.use_screen
    plain.engine.runner.model.lm_head.use_screen = False
    calls = []   # the screened lm_head answered the steps (use_screen: PackedLinear.argmax takes it)
    lm_head_argmax = lm_head.argmax
    lm_head.argmax = lambda x: calls.append(x.shape[0]) or lm_head_argmax(x)
    prompts = corpus_prompts(screened.tokenizer, lens=[3, 30, 90])
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in screened.generate(prompts, greedy)] == \
        [o.token_ids for o in plain.generate(prompts, greedy)]
    assert calls
