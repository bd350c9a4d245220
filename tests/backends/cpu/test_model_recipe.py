"""Models written once: a Llama-like family is its model class and one registry entry, and the CPU
backend runs it on the decoder stack from the recipe the class declares (models/decoder_spec.py),
with outputs equal to transformers'. A model the stack cannot run keeps its torch modules, and
the log says why in one line."""
import dataclasses
import json
import logging
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve import LLM, SamplingParams, config_fields
from pdserve.backends.cpu.kernels import cpu_ops
from pdserve.backends.cpu.stack import Unsupported, stack_arguments
from pdserve.layers.activation import SiluAndMul
from pdserve.config_fields import CONFIG_FIELDS
from pdserve.models import ARCHITECTURES
from pdserve.models.llama import LlamaForCausalLM
from tests.helpers import chunked_logits, corpus_prompts, hf_greedy, hf_logits

pytestmark = pytest.mark.usefixtures("cpu_isa")
NEW_TOKENS = 12


class OlmoLayerNorm(nn.LayerNorm):
    """OLMo's norm: a LayerNorm without weight or bias (eps 1e-5), called as the Llama layers call
    theirs: norm(x), or norm(x, residual) -> (norm of x + residual, x + residual)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps=1e-5, elementwise_affine=False)

    def forward(self, x, residual=None):
        if residual is None:
            return super().forward(x)
        residual = x + residual
        return super().forward(residual), residual


class OlmoForCausalLM(LlamaForCausalLM):
    """OLMo (transformers' OlmoForCausalLM): a Llama with another norm. All it takes here."""
    norm_class = OlmoLayerNorm


class GeluAndMul(SiluAndMul):
    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class GeluLlamaForCausalLM(LlamaForCausalLM):
    """A Llama whose MLP gates by gelu-tanh (config hidden_act gelu_pytorch_tanh, Gemma's GeGLU)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        for layer in self.model.layers:
            layer.mlp.act = GeluAndMul()

    def decoder_spec(self):
        return dataclasses.replace(super().decoder_spec(), activation="gelu_tanh_and_mul")


class ReluAndMul(SiluAndMul):
    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.relu(gate) * up


class ReluLlamaForCausalLM(LlamaForCausalLM):
    """A Llama whose MLP gates by relu (config hidden_act relu): the stack has no such activation."""

    def __init__(self, cfg):
        super().__init__(cfg)
        for layer in self.model.layers:
            layer.mlp.act = ReluAndMul()

    def decoder_spec(self):
        return dataclasses.replace(super().decoder_spec(), activation="relu_and_mul")


@pytest.fixture(scope="module")
def tiny_olmo(tiny_llama, tmp_path_factory) -> str:
    """The tiny Llama's weights as an OLMo checkpoint (OLMo's norms have no weights), saved by
    transformers' own OlmoForCausalLM, with the Llama's tokenizer."""
    import transformers
    llama = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    c = llama.config
    config = transformers.OlmoConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rope_parameters=c.rope_parameters, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id, tie_word_embeddings=False, dtype="float32")
    olmo = transformers.OlmoForCausalLM(config)
    weights = {k: v for k, v in llama.state_dict().items() if "norm" not in k}
    missing, unexpected = olmo.load_state_dict(weights, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    out = str(tmp_path_factory.mktemp("tiny-olmo"))
    for name in os.listdir(tiny_llama):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(os.path.join(tiny_llama, name), out)
    olmo.save_pretrained(out, safe_serialization=True)
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["OlmoForCausalLM"]
    return out


def count_stack_calls(backend) -> list:
    calls, stack = [], backend.stack

    class Counting:
        def forward(self, *args):
            calls.append(1)
            return stack.forward(*args)
    backend.stack = Counting()
    return calls


def test_a_family_added_by_its_class_and_registry_entries_runs_on_the_stack(tiny_olmo, monkeypatch, caplog):
    monkeypatch.setitem(ARCHITECTURES, "OlmoForCausalLM", OlmoForCausalLM)
    monkeypatch.setitem(CONFIG_FIELDS, "OlmoForCausalLM", config_fields.llama)   # its config.json: Llama's keys
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        llm = LLM(tiny_olmo, max_num_batched_tokens=64, max_num_seqs=8)
    backend = llm.engine.runner.backend
    assert backend.stack is not None and "the decoder stack" in backend.describe()
    assert not [r for r in caplog.records if "decoder stack" in r.getMessage()]
    calls = count_stack_calls(backend)
    prompts = corpus_prompts(llm.tokenizer, lens=[1, 17, 70, 120])
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert calls   # the stack ran the steps
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_olmo, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    for prompt in corpus_prompts(llm.tokenizer, lens=[1, 40]):
        ours = chunked_logits(llm.engine, prompt, chunk=len(prompt))[-1]
        torch.testing.assert_close(ours, hf_logits(tiny_olmo, prompt)[-1], atol=1e-4, rtol=0)


def fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "decoder stack cannot run" in r.getMessage()]


def test_a_geglu_family_runs_on_the_stack(make_tiny, monkeypatch, caplog):
    """GeGLU (Gemma's gelu-tanh gate) on the stack's kernel: transformers' greedy tokens."""
    path = make_tiny("llama", hidden_act="gelu_pytorch_tanh")
    monkeypatch.setitem(ARCHITECTURES, "LlamaForCausalLM", GeluLlamaForCausalLM)
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        llm = LLM(path, max_num_batched_tokens=64)
    backend = llm.engine.runner.backend
    assert backend.stack is not None and not fallback_lines(caplog)
    calls = count_stack_calls(backend)
    prompts = corpus_prompts(llm.tokenizer, lens=[1, 17, 70])
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))):
        assert out.token_ids == hf_greedy(path, prompt, NEW_TOKENS)
    assert calls


