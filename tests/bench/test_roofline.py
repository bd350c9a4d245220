"""`pdserve roofline`: exact FLOP and byte counts, and the command end to end on a tiny model.
Nothing here asserts a timing: the machine is shared."""
import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.bench.step_cost import ModelCost, phase_steps, step_cost
from pdserve.config import ModelConfig
from pdserve.models import ARCHITECTURES


def config(arch: str, **extra) -> ModelConfig:
    # hidden 8, 2 layers, 2 heads of 4, 1 KV head, MLP 16, vocab 10
    raw = dict(extra)
    if arch == "OPTForCausalLM":
        return ModelConfig("x", arch, 10, 8, 2, 2, 2, 4, 16, 64, True, "float32", raw)
    return ModelConfig("x", arch, 10, 8, 2, 2, 1, 4, 16, 64, True, "float32", raw)


def test_qwen2_counts_by_hand():
    m = ModelCost.from_config(config("Qwen2ForCausalLM"), itemsize=4)
    # per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 + gate/up/down 3 x 8x16 = 576; 2 layers
    assert m.body_matmul_params == 1152
    # per layer: 2 RMSNorms (8 each) + q/k/v biases (8 + 4 + 4) = 32; 2 layers + final norm 8
    assert m.body_other_params == 72
    assert m.lm_head_params == 80 and m.embed_row_params == 8
    assert m.kv_bytes_per_token == 2 * 2 * 1 * 4 * 4   # K and V, 2 layers, 1 KV head of 4, fp32

    # decode: 2 sequences, one new token each at context 5, both get logits
    c = step_cost(m, *phase_steps("decode", 2, 5))
    assert c.flops_linear == 2 * 1152 * 2 == 4608
    assert c.flops_attn == 4 * 2 * 2 * 4 * (5 + 5) == 640   # QK^T + PV: 4 FLOPs x layers x heads x dim x keys
    assert c.flops_lm_head == 2 * 80 * 2 == 320
    assert c.bytes_weights == (1152 + 72 + 80 + 2 * 8) * 4 == 5280
    assert c.bytes_kv_read == 10 * 64 and c.bytes_kv_write == 2 * 64

    # prefill of 4 tokens: causal keys 1 + 2 + 3 + 4 = 10, logits for the last row only
    c = step_cost(m, *phase_steps("prefill", 1, 4))
    assert (c.flops_linear, c.flops_attn, c.flops_lm_head) == (9216, 640, 160)
    assert c.bytes_weights == (1152 + 72 + 80 + 4 * 8) * 4 == 5344
    assert (c.bytes_kv_read, c.bytes_kv_write) == (256, 256)
    assert c.flops == 9216 + 640 + 160 and c.bytes == 5344 + 512


def test_sliding_window_and_no_logits():
    m = ModelCost.from_config(config("MistralForCausalLM", sliding_window=2), itemsize=2)
    assert m.body_other_params == 2 * 16 + 8   # no biases in Mistral
    c = step_cost(m, [(4, 4)], logit_rows=2)   # keys per query: 1, 2, 2, 2
    assert c.flops_attn == 4 * 2 * 2 * 4 * 7
    assert c.bytes_kv_read == 4 * m.kv_bytes_per_token
    c = step_cost(m, [(1, 5)], logit_rows=0)   # a window of 2 keys; no lm_head read without logits
    assert c.flops_attn == 4 * 2 * 2 * 4 * 2 and c.bytes_kv_read == 2 * m.kv_bytes_per_token
    assert c.flops_lm_head == 0 and c.bytes_weights == (m.body_matmul_params + m.body_other_params + 8) * 2


@pytest.mark.parametrize("arch,extra", [
    ("Qwen2ForCausalLM", {}),
    ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ("OPTForCausalLM", {}),
    ("OPTForCausalLM", {"word_embed_proj_dim": 4, "do_layer_norm_before": False}),
])
def test_counts_match_the_engine_model(arch, extra):
    """The analytic counts are exactly the parameters of our own model classes."""
    cfg = config(arch, **extra)
    model = ARCHITECTURES[arch](cfg)
    m = ModelCost.from_config(cfg, itemsize=4)
    skip = {"lm_head.weight", "model.embed_tokens.weight", "model.decoder.embed_tokens.weight",
            "model.decoder.embed_positions.weight"}
    linear = sum(mod.weight.numel() for name, mod in model.named_modules()
                 if isinstance(mod, torch.nn.Linear) and name != "lm_head")
    body = sum(p.numel() for name, p in model.named_parameters() if name not in skip)
    assert m.body_matmul_params == linear
    assert m.body_matmul_params + m.body_other_params == body
    assert m.lm_head_params == model.lm_head.weight.numel()


def test_phases_per_token():
    m = ModelCost.from_config(config("Qwen2ForCausalLM"), itemsize=4)
    # Prefilling n tokens is exactly n decode steps at contexts 1..n (less their lm_head rows).
    pre = step_cost(m, *phase_steps("prefill", 1, 32))
    dec = [step_cost(m, *phase_steps("decode", 1, c)) for c in range(1, 33)]
    assert pre.flops_linear + pre.flops_attn == sum(d.flops_linear + d.flops_attn for d in dec)
    # Batching divides the weight bytes per token, not the KV bytes per token.
    one, many = step_cost(m, *phase_steps("decode", 1, 64)), step_cost(m, *phase_steps("decode", 16, 64))
    assert many.bytes_weights / 16 < one.bytes_weights / 4
    assert many.bytes_kv_read / 16 == one.bytes_kv_read


