from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.opt import OPTForCausalLM

# HF architecture name -> our model class. This dict is the whole plugin system.
ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}
