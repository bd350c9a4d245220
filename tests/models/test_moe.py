"""The mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, Mixtral) generate exactly what
transformers generates (fp32 greedy; logits to 1e-4), on prompts longer than their sliding
windows, on torch's ops and on the CPU kernels (each build this CPU runs: the decoder stack has no
MoE part, so the modules run layer by layer, and the backend says why), with chunked prefill, the
prefix cache, preemption and n-gram speculation. The MoE layer's routing and grouped experts
equal transformers' modules; each family reads its config.json as transformers does, and a config
it cannot serve exactly is refused in one line."""
import functools
import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pdserve import LLM
from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.layers.moe import FusedMoE, Routing, SparseMoeBlock, select_experts
from pdserve.config_fields import CONFIG_FIELDS
from pdserve.models import ARCHITECTURES
from tests.helpers import (PROMPT_LENS, assert_decode_equals_recompute, assert_greedy_batch_equals_transformers,
                           assert_last_position_logits_match, assert_outputs_survive_cache_preemption_and_speculation,
                           hf_greedy)

NEW_TOKENS = 12
# make_model's tiny checkpoints (tools/make_model.py): 8 experts, top 2, windows of 16 (Qwen2-MoE's
# layer 0) or 48 tokens (every layer of Qwen3-MoE and Mixtral)
FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=FAMILIES)
def model_path(request, make_tiny):
    return make_tiny(request.param)


@pytest.fixture(scope="module")
def llm(model_path, cpu_kernels):
    # small budget: the longer prompts are prefilled in chunks while the short ones decode
    llm = LLM(model_path, max_num_batched_tokens=64, max_num_seqs=16, cpu_kernels=cpu_kernels)
    backend = llm.engine.runner.backend
    assert backend.name == ("cpu" if cpu_kernels else "torch")
    if cpu_kernels:   # no MoE part in the decoder stack: layer by layer, and the log line says why
        assert backend.stack is None and "mixture-of-experts" in backend.why_no_stack
        assert "modules layer by layer" in backend.describe()
    return llm


@functools.lru_cache(maxsize=None)
def reference(path: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(path, list(prompt), NEW_TOKENS)


def test_tiny_checkpoints_have_the_parts_under_test(model_path):
    """Several experts per step, windows shorter than the prompts, Qwen2-MoE's dense layer and
    gated shared expert."""
    hf = transformers.AutoConfig.from_pretrained(model_path)
    assert hf.sliding_window == (16 if hf.model_type == "qwen2_moe" else 48) and max(PROMPT_LENS) > 48 * 4
    assert hf.num_experts_per_tok == 2 and getattr(hf, "num_experts", None) == 8
    if hf.model_type == "qwen2_moe":
        assert hf.mlp_only_layers == [1] and hf.layer_types[0] == "sliding_attention"


def test_greedy_batch_equals_transformers(llm, model_path):
    assert_greedy_batch_equals_transformers(llm, model_path, reference, NEW_TOKENS)


def test_last_position_logits_match(llm, model_path):
    assert_last_position_logits_match(llm, model_path)


# Decode's matrix-vector products round otherwise than a full forward's matrix products (CHUNK_ATOL);
# through the experts' weighted sums the difference reaches further: measured up to 2.6e-4 on torch's
# ops and 3.0e-4 on the kernels (Mixtral, logits up to ~40; Qwen3-MoE 8e-5, Qwen2-MoE 2e-4).
MOE_DECODE_ATOL = 5e-4


def test_decode_with_cache_equals_recompute(llm, model_path):
    """Each decode step's logits (one token against the cache) equal a full forward without a
    cache, past the windows."""
    assert_decode_equals_recompute(llm, model_path, prompt_len=60, atol=MOE_DECODE_ATOL)


def test_prefix_cache_preemption_and_speculation_keep_outputs(model_path, cpu_kernels):
    assert_outputs_survive_cache_preemption_and_speculation(model_path, cpu_kernels, reference, NEW_TOKENS)


# ---------------------------------------------------------------- the MoE layer against transformers' modules

def hf_block(family: str, **fields):
    """transformers' sparse MoE block of `family` with random weights, and its config."""
    sizes = dict(hidden_size=32, intermediate_size=24, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                 num_attention_heads=4, num_hidden_layers=1, vocab_size=64)
    if family == "mixtral":
        config = transformers.MixtralConfig(**sizes, **fields)
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**sizes, **fields)
        block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
    else:
        config = transformers.Qwen3MoeConfig(**sizes, **fields)
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return block.eval(), config