def test_a_recipe_the_stack_cannot_run_keeps_the_modules(make_tiny, monkeypatch, caplog):
    path = make_tiny("llama", hidden_act="relu")
    monkeypatch.setitem(ARCHITECTURES, "LlamaForCausalLM", ReluLlamaForCausalLM)
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        llm = LLM(path, max_num_batched_tokens=64)
    backend = llm.engine.runner.backend
    assert backend.name == "cpu" and backend.stack is None and "layer by layer" in backend.describe()
    lines = fallback_lines(caplog)
    assert len(lines) == 1 and "relu_and_mul" in lines[0], lines
    prompts = corpus_prompts(llm.tokenizer, lens=[1, 17, 70])
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))):
        assert out.token_ids == hf_greedy(path, prompt, NEW_TOKENS)


def test_a_head_size_the_attention_kernels_lack_keeps_the_modules(make_tiny, caplog):
    path = make_tiny("llama", head_dim=40)
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        llm = LLM(path, max_num_batched_tokens=64)
    backend = llm.engine.runner.backend
    assert backend.stack is None and "torch attention" in backend.describe()
    lines = fallback_lines(caplog)
    assert len(lines) == 1 and "head size 40" in lines[0], lines
    prompts = corpus_prompts(llm.tokenizer, lens=[1, 17, 70])
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))):
        assert out.token_ids == hf_greedy(path, prompt, NEW_TOKENS)


def test_the_stack_checks_each_tensor_by_name(tiny_llama):
    """The C++ stack takes each layer's tensors by name and checks them: a missing one, an unknown
    one, a wrong shape or a recipe it has no kernel for is refused with the name, never run."""
    llm = LLM(tiny_llama, num_kv_blocks=8)
    model = llm.engine.runner.model
    good = stack_arguments(model, model.decoder_spec())
    assert cpu_ops().DecoderStack(**good).num_layers == len(good["layers"]) == 2

    def broken(layer=None, **changes):
        args = {**good, **changes}
        if layer is not None:
            args["layers"] = [dict(good["layers"][0]), layer(dict(good["layers"][1]))]
        return args
    cases = [
        (broken(lambda t: {k: v for k, v in t.items() if k != "o.packed"}), "needs the tensor o.packed"),
        (broken(lambda t: {**t, "q_norm.weight": t["attn_norm.weight"]}), "takes no tensor q_norm.weight"),
        (broken(lambda t: {**t, "qkv.bias": torch.zeros(3)}), "qkv.bias must be a contiguous fp32 vector"),
        (broken(lambda t: {**t, "o.packed": t["down.packed"]}), "o must take"),
        (broken(lambda t: {**t, "k_cache": t["k_cache"][:, :1]}), "KV cache view"),
        (broken(lambda t: {**t, "mlp_norm.bias": t["mlp_norm.weight"]}), "RMSNorm has a weight and no bias"),
        (broken(activation="relu_and_mul"), "activation must be"),
        (broken(norm="group"), "norm must be"),
        (broken(final_norm={}), "needs the tensor weight"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            cpu_ops().DecoderStack(**args)
    with pytest.raises(Unsupported, match="not a packed linear"):
        stack_arguments(model, dataclasses.replace(model.decoder_spec(), o="self_attn.attn"))
