"""Quantized models on the CPU backend: a tiny Qwen2/Llama loaded from a synthetic quantized source
(round-to-nearest codes, the loader's group form) runs its linears on the group-quantized kernels
(in the decoder stack and layer by layer) and gives the torch path's greedy tokens on the
dequantized weights, logprobs within fp32 tolerance; --quantization int4 runs end to end and
matches the torch path on the same round-to-nearest weights."""
import pytest

from pdserve import LLM, SamplingParams
from pdserve.backends.cpu.quant_linear import QuantLinear, round_to_nearest
from pdserve.engine import model_runner
from pdserve.loader import load_model, safetensors_tensors

from tests.helpers import corpus_prompts

pytestmark = pytest.mark.usefixtures("cpu_isa")


def _source(path, quantize):
    for file, name, t in safetensors_tensors(path):
        yield file, name, quantize(name, t)


def _load_with(monkeypatch, quantize):
    """The engine's loader reads the checkpoint through quantize(name, tensor) -> tensor or codes."""
    monkeypatch.setattr(model_runner, "load_model",
                        lambda cfg, dtype, device, **kw: load_model(cfg, dtype, device, _source(cfg.path, quantize), **kw))


def generate(llm: LLM, prompts):
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True)
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]


def assert_close(got, ref, atol=2e-3):
    for (ids, lps), (ref_ids, ref_lps) in zip(got, ref):
        assert ids == ref_ids
        for a, b in zip(lps, ref_lps):
            for t in a.keys() & b.keys():
                assert abs(a[t] - b[t]) <= atol, (a[t], b[t])


@pytest.mark.parametrize("arch,bits,group", [("qwen2", 4, 32), ("llama", 4, 16), ("qwen2", 8, 16), ("llama", 8, 32)])
def test_quantized_checkpoint_matches_torch_on_dequantized_weights(make_tiny, monkeypatch, arch, bits, group):
    path = make_tiny(arch)
    _load_with(monkeypatch, lambda name, t: round_to_nearest(t, bits, group) if name.endswith("_proj.weight") else t)
    llm = LLM(path, max_num_batched_tokens=48, max_num_seqs=8)
    backend = llm.engine.runner.backend
    model = llm.engine.runner.model
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 4 * llm.engine.model_config.num_layers and all(m.bits == bits for m in quant)
    assert f"w{bits} g{group} packed linears" in backend.describe()
    assert backend.stack is not None, backend.why_no_stack
    prompts = corpus_prompts(llm.tokenizer, lens=[3, 40, 17, 1])
    stacked = generate(llm, prompts)
    backend.stack, stack = None, backend.stack   # the same modules layer by layer
    llm.engine.reset_prefix_cache()
    layered = generate(llm, prompts)
    backend.stack = stack
    assert stacked == layered   # the same kernels in the same order
    ref = generate(LLM(path, max_num_batched_tokens=48, max_num_seqs=8, cpu_kernels=False), prompts)
    assert_close(stacked, ref)


def test_a_quantized_checkpoint_is_never_made_dense(make_tiny, monkeypatch):
    """The CPU backend runs the codes: the engine loads without the linears' dense weights (left on
    the meta device, never allocated), which the torch backend still gets."""
    path = make_tiny("qwen2")
    loaded = []

    def load(cfg, dtype, device, **kw):
        model = load_model(cfg, dtype, device, _source(cfg.path, lambda name, t: round_to_nearest(t, 4, 32)
                                                         if name.endswith("_proj.weight") else t), **kw)
        loaded.append({n: p.is_meta for n, p in model.named_parameters()})
        return model
    monkeypatch.setattr(model_runner, "load_model", load)
    LLM(path, max_num_batched_tokens=48)
    meta = [n for n, is_meta in loaded[-1].items() if is_meta]
    assert meta and all(n.endswith("_proj.weight") for n in meta)
    assert len(meta) == 4 * 2 and not any(loaded[-1][n] for n in loaded[-1] if not n.endswith("_proj.weight"))
    LLM(path, max_num_batched_tokens=48, cpu_kernels=False)   # the torch backend multiplies dense weights
    assert not any(loaded[-1].values())


def test_int4_flag_end_to_end(make_tiny, monkeypatch):
    """--quantization int4: layers in 4-bit groups of 32, lm_head int8 per channel; the torch path on
    the same round-to-nearest weights (dequantized) gives the same tokens."""
    path = make_tiny("qwen2")
    llm = LLM(path, quantization="int4", max_num_batched_tokens=48)
    assert "w4 g32 packed linears (lm_head int8)" in llm.engine.runner.backend.describe()
    assert llm.engine.runner.backend.stack is not None
    prompts = corpus_prompts(llm.tokenizer, lens=[5, 30])
    got = generate(llm, prompts)
    tied = llm.engine.model_config.tie_word_embeddings
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"

    def rtn(name, t):
        if name.endswith("_proj.weight"):
            return round_to_nearest(t, 4, 32).dequantize()
        if name == head:
            return round_to_nearest(t, 8, t.shape[1]).dequantize()
        return t

    _load_with(monkeypatch, rtn)
    ref = generate(LLM(path, cpu_kernels=False, max_num_batched_tokens=48), prompts)
    assert_close(got, ref)


def test_a_quantized_checkpoint_keeps_its_codes_whatever_the_flag(make_tiny, monkeypatch):
    _load_with(monkeypatch, lambda name, t: round_to_nearest(t, 8, 16) if name.endswith("_proj.weight") else t)
    llm = LLM(make_tiny("llama"), quantization="int4")
    assert "w8 g16 packed linears (lm_head fp32)" in llm.engine.runner.backend.describe()


def test_int4_needs_the_cpu_kernels(tiny_llama):
    with pytest.raises(ValueError, match="--quantization int4"):
        LLM(tiny_llama, quantization="int4", cpu_kernels=False)
