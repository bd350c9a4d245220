"""AWQ checkpoints (AutoAWQ's GEMM layout) made here by RTN and AutoAWQ's published packing: qweight
and qzeros with 8 columns per int32 word in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7."""
import pytest
import torch

from tools import quantize_hub as formats
from tests.quantization.checks import assert_engine_matches_transformers, assert_loaded_exactly


@pytest.fixture(scope="module")
def awq(make_tiny, tmp_path_factory):
    """Group 32, layer 1's MLP left in full precision (modules_to_not_convert), as AutoAWQ writes it."""
    base = make_tiny("qwen2", hidden_size=128, intermediate_size=256)
    dst = str(tmp_path_factory.mktemp("awq") / "int4-g32")
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": ["model.layers.1.mlp"]}
    kept = {}

    def quantize(module, w):
        if module.startswith("model.layers.1.mlp."):
            kept[module] = w
            return None
        return formats.rtn(w, 4, 32, sym=False)

    codes = quantize_all(base, dst, qc, quantize)
    return dst, codes, kept


def quantize_all(base, dst, qc, quantize):
    """formats.quantize_checkpoint, leaving the linears quantize() returns None for as they are."""
    class Plain:   # a linear kept in full precision: its weight passes through both checkpoints
        def __init__(self, w):
            self.w_dq = w

    def q(module, w):
        c = quantize(module, w)
        return Plain(w) if c is None else c

    codes = formats.quantize_checkpoint(base, dst, qc, q,
                                        lambda c: {"weight": c.w_dq} if isinstance(c, Plain) else formats.awq_tensors(c))
    return {k: c for k, c in codes.items() if not isinstance(c, Plain)}


def test_the_interleaved_order_is_autoawqs():
    """Column c of a run of 8 is in nibble [0, 4, 1, 5, 2, 6, 3, 7][c]: the word packing 0..7."""
    word = formats.pack_cols(torch.arange(8)[None], 4, formats.AWQ_ORDER)
    assert int(word) == 0x75316420


def test_weights_are_the_dequantized_codes(awq):
    path, codes, kept = awq
    model = assert_loaded_exactly(path, codes)
    mlp = model.get_submodule("model.layers.1.mlp")
    assert not hasattr(mlp.gate_up_proj, "quant") and not hasattr(mlp.down_proj, "quant")
    assert torch.equal(mlp.down_proj.weight, kept["model.layers.1.mlp.down_proj"])


def test_torch_path_matches_transformers(awq):
    assert_engine_matches_transformers(awq[0], awq[0] + "-dq", cpu_kernels=False)


def test_cpu_kernels_match_transformers(awq, cpu_isa):
    assert_engine_matches_transformers(awq[0], awq[0] + "-dq")
