"""SmolLM3 (transformers' SmolLM3ForCausalLM): a Llama whose every no_rope_layer_interval-th layer
has no RoPE (NoPE; config.json's no_rope_layers: 1 = RoPE, 0 = none), with optional
sliding-window layers (layer_types, under use_sliding_window)."""
from dataclasses import replace

from pdserve.config import ModelConfig
from pdserve.models.llama import LlamaForCausalLM, LlamaVariant, refuse, swiglu_variant, windows_of


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        raw, L = cfg.raw, cfg.num_layers
        rope = raw.get("no_rope_layers")
        if rope is None:   # transformers' default: every interval-th layer (the 4th, 8th, ...) has none
            interval = raw.get("no_rope_layer_interval", 4)
            rope = [int((i + 1) % interval != 0) for i in range(L)]
        if len(rope) != L:
            refuse(cfg, f"no_rope_layers has {len(rope)} entries for {L} layers")
        window, use = raw.get("sliding_window"), raw.get("use_sliding_window", False)
        types = raw.get("layer_types") or [
            "sliding_attention" if use and window is not None and not rope[i] else "full_attention" for i in range(L)]
        if "sliding_attention" in types and not (use and window is not None):
            # transformers masks such layers' windows in its eager and SDPA attention but not in its
            # flash attention (without use_sliding_window), or fails (without a sliding_window):
            # no one answer to be exact to
            refuse(cfg, "layer_types has sliding_attention layers but use_sliding_window is false or "
                        "sliding_window is null (transformers' attention implementations disagree on such a model)")
        return replace(swiglu_variant(cfg, windows_of(cfg, window, types)),
                       rope_layers=tuple(bool(r) for r in rope))
