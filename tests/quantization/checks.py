"""What every Hub format's test asserts: pdserve's loaded weights are W_dq exactly and keep the
known codes; the engine's greedy tokens and logits equal transformers running W_dq."""
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.layers.quantized import GroupQuantized
from pdserve.loader import load_model
from tests.helpers import assert_last_position_logits_match, corpus_prompts, hf_logits

MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def pdserve_linear(module: str) -> tuple[str, str]:
    """An HF linear's pdserve module and its place: q_proj -> (qkv_proj, ...)."""
    path, _, name = module.rpartition(".")
    for merged, parts in MERGED.items():
        if name in parts:
            return f"{path}.{merged}", name
    return module, name


def assert_loaded_exactly(path: str, codes: dict, dense: bool = False) -> torch.nn.Module:
    """Each linear's dense weight equals W_dq bit for bit; its `quant` holds the known codes and
    group scales (none where the format is served dense)."""
    cfg = ModelConfig.from_dir(path)
    model = load_model(cfg, torch.float32, "cpu")
    order = [n for parts in MERGED.values() for n in parts]
    groups: dict[str, list] = {}
    for hf_name, c in sorted(codes.items(), key=lambda kv: order.index(kv[0].rpartition(".")[2])
                             if kv[0].rpartition(".")[2] in order else -1):
        target, _ = pdserve_linear(hf_name)
        groups.setdefault(target, []).append(c)
    for target, parts in groups.items():
        m = model.get_submodule(target)
        assert torch.equal(m.weight, torch.cat([c.w_dq for c in parts])), target
        quant = getattr(m, "quant", None)
        if dense:
            assert quant is None, target
            continue
        assert isinstance(quant, GroupQuantized), target
        c0 = parts[0]
        u = torch.cat([c.u for c in parts])
        assert quant.bits == c0.bits and quant.group_size == u.shape[1] // c0.s.shape[1]
        want = u if c0.bits == 4 else u - 128
        assert torch.equal(quant.q.long(), want), target
        assert torch.equal(quant.scale, torch.cat([c.s for c in parts])), target
        assert torch.equal(quant.dequantize(), m.weight), target
    return model


def assert_engine_matches_transformers(path: str, reference: str, **engine_kwargs) -> None:
    """Greedy tokens and last-position logits of pdserve serving the quantized checkpoint equal
    transformers running the plain checkpoint of the dequantized weights."""
    llm = LLM(path, **engine_kwargs)
    prompts = corpus_prompts(llm.tokenizer, lens=[7, 40])
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        # transformers' greedy choice after each prefix (its generate would stop at EOS)
        ref = hf_logits(reference, prompt + out.token_ids)[len(prompt) - 1:-1].argmax(-1).tolist()
        assert out.token_ids == ref
    # the CPU kernels' group codes sum x*q per group, then scale and add offset * sum(x): another
    # fp32 order than transformers' dense product, measured up to 1.03e-4; a wrong code, scale or
    # offset moves a logit by 1e-2 and more
    assert_last_position_logits_match(llm, reference, lens=(1, 33), atol=3e-4)
