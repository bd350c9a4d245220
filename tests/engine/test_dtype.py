"""bfloat16 runs end to end; where it diverges from fp32 it is a near-tie (vLLM's rule: at the
first differing token, each side's token is among the other's top-5 logprobs)."""
from pdserve import LLM, SamplingParams
from tests.helpers import corpus_prompts, tokens_before_divergence


def test_bfloat16_close_to_float32(tiny_llama):
    fp32 = LLM(tiny_llama)
    bf16 = LLM(tiny_llama, dtype="bfloat16")
    assert bf16.engine.runner.kv_cache.dtype.is_floating_point and str(bf16.engine.runner.dtype) == "torch.bfloat16"
    prompts = corpus_prompts(fp32.tokenizer, lens=[5, 17, 40, 100])
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=5, ignore_eos=True)
    same = tokens_before_divergence(fp32.generate(prompts, params), bf16.generate(prompts, params))
    assert same >= 16   # mostly identical, not merely top-5 agreement
