"""`pdserve roofline`'s weight-read line as the model holds and routes its weights: a mixture of
experts reads the experts a step selects (expected under uniform routing, or counted from the
routers in the measured run), a quantized model reads its codes plus their scales and offsets
(int8, int4, GGUF). Nothing here asserts a timing: the machine is shared."""
import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve import LLM
from pdserve.bench.roofline import held_bytes_per_weight
from pdserve.bench.step_cost import ModelCost, phase_steps, step_cost
from pdserve.config import ModelConfig
from pdserve.layers.moe import FusedMoE
from pdserve.models import ARCHITECTURES


def moe_cost(path: str) -> tuple[ModelCost, torch.nn.Module]:
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.architecture](cfg)
    return ModelCost.from_config(cfg, itemsize=4), model


@pytest.mark.parametrize("arch, moe_layers", [("qwen3_moe", 2), ("qwen2_moe", 2), ("mixtral", 2)])
def test_moe_counts_match_the_engine_model(make_tiny, arch, moe_layers):
    """Every token's weights (attention, dense layers, shared experts, routers) and each routed
    expert's are exactly the parameters of our own model classes."""
    m, model = moe_cost(make_tiny(arch))
    experts = [e for e in model.modules() if isinstance(e, FusedMoE)]
    assert (m.moe_layers, m.num_experts, m.top_k) == (moe_layers, 8, 2) == (len(experts), 8, 2)
    skip = {"lm_head.weight", "model.embed_tokens.weight"}
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and n not in skip)
    assert m.body_matmul_params + m.moe_layers * m.num_experts * m.expert_params == matrices
    assert m.body_matmul_params + m.body_other_params + m.moe_layers * m.num_experts * m.expert_params == \
        sum(p.numel() for n, p in model.named_parameters() if n not in skip)
    assert m.expert_params == experts[0].gate_up_proj[0].numel() + experts[0].down_proj[0].numel()


def test_gpt_oss_router_is_found(make_tiny):
    # gpt-oss's router (a bias, top-k before the softmax) is a Router too: its layers, experts and
    # top k are counted, and the roofline's counter hooks it
    from pdserve.bench.roofline import ExpertCounter
    m, model = moe_cost(make_tiny("gpt_oss"))
    assert (m.moe_layers, m.num_experts, m.top_k) == (2, 8, 2)
    assert len(ExpertCounter(model).handles) == 2


def test_the_expert_read_line_moves_with_batch(make_tiny):
    m, _ = moe_cost(make_tiny("qwen3_moe"))   # 2 MoE layers of 8 experts, top 2
    E, k, L = 8, 2, 2
    # one token reads exactly its k experts a layer; T tokens E (1 - (1 - k/E)^T) in expectation
    assert m.experts_read(1) == L * k
    for T in (2, 4, 16, 64):
        assert m.experts_read(T) == pytest.approx(L * E * (1 - (1 - k / E) ** T), rel=1e-12)
    base = step_cost(m, *phase_steps("decode", 1, 64), experts_read=0).bytes_weights
    lines = [step_cost(m, *phase_steps("decode", b, 64)) for b in (1, 4, 16, 64)]
    for b, c in zip((1, 4, 16, 64), lines):
        assert c.bytes_weights - 4 * 64 * (b - 1) == round(base + m.experts_read(b) * m.expert_params * 4)
        # every token multiplies by its k experts, whichever they are
        assert c.flops_linear == 2 * (m.body_matmul_params + L * k * m.expert_params) * b
    w = [c.bytes_weights for c in lines]
    assert w[0] < w[1] < w[2] < w[3] <= base + L * E * m.expert_params * 4 + 4 * 64 * 63
    # the experts counted in a run replace the expectation
    c = step_cost(m, *phase_steps("decode", 16, 64), experts_read=5)
    assert c.bytes_weights == base + 4 * 64 * 15 + 5 * m.expert_params * 4


