"""The decoder stack in one C++ call (kernels/decoder_cpu.cpp) computes exactly what the Python
modules compute: same kernels, same order, so every logprob is bitwise equal, in steps that mix
decodes and prefill chunks."""
import pytest

from pdserve import LLM, SamplingParams
from pdserve.kernels import cpu_supports_avx512
from tests.engine.helpers import corpus_prompts

pytestmark = pytest.mark.skipif(not cpu_supports_avx512(), reason="the CPU kernels need AVX-512")

VARIANTS = {
    "llama": ("llama", {}, {}),
    "qwen2-bias": ("qwen2", {}, {}),                    # q/k/v biases
    "mistral-window": ("mistral", {"sliding_window": 8}, {}),
    "llama-int8": ("llama", {}, {"quantization": "int8"}),
}


class CountingStack:
    """Wraps the model's LlamaStack and counts its forwards: the test must not pass by not running it."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


def generate(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=5, ignore_eos=True)
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stack_equals_modules(make_tiny, variant):
    arch, overrides, engine_kwargs = VARIANTS[variant]
    # a small budget: long prompts are prefilled in chunks while the short ones decode
    llm = LLM(make_tiny(arch, **overrides), max_num_batched_tokens=48, max_num_seqs=8, **engine_kwargs)
    model = llm.engine.runner.model.model
    assert model.stack is not None, "the runner did not switch the stack on"
    prompts = corpus_prompts(llm.tokenizer, lens=[3, 70, 17, 1, 40])
    model.stack = CountingStack(model.stack)
    fused = generate(llm, prompts)
    calls, stack = model.stack.calls, model.stack.stack
    model.stack = None
    modules = generate(llm, prompts)
    model.stack = stack
    assert calls > 10
    assert fused == modules
    llm.engine.block_manager.check_all_free()


def test_stack_off_where_kernels_do_not_apply(tiny_llama, tiny_opt):
    assert LLM(tiny_llama, cpu_kernels=False).engine.runner.model.model.stack is None
    assert LLM(tiny_llama, dtype="bfloat16").engine.runner.model.model.stack is None
    assert not hasattr(LLM(tiny_opt).engine.runner.model.model, "stack")   # OPT: the modules
