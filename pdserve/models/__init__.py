"""The architectures pdserve runs. Each class reads its family's config.json (config_fields) and
names its input embedding (embed_module); this dict is the whole plugin system: a new Llama-like
family is one more entry."""
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.opt import OPTForCausalLM

# HF architecture name -> our model class
ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}
