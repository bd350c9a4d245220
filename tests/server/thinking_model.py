"""A tiny Qwen3 checkpoint that thinks: a real checkpoint (make_model's Qwen3, untied lm_head)
whose tokenizer has `<think>`, `</think>`, `<tool_call>`, `</tool_call>` as tokens, whose chat
template follows Qwen3's (tools in the system turn, `enable_thinking: false` renders an empty
`<think>\\n\\n</think>\\n\\n`), and whose weights make greedy decoding follow a script.

The weights: every layer's projections are zero, so each position's hidden state is its own
token's embedding (attention and MLP add nothing), and the lm_head maps the embedding of each
script token to the next one (row `next` = SCALE x the unit embedding of `current`). So the
greedy output depends only on the prompt's last token: after the thinking prompt's last token
the model writes THINKING_SCRIPT, after the non-thinking prompt's (which ends in `</think>\\n\\n`)
it writes the answer directly. Under a grammar the masked argmax still follows the logits, so a
constrained answer is whatever the grammar allows that the model ranks first: valid, not scripted.
"""
import json
import os

import pytest
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from tools.make_model import make_model

TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}
{%- for tc in message.tool_calls or [] %}<tool_call>{{ tc.function | tojson }}</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

# Pieces the script writes, each one added token (so every step of the script is one token).
REASONING_1 = "The user asks about the weather, not {JSON}."
REASONING_2 = ' Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>?'
ANSWER = "It is sunny."
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# After the thinking prompt: <think> R1 R2 </think> ANSWER <tool_call> CALL </tool_call> <|im_end|>
THINKING_SCRIPT = ["<think>", REASONING_1, REASONING_2, "</think>", ANSWER, "<tool_call>", CALL, "</tool_call>",
                   "<|im_end|>"]
REASONING = REASONING_1 + REASONING_2
CONTENT = ANSWER + "<tool_call>" + CALL + "</tool_call>"
SCALE = 4.0
# the schemas the tests constrain the answer with
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
DIGIT = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["answer"], "additionalProperties": False}


def make_thinking_model(out_dir: str) -> str:
    make_model(out_dir, "qwen3", tie_word_embeddings=False)
    tok_path = os.path.join(out_dir, "tokenizer.json")
    tok = Tokenizer.from_file(tok_path)
    # "\n\n" as one token, as Qwen's vocabulary has it: the non-thinking prompt then ends in it, the
    # thinking one in "\n", and the two continue differently
    pieces = TAGS + [REASONING_1, REASONING_2, ANSWER, CALL, "\n\n"]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in pieces])
    tok.save(tok_path)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = TEMPLATE
    with open(config_path, "w") as f:
        json.dump(config, f)

    from pdserve.tokenizer import Tokenizer as PdTokenizer
    pd = PdTokenizer.from_dir(out_dir)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    thinking = pd.encode_chat(messages)[-1]
    direct = pd.encode_chat(messages, enable_thinking=False)[-1]
    assert thinking != direct and pd.id_to_token(direct) not in TAGS, "the two prompts must end in distinct tokens"
    ids = [pd.token_to_id(t) for t in THINKING_SCRIPT]
    assert None not in ids and len(set(ids)) == len(ids)
    steps = list(zip([thinking] + ids[:-1], ids)) + [(direct, pd.token_to_id(ANSWER))]

    weights_path = os.path.join(out_dir, "model.safetensors")
    w = load_file(weights_path)
    for name, t in w.items():
        if ".layers." in name and t.dim() == 2:
            t.zero_()   # the layers add nothing to the residual stream
    w["model.norm.weight"].fill_(1.0)
    emb, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    assert max(ids) < emb.shape[0]
    head.zero_()
    for current, nxt in steps:
        head[nxt] += SCALE * emb[current] / emb[current].norm()
    save_file({k: v.contiguous() for k, v in w.items()}, weights_path, metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return make_thinking_model(str(tmp_path_factory.mktemp("thinking")))
