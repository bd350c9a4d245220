"""`pdserve roofline` reads a GGUF model's weights as pdserve holds them: each linear's codes plus
its group scales and offsets (pdserve/gguf/quants.py: fp32 scales), the weight-read line a decode
step is measured against."""
import pytest

from pdserve import LLM
from pdserve.backends.cpu.quant_linear import QuantLinear
from pdserve.bench.roofline import held_bytes_per_weight


def format_bits(model) -> float:
    """Bits per weight of the layers' linears from each one's format: codes of `bits`, an fp32 scale
    (and an fp32 offset where the format has one) per group."""
    total = weights = 0
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear) and name != "lm_head":
            n = m.in_features * m.out_features
            total += n * (m.bits + 32 * (1 + (m.offset.numel() > 0)) / m.group_size)
            weights += n
    return total / weights


def test_q8_0_reads_nine_bits_a_weight(make_gguf):
    _, q8 = make_gguf("llama", "q8_0")
    held = held_bytes_per_weight(LLM(q8, num_kv_blocks=8).engine.runner.model)
    assert held["linear"] == pytest.approx((8 + 32 / 32) / 8, rel=1e-12)   # 32 codes and a scale a group


def test_q4_k_m_reads_its_codes_scales_and_offsets(make_quantized):
    _, _, q4km = make_quantized("llama", "Q4_K_M")
    model = LLM(q4km, num_kv_blocks=8).engine.runner.model
    held = held_bytes_per_weight(model)
    bits = format_bits(model)
    assert 6 <= bits < 8   # Q4_K's 4-bit codes with a scale and offset a group of 32, some Q6_K
    assert 8 * held["linear"] == pytest.approx(bits, rel=1e-12)
