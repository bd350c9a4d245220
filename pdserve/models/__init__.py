"""The architectures pdserve runs. Each class builds its family's model from a ModelConfig and
names its input embedding (embed_module); this dict is the whole plugin system: a new Llama-like
family is one more entry here, and one in pdserve/config_fields.py (what its config.json's keys
mean, read before any model class is)."""
from pdserve.config import ModelConfig
from pdserve.engine.kv_spec import KVSpec
from pdserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pdserve.models.gpt_oss import GptOssForCausalLM
from pdserve.models.granite import GraniteForCausalLM
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.mixtral import MixtralForCausalLM
from pdserve.models.ministral import Ministral3ForCausalLM, MinistralForCausalLM
from pdserve.models.olmo2 import Olmo2ForCausalLM
from pdserve.models.opt import OPTForCausalLM
from pdserve.models.phi3 import Phi3ForCausalLM
from pdserve.models.qwen2_moe import Qwen2MoeForCausalLM
from pdserve.models.qwen3 import Qwen3ForCausalLM
from pdserve.models.qwen3_moe import Qwen3MoeForCausalLM
from pdserve.models.smollm3 import SmolLM3ForCausalLM

# HF architecture name -> our model class
ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "MinistralForCausalLM": MinistralForCausalLM,
    "Ministral3ForCausalLM": Ministral3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def kv_spec(cfg: ModelConfig) -> KVSpec:
    """What one token leaves in one layer's KV cache: the family's own kv_spec(cfg) where it declares
    one (MLA's latent), else a K and a V row of num_kv_heads x head_dim."""
    own = getattr(ARCHITECTURES.get(cfg.architecture), "kv_spec", None)
    return own(cfg) if own is not None else KVSpec(planes=2, heads=cfg.num_kv_heads, dim=cfg.head_dim)