@pytest.mark.parametrize("family, fields", [
    ("qwen2_moe", dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False)),
    ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)),
    ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=1, norm_topk_prob=False)),
    ("mixtral", dict(num_local_experts=16, num_experts_per_tok=3)),
])
def test_moe_block_equals_transformers(family, fields):
    """Routing, grouping by expert (experts with no token, with one, with many) and the shared
    expert's gate: our block's output is transformers' to float rounding."""
    hf, config = hf_block(family, **fields)
    E, k = config.num_local_experts if family == "mixtral" else config.num_experts, config.num_experts_per_tok
    renorm = family == "mixtral" or config.norm_topk_prob
    shared = None
    if family == "qwen2_moe":
        from pdserve.models.llama import LlamaMLP
        cfg = ModelConfig("/x", "Qwen2MoeForCausalLM", 64, 32, 1, 4, 4, 8, 24, 64, False, None, raw={})
        shared = LlamaMLP(cfg, config.shared_expert_intermediate_size)
    ours = SparseMoeBlock(32, Routing(num_experts=E, top_k=k, renormalize=renorm), 24, shared_expert=shared,
                          shared_expert_gate=family == "qwen2_moe")
    sd = hf.state_dict()
    with torch.no_grad():
        ours.gate.weight.copy_(sd["gate.weight"])
        ours.experts.gate_up_proj.copy_(sd["experts.gate_up_proj"])   # transformers' stacked layout is ours
        ours.experts.down_proj.copy_(sd["experts.down_proj"])
        if shared is not None:
            ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([sd["shared_expert.gate_proj.weight"],
                                                                   sd["shared_expert.up_proj.weight"]]))
            ours.shared_expert.down_proj.weight.copy_(sd["shared_expert.down_proj.weight"])
            ours.shared_expert_gate.weight.copy_(sd["shared_expert_gate.weight"])
    x = torch.randn(1, 37, 32)
    with torch.no_grad():
        expected, got = hf(x), ours(x)
        counts = torch.bincount(ours.gate(x[0])[1].reshape(-1), minlength=E)
    assert counts.max() > 1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_grouped_sigmoid_routing_equals_deepseek_v3s_router():
    """The switches DeepSeek-V3 needs (sigmoid scores, score-correction bias for choosing, best
    topk_group of n_group groups, renormalised, routed_scaling_factor) as transformers computes them."""
    config = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                           vocab_size=64, num_hidden_layers=1)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape))
        router.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
    x = torch.randn(50, 32)
    logits, hf_weights, hf_ids = router(x)
    r = Routing(num_experts=16, top_k=4, scoring="sigmoid", renormalize=True, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, score_bias=True)
    weights, ids = select_experts(logits, r, router.e_score_correction_bias)
    # transformers' top k is unsorted: compare each token's (expert, weight) pairs as sets
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))


def test_fused_moe_reads_each_selected_expert_once():
    """Grouped by expert: each expert's weights are multiplied once per forward, for all its tokens."""
    moe = FusedMoE(8, 16, 8)
    torch.nn.init.normal_(moe.gate_up_proj)
    torch.nn.init.normal_(moe.down_proj)
    ids = torch.tensor([[0, 3], [3, 5], [3, 0], [7, 5]])
    calls = []
    real = torch.nn.functional.linear

    def counting(x, w, *a):
        calls.append(w.data_ptr())
        return real(x, w, *a)
    torch.nn.functional.linear = counting
    try:
        moe(torch.randn(4, 16), torch.rand(4, 2), ids)
    finally:
        torch.nn.functional.linear = real
    assert len(calls) == 2 * 4 and len(set(calls)) == 8   # experts 0, 3, 5, 7: gate_up and down once each


# ---------------------------------------------------------------- config.json, as transformers reads it

def config_of(arch: str, raw: dict) -> ModelConfig:
    return ModelConfig("/ckpt", arch, **CONFIG_FIELDS[arch](raw), torch_dtype=None, raw=raw)


BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=4, num_experts_per_tok=2)
CONFIGS = [
    ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=16)),   # Qwen1.5-MoE's kind
    ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3],
                                                   norm_topk_prob=True)),
    ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(num_experts=4, use_sliding_window=True, sliding_window=8,
                                                   max_window_layers=3)),
    ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(num_experts=4, use_sliding_window=True, sliding_window=8,
                                                   layer_types=["full_attention", "sliding_attention"] * 2)),
    ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(num_experts=0)),   # no experts: dense layers
    ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(head_dim=16, num_experts=4, norm_topk_prob=True)),
    ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(head_dim=16, num_local_experts=4, mlp_only_layers=[0, 2])),
    ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(num_experts=4, use_sliding_window=True, sliding_window=8)),
    ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(num_experts=4, use_sliding_window=False, sliding_window=8)),
    ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4)),
    ("MixtralForCausalLM", "MixtralConfig", dict(num_experts=4, sliding_window=8, head_dim=16)),
]