def int_linears(model) -> list[tuple[int, int]]:
    """(out, in) of each layer linear (not the lm_head), from the checkpoint config's shapes."""
    return [(m.out_features, m.in_features) for n, m in model.named_modules()
            if hasattr(m, "in_features") and hasattr(m, "out_features") and n != "lm_head"]


@pytest.mark.parametrize("quantization, linear_bits", [
    (None, lambda N, K: 32),            # fp32: the weight itself
    ("int8", lambda N, K: 8 + 32 / K),  # 8-bit codes, an fp32 scale per output channel
    ("int4", lambda N, K: 4 + 64 / 32),  # 4-bit codes, an fp32 scale and offset per 32 inputs
])
def test_held_bytes_are_codes_plus_scales(tiny_llama, quantization, linear_bits):
    llm = LLM(tiny_llama, quantization=quantization, cpu_kernels=True if quantization else False, num_kv_blocks=8)
    model = llm.engine.runner.model
    held = held_bytes_per_weight(model)
    shapes = int_linears(model)
    expected = sum(N * K * linear_bits(N, K) for N, K in shapes) / sum(N * K for N, K in shapes) / 8
    assert held["linear"] == pytest.approx(expected, rel=1e-12)
    K = llm.engine.model_config.hidden_size
    assert held["lm_head"] == pytest.approx(4 if quantization is None else 1 + 4 / K, rel=1e-12)   # int4: int8 lm_head
    assert held["experts"] == 0


@pytest.mark.parametrize("form, expected", [
    ("bf16", 2.0),                 # the stacked experts themselves
    ("mxfp4", 16 / 32 + 1 / 32),   # gpt-oss: 16 bytes of codes and one e8m0 scale per 32 weights
])
def test_held_bytes_of_experts_in_each_form(form, expected):
    moe = FusedMoE(4, 64, 32, bias=True, mxfp4=form == "mxfp4")
    if form == "bf16":
        moe = moe.to(torch.bfloat16)
    assert held_bytes_per_weight(torch.nn.ModuleDict({"mlp": moe}))["experts"] == pytest.approx(expected, rel=1e-12)


def test_command_reads_the_held_and_routed_weights(make_tiny, tmp_path):
    """On a mixture of experts quantized to int8 at load: each point's weight-read line is its
    int8 linears and int8 experts (codes + per-channel scales), the experts as the routers selected
    them in that step."""
    path, out = make_tiny("qwen3_moe"), tmp_path / "r.json"
    cmd = [sys.executable, "-m", "pdserve", "roofline", "--quick", "--threads", "1", "--model", path,
           "--quantization", "int8", "--prefill-lens", "32", "--decode-batches", "1,16", "--decode-contexts", "64",
           "--read-rounds", "0", "--overhead-steps", "2", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    held = data["weights_held_bytes_per_weight"]
    assert 1 < held["linear"] < 1.2 and 1 < held["experts"] < 1.2   # int8 codes + per-channel scales
    assert "counted from the routers" in proc.stdout and "linear 8." in proc.stdout
    m = replace_cost(ModelCost.from_config(ModelConfig.from_dir(path), itemsize=4), held)
    reads = {(r["phase"], r["batch"]): r["counted"] for r in data["expert_reads"]}
    assert reads[("decode", 1)] == m.moe_layers * m.top_k            # one token: its k experts a layer
    assert m.moe_layers * m.top_k < reads[("decode", 16)] <= m.moe_layers * m.num_experts
    for p in data["points"]:
        seqs, rows = phase_steps(p["phase"], p["batch"], p["context"])
        assert p["bytes_weights"] == step_cost(m, seqs, rows, reads[(p["phase"], p["batch"])]).bytes_weights
    line = {p["batch"]: p["bytes_weights"] for p in data["points"] if p["phase"] == "decode"}
    assert line[16] > line[1]   # more tokens, more distinct experts read


def replace_cost(m: ModelCost, held: dict) -> ModelCost:
    from dataclasses import replace
    return replace(m, weight_itemsize=held["linear"], lm_head_itemsize=held["lm_head"],
                   expert_itemsize=held["experts"])
