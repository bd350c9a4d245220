"""The labs' shared setup: the 0.5B engine's packed linears, layer by layer, in call order."""
from pdserve.engine.llm_engine import LLMEngine


def layer_linears(mm) -> list:
    """A loaded Llama-family model's (runner.model) layer linears, in call order."""
    mods = []
    for layer in mm.model.layers:
        mods += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return mods


def model_linears(model: str = "/work/q05", lm_head: bool = False):
    mm = LLMEngine(model).runner.model
    mods = layer_linears(mm)
    return mods + [mm.lm_head] if lm_head else mods