def test_command_quick(tiny_qwen2, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    cmd = [sys.executable, "-m", "pdserve", "roofline", "--quick", "--threads", "1", "--model", tiny_qwen2,
           "--overhead-steps", "9", "--peak-rounds", "2", "--output", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MPLBACKEND="Agg"))
    assert proc.returncode == 0, proc.stderr
    assert "findings" in proc.stdout and "engine overhead" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert {"float32", "bfloat16"} <= set(data["machine"]["gemm_flops"])
    assert data["roof"]["bandwidth"] > 0 and data["roof"]["peak_flops"] > 0
    pts = data["points"]
    assert {(p["phase"], p["batch"], p["context"]) for p in pts} == (
        {("prefill", 1, n) for n in (32, 128, 512)} | {("decode", b, c) for b in (1, 4, 16) for c in (128, 512)}
        | {("nocache", 1, c) for c in (128, 512)})
    fields = {"time_s", "tokens", "flops", "bytes", "bytes_weights", "bytes_kv_read", "bytes_kv_write",
              "arithmetic_intensity", "achieved_flops", "roof_flops", "fraction_of_roof", "bound"}
    for p in pts:
        assert fields <= set(p) and p["time_s"] > 0
        assert p["roof_flops"] == min(data["roof"]["peak_flops"], p["arithmetic_intensity"] * data["roof"]["bandwidth"])

    def point(phase, b, c):
        return next(p for p in pts if (p["phase"], p["batch"], p["context"]) == (phase, b, c))
    for c in (128, 512):   # computed, not timed
        w = [point("decode", b, c)["weight_bytes_per_token"] for b in (1, 4, 16)]
        assert w[0] > w[1] > w[2]
        kv = {point("decode", b, c)["kv_read_bytes_per_token"] for b in (1, 4, 16)}
        assert len(kv) == 1
        # per token: the same linear FLOPs; attention over c / 2 keys on average in prefill, c in decode
        pre, dec = point("prefill", 1, c), point("decode", 1, c)
        assert pre["flops_linear"] / c == dec["flops_linear"]
        assert pre["flops_attn"] / c == pytest.approx(dec["flops_attn"] * (c + 1) / (2 * c), rel=1e-12)
    assert point("nocache", 1, 512)["flops"] == point("prefill", 1, 512)["flops"]
    assert data["overhead"]["step_ms"] >= data["overhead"]["forward_ms"] > 0 and data["overhead"]["steps"] == 9
    # streamed requests make an output each per step, final-only ones none until they finish
    final = data["overhead_final_only"]
    assert final["steps"] == 9 and final["final_only"] and final["outputs_per_step"] == 0
    assert not data["overhead"]["final_only"] and data["overhead"]["outputs_per_step"] == data["overhead"]["batch"]
    assert "final-only requests" in proc.stdout
    read = data["side_by_side_read"]
    assert read["context"] == 128 and read["rounds"] == len(read["bandwidth"]) == 6
    assert set(read["batches"]) == {"1", "4"}
    for b, r in read["batches"].items():
        assert r["bytes"] == point("decode", int(b), 128)["bytes"] and len(r["ratio"]) == len(r["step_s"]) == 6
        for bw, step, ratio in zip(read["bandwidth"], r["step_s"], r["ratio"]):
            assert ratio == pytest.approx(step * bw / r["bytes"]) and ratio > 0
    assert "side by side with a read probe" in proc.stdout
    # compute-bound steps against a GEMM probe right before them: every prefill length, and the decode
    # batches at or past the ridge (the roofs probed before the sweep) at the smallest decode context
    peak = data["side_by_side_peak"]
    assert peak["rounds"] == len(peak["peak_flops"]) == 2 and peak["gemm_n"] == 1024
    decodes = {f"decode batch {b} context 128" for b in (1, 4, 16)
               if point("decode", b, 128)["arithmetic_intensity"] >= peak["ridge"]}
    assert set(peak["steps"]) == {f"prefill batch 1 context {n}" for n in (32, 128, 512)} | decodes
    for name, r in peak["steps"].items():
        phase, _, b, _, c = name.split()
        assert r["flops"] == point(phase, int(b), int(c))["flops"] and len(r["step_s"]) == 2
        for p, step, frac in zip(peak["peak_flops"], r["step_s"], r["fraction"]):
            assert frac == pytest.approx(r["flops"] / step / p) and frac > 0
        assert r["fraction_median"] == pytest.approx(sum(r["fraction"]) / 2)
    assert "side by side with a GEMM probe" in proc.stdout


def test_command_cost_model(tiny_llama, tmp_path):
    out = tmp_path / "cm.json"
    cmd = [sys.executable, "-m", "pdserve", "roofline", "--cost-model", "--model", tiny_llama,
           "--max-num-batched-tokens", "128", "--max-num-seqs", "8", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "step time = " in proc.stdout and "prefill tokens a step" in proc.stdout
    data = json.loads(out.read_text())
    cm = data["cost_model"]
    assert cm["num_calibration"] >= 8 and cm["num_observed"] == 0
    assert all(cm[f"{k}_s"] >= 0 for k in ("intercept", "tokens", "seqs", "attention_pairs"))
    assert cm["intercept_s"] + cm["tokens_s"] > 0   # a step costs something
    assert [p["step"] for p in data["predictions"]] == ["prefill 64", "prefill 128", "decode batch 1 at context 256",
                                                        "decode batch 8 at context 256"]
    caps = data["prefill_cap_by_tpot_ms"]
    assert [caps[k] for k in ("25", "50", "100", "200")] == sorted(caps.values())   # looser target, more tokens