def hf_layers(hf_config) -> tuple[list, list]:
    """Each layer's window and whether its MLP has experts, from transformers' own modules."""
    with torch.device("meta"):
        model = getattr(transformers, hf_config.architectures[0])(hf_config)
    windows, sparse = [], []
    for layer in model.model.layers:
        if hf_config.model_type == "qwen2_moe":
            windows.append(getattr(layer.self_attn, "sliding_window", None))
        else:
            windows.append(hf_config.sliding_window)   # one mask for all layers
        sparse.append(hasattr(getattr(layer, "mlp", None), "experts"))
    return windows, sparse


@pytest.mark.parametrize("arch, hf_class, fields", CONFIGS)
def test_layers_and_routing_are_transformers(arch, hf_class, fields):
    """Windows, dense and sparse layers, expert count, top k, renormalisation and sizes from a
    config.json as the Hub ships it equal those of transformers' modules."""
    raw = dict(BASE, architectures=[arch], **fields)
    hf = getattr(transformers, hf_class)(**raw)
    hf.architectures = [arch]
    with torch.device("meta"):
        ours = ARCHITECTURES[arch](config_of(arch, json.loads(json.dumps(raw))))
    windows, sparse = hf_layers(hf)
    assert [layer.self_attn.attn.sliding_window for layer in ours.model.layers] == windows
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == sparse
    with torch.device("meta"):
        hf_model = getattr(transformers, arch)(hf)
    for layer, hf_layer in zip(ours.model.layers, hf_model.model.layers):
        if isinstance(layer.mlp, SparseMoeBlock):
            gate = hf_layer.mlp.gate
            assert (layer.mlp.gate.routing.num_experts, layer.mlp.gate.routing.top_k) == (gate.num_experts, gate.top_k)
            assert layer.mlp.gate.routing.renormalize == getattr(gate, "norm_topk_prob", True)
            assert layer.mlp.experts.gate_up_proj.shape == hf_layer.mlp.experts.gate_up_proj.shape
        else:
            assert layer.mlp.down_proj.weight.shape == hf_layer.mlp.down_proj.weight.shape
    assert ours.model.layers[0].input_layernorm.eps == hf.rms_norm_eps
    cfg = config_of(arch, json.loads(json.dumps(raw)))
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] and cfg.head_dim == hf_model.model.layers[0].self_attn.head_dim


# ---------------------------------------------------------------- refused in one line, checked at load

def refused(path: str) -> str:
    with pytest.raises(CheckpointError) as e:
        LLM(path, cpu_kernels=False)
    msg = str(e.value)
    assert "\n" not in msg and path in msg, msg
    return msg


def edited(make_tiny, tmp_path, family: str, edit, out: str) -> str:
    out = str(tmp_path / out)
    shutil.copytree(make_tiny(family), out)
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    edit(raw)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
    return out


def test_configs_it_cannot_serve_exactly_are_refused(make_tiny, tmp_path):
    assert "hidden_act 'gelu'" in refused(edited(make_tiny, tmp_path, "mixtral",
                                                 lambda r: r.update(hidden_act="gelu"), "act"))
    assert "num_experts_per_tok" in refused(edited(make_tiny, tmp_path, "qwen3_moe",
                                                   lambda r: r.update(num_experts_per_tok=9), "topk"))
    assert "disagree" in refused(edited(make_tiny, tmp_path, "qwen3_moe",
                                        lambda r: r.update(num_experts=4), "spellings"))
    # sliding layers with use_sliding_window off: transformers' Qwen2-MoE window is then 0
    assert "use_sliding_window" in refused(edited(make_tiny, tmp_path, "qwen2_moe",
                                                  lambda r: r.update(use_sliding_window=False), "window"))


def test_a_missing_or_misshapen_expert_tensor_is_named(make_tiny, tmp_path):
    src = make_tiny("mixtral")
    for case in ("missing", "shape"):
        out = str(tmp_path / case)
        shutil.copytree(src, out)
        file = os.path.join(out, "model.safetensors")
        tensors = load_file(file)
        name = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
        if case == "missing":
            del tensors[name]
        else:
            tensors[name] = tensors[name][:-1].clone()
        save_file(tensors, file, metadata={"format": "pt"})
        assert name in refused(out)
