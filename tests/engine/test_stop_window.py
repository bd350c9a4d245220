"""Stop strings are found however much text one step adds: a long token (Qwen2's and Llama 3's
vocabularies have tokens of dozens of characters) can carry a stop string far from its end."""
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams


@pytest.fixture
def engine(tiny_llama):
    e = LLMEngine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=32, block_size=16)
    # ids past the tokenizer's vocabulary are still rows of the model's (padded) embedding
    assert e.tokenizer.vocab_size + 4 <= e.model_config.vocab_size
    return e


def force(engine, tokens: list[int]):
    """The sampler's tokens replaced by `tokens`, in order, one per step."""
    real, it = engine.runner.execute, iter(tokens)

    def execute(sched):
        return [(seq, next(it), lp) for seq, _, lp in real(sched)]
    engine.runner.execute = execute


@pytest.mark.parametrize("final_only", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_far_inside_a_long_token_is_found(engine, final_only, include):
    tok = engine.tokenizer
    long_text = "x" * 60 + "STOP" + "y" * 40   # the match starts 80 characters before the token's end
    tok._tok.add_tokens([long_text])
    long_id = tok.token_to_id(long_text)
    short = tok.encode(" a b", add_special_tokens=False)
    force(engine, short + [long_id] + short * 4)
    params = SamplingParams(max_tokens=20, temperature=1.0, stop=["STOP"], ignore_eos=True,
                            include_stop_str_in_output=include, final_only=final_only)
    engine.add_request("r", [1, 2, 3], params)
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.new_text
            final = out if out.finished else final
    want = tok.decode(short) + "x" * 60 + ("STOP" if include else "")
    assert (final.finish_reason, final.stop_reason) == ("stop", "STOP")
    assert final.text == want and streamed == want
    assert list(final.token_ids) == short + [long_id]
