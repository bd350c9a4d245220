"""`python -m tools.make_model`: write a real HF checkpoint with random weights and a trained tokenizer.

The model is built by transformers' own classes (OPT, Llama, Qwen2, Mistral; Gemma 2, Gemma 3
(text), Phi-3; Qwen3, OLMo 2, Granite, SmolLM3, Ministral, Ministral 3; Qwen2-MoE, Qwen3-MoE,
Mixtral, DeepSeek-V3, gpt-oss (`--mxfp4`: its experts in MXFP4 as the Hub ships them); the vision-language Gemma 3 and
Mistral 3 / Ministral 3 with a tiny vision tower) and saved with
`save_pretrained(safe_serialization=True)`; the tokenizer is a byte-level BPE trained with HF
`tokenizers` on the corpus shipped in tools/corpus, following each family's
special-token conventions, so `transformers.AutoTokenizer` and `pdserve.tokenizer.Tokenizer`
give identical ids. Tests build tiny checkpoints with this; `--size 0.5b` gives a
Qwen2.5-0.5B-shaped model for benchmarks, `--size 8b --dtype bfloat16 --device cuda` a
Llama-3-8B-shaped one, drawn on the GPU (benchmarks/device_check.py).

Init scale. transformers' usual init (std 0.02) gives nearly flat logits, where float noise
flips the greedy argmax and exact-equality tests against transformers become unfair. We draw
weight matrices with std INIT_GAIN / sqrt(fan_in) = 2 / sqrt(fan_in) (0.25 at width 64) and
embeddings / lm_head with std EMBED_GAIN / sqrt(dim) = 8 / sqrt(dim) (1.0 at width 64; this sets
the logit scale). Scaling by width keeps the 0.5b model finite with the same peakedness. The
1-D parameters are random too (norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2)), so an engine
that drops a bias or a norm weight produces different tokens. Measured on the tiny models,
8 corpus stories x 128 positions:

    top-1 minus top-2 logit margin     median   10th pct   positions < 0.01
    std 0.02 (transformers default)    0.03     0.005      18%
    ours: llama / mistral              1.72     0.27       0.5%
    ours: qwen2                        1.59     0.20       1.0%
    ours: opt                          1.50     0.25       0.2%
    ours: opt 350m-style (post-LN)     3.53     0.44       0.1%
    ours: llama, llama3 rope, tied     1.62     0.25       0.2%
    ours: gemma2 (caps 5 / 30)         1.46     0.20       0.6%
    ours: gemma3 (final cap 30)        1.36     0.18       0.4%
    ours: phi3                         1.47     0.27       0.8%
    ours: qwen3 (windowed layer 1)     1.48     0.24       0.7%
    ours: olmo2                        1.62     0.26       0.5%
    ours: granite                      1.38     0.24       0.4%
    ours: smollm3 (NoPE, windows)      1.45     0.22       0.3%
    ours: ministral (windowed, full)   1.63     0.26       0.7%
    ours: ministral3                   1.70     0.28       0.2%
    ours: qwen2_moe (dense layer 1)    1.61     0.22       0.5%
    ours: qwen3_moe (windows of 48)    1.56     0.22       0.5%
    ours: mixtral (windows of 48)      1.71     0.24       0.6%
    ours: deepseek_v3 (MLA, dense 0)  1.59     0.26       0.6%
    ours: gpt_oss (window 32, sinks)   1.55     0.27       0.5%
    ours: gpt_oss --mxfp4              1.60     0.24       0.6%
    (qwen2 0.5b, 64 positions:         1.80)

Logits stay finite (|logit| < 100), changing one early prompt token changes about 40-55% of
later greedy predictions (attention matters; 17% on gemma, whose local layer has a 16-token
window), and greedy continuations differ across prompts.
tests/test_make_model.py re-checks this for every arch.
"""
import argparse
import functools
import sys
import json
import math
import os
import shutil

from tools import CORPUS_DIR
from pdserve.errors import CheckpointError

ARCHS = ("opt", "llama", "qwen2", "mistral", "gemma2", "gemma3", "phi3")
ARCHS += ("qwen3", "olmo2", "granite", "smollm3", "ministral", "ministral3")
ARCHS += ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
SIZES = ("tiny", "0.5b", "hub", "8b")
INIT_GAIN = 2.0  # weight matrices: std = INIT_GAIN / sqrt(fan_in), 0.25 at width 64
EMBED_GAIN = 8.0  # embeddings and lm_head: std = EMBED_GAIN / sqrt(dim), 1.0 at 64; sets the logit scale
ONE_D_STD = 0.1  # spread of biases and norm weights
GEMMA2_ATTN_CAP = 5.0
GEMMA_FINAL_CAP = 30.0

# Pre-tokenizer regexes: GPT-4/Llama-3 style (digits in groups of up to 3) and Qwen2's (single
# digits). Qwen2's must be exact: transformers always loads qwen2 tokenizers as Qwen2Tokenizer,
# which rebuilds the pipeline with this regex and NFC normalization.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# ChatML: one block per message; the llama/mistral variant starts with BOS as their templates do.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_BOS = "{{ bos_token }}" + CHATML
# Gemma's turns (the assistant is "model") and Phi-3's role tags
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + message['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# Each family's special tokens. `leading` are trained in at ids 0.. (as OPT/Llama/Mistral have
# them); `trailing` are appended after the learned vocabulary (as Qwen2 has them).
FAMILIES = {
    "opt": dict(leading=["<s>", "<pad>", "</s>", "<unk>"], trailing=[], bos="</s>", eos="</s>", pad="<pad>",
                unk="<unk>", add_bos=True, regex=None, nfc=False, template=None, extra_eos=[]),
    "llama": dict(leading=["<unk>", "<s>", "</s>"], trailing=["<|im_start|>", "<|im_end|>"], bos="<s>", eos="</s>",
                  pad=None, unk="<unk>", add_bos=True, regex=LLAMA3_REGEX, nfc=False, template=CHATML_BOS,
                  extra_eos=["<|im_end|>"]),
    "qwen2": dict(leading=[], trailing=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None,
                  eos="<|endoftext|>", pad="<|endoftext|>", unk=None, add_bos=False, regex=QWEN2_REGEX, nfc=True,
                  template=CHATML, extra_eos=["<|im_end|>"]),
}
FAMILIES["mistral"] = FAMILIES["llama"]
FAMILIES["gemma2"] = FAMILIES["gemma3"] = dict(
    leading=["<pad>", "<eos>", "<bos>", "<unk>"], trailing=["<start_of_turn>", "<end_of_turn>"], bos="<bos>",
    eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True, regex=LLAMA3_REGEX, nfc=False, template=GEMMA_TEMPLATE,
    extra_eos=["<end_of_turn>"])
FAMILIES["phi3"] = dict(
    leading=["<unk>", "<s>", "</s>"], trailing=["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>", unk="<unk>", add_bos=False, regex=LLAMA3_REGEX, nfc=False,
    template=PHI3_TEMPLATE, extra_eos=["<|end|>"])
FAMILIES["qwen3"] = FAMILIES["qwen2"]
FAMILIES["qwen2_moe"] = FAMILIES["qwen3_moe"] = FAMILIES["qwen2"]
for _arch in ("olmo2", "granite", "smollm3", "ministral", "ministral3", "mixtral", "deepseek_v3"):
    FAMILIES[_arch] = FAMILIES["llama"]
# gpt-oss: harmony's special tokens after the vocabulary; a turn is <|start|>role<|message|>...<|end|>,
# the assistant's answer ends with <|return|> (a tool call with <|call|>)
HARMONY_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)
FAMILIES["gpt_oss"] = dict(
    leading=[], trailing=["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                          "<|constrain|>", "<|return|>", "<|call|>"],
    bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>", unk=None, add_bos=False, regex=LLAMA3_REGEX,
    nfc=False, template=HARMONY_TEMPLATE, extra_eos=["<|endoftext|>", "<|call|>"])
# vision-language checkpoints (a tiny vision tower beside the text model): pdserve serves their text part
VLM_TEXT = {"gemma3_vlm": "gemma3", "mistral3_vlm": "mistral", "ministral3_vlm": "ministral3"}
ARCHS += tuple(VLM_TEXT)
for _arch, _text in VLM_TEXT.items():
    FAMILIES[_arch] = FAMILIES[_text]

# Model shapes. Tiny: fast CPU tests, grouped-query attention for the llama family.
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, opt_ffn=256, max_pos=1024, vocab=1500)
QWEN05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, opt_ffn=4864, max_pos=32768,
               vocab=32000, model_vocab=151936, rope_theta=1000000.0)
# `--size 8b`: Llama-3-8B's shape (8.03B parameters, 16 GB in bf16) for the GPU roofline
# (benchmarks/device_check.py). Draw it where it will run (`--device cuda`): 8B normals take minutes
# on a CPU and well under a second on a GPU.
LLAMA3_8B = dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, opt_ffn=14336, max_pos=8192,
                 vocab=32000, model_vocab=128256, rope_theta=500000.0)
SHAPES = {"tiny": TINY, "0.5b": QWEN05B, "hub": QWEN05B, "8b": LLAMA3_8B}
# `--size hub`: the smallest Hub model of a family at its real shape (config.json of Qwen/Qwen3-0.6B and
# google/gemma-3-1b-it), for benchmarks at the shapes people download; the tokenizer stays the 32k one.
HUB_SHAPES = {
    "qwen3": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False, max_window_layers=28),
    "gemma3": dict(hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=256, intermediate_size=6912, vocab_size=262144, max_position_embeddings=32768,
                   query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6, rope_theta=1000000.0,
                   rope_local_base_freq=10000.0, final_logit_softcapping=None, attn_logit_softcapping=None,
                   tie_word_embeddings=True),
    # Qwen3-30B-A3B: 48 layers of 128 experts (768 wide, top 8); fewer with --set num_hidden_layers=N
    "qwen3_moe": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                      tie_word_embeddings=False, use_sliding_window=False, max_window_layers=48),
    # gpt-oss-20b: 24 layers alternating windowed (128) and full, 32 experts (2880 wide, top 4)
    "gpt_oss": dict(hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                    vocab_size=201088, max_position_embeddings=131072, sliding_window=128, swiglu_limit=7.0,
                    tie_word_embeddings=False),
}


# ---------------------------------------------------------------- tokenizer

def corpus_texts(max_story_chars: int | None = None) -> list[str]:
    """Training text for tokenizers: stories, dialogue turns and the multilingual sample."""
    with open(os.path.join(CORPUS_DIR, "stories.txt"), encoding="utf-8") as f:
        stories = f.read(max_story_chars) if max_story_chars else f.read()
    texts = stories.split("\n\n")
    with open(os.path.join(CORPUS_DIR, "dialogues.jsonl"), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if max_story_chars and i >= 2000:
                break
            texts.extend(m["content"] for m in json.loads(line))
    with open(os.path.join(CORPUS_DIR, "unicode.txt"), encoding="utf-8") as f:
        texts.extend(f.read().splitlines())
    return texts


def corpus_prompts(tokenizer, lens, offset: int = 0) -> list[list[int]]:
    """Token-id prompts of exactly the given lengths, cut from varied corpus text (`tokenizer`: a
    pdserve Tokenizer of a checkpoint made here); the tests' prompts and the device check's."""
    ids = _corpus_ids(tokenizer)
    prompts, start = [], offset
    for n in lens:
        prompts.append(ids[start:start + n])
        start += n * 3 + 11
    return prompts


@functools.lru_cache(maxsize=None)
def _corpus_ids(tokenizer) -> list[int]:
    text = " ".join(corpus_texts())[:40000]   # ~10k tokens: plenty, and fast to encode
    return tokenizer.encode(text, add_special_tokens=False)


def train_tokenizer(arch: str, vocab_size: int, texts: list[str]):
    """A byte-level BPE `tokenizers.Tokenizer` with the special tokens of `arch`'s family."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    fam = FAMILIES[arch]
    tok = Tokenizer(models.BPE())
    if fam["nfc"]:
        tok.normalizer = normalizers.NFC()
    if fam["regex"]:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(fam["regex"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:  # GPT-2 style, as OPT uses
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(fam["trailing"]),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in fam["leading"]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fam["trailing"]])
    if fam["add_bos"]:
        bos = fam["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def save_tokenizer(tok, arch: str, out_dir: str, max_len: int) -> None:
    """tokenizer.json plus a tokenizer_config.json that makes transformers build the same pipeline."""
    fam = FAMILIES[arch]
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True}
             for t in fam["leading"] + fam["trailing"]}
    config = {
        # transformers 5 maps model types to tokenizer classes that rebuild the pipeline (Llama's is
        # Metaspace-based); the generic class keeps ours. qwen2 is always loaded as Qwen2Tokenizer,
        # whose pipeline our qwen2 tokenizer.json reproduces exactly.
        "tokenizer_class": "Qwen2Tokenizer" if arch == "qwen2" else "PreTrainedTokenizerFast",
        "bos_token": fam["bos"], "eos_token": fam["eos"], "unk_token": fam["unk"], "pad_token": fam["pad"],
        "add_bos_token": fam["add_bos"], "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "added_tokens_decoder": added,
    }
    if fam["template"] is not None:
        config["chat_template"] = fam["template"]
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


# ---------------------------------------------------------------- model

def build_config(arch: str, size: str, vocab_size: int, special_ids: dict, overrides: dict):
    """A transformers config for `arch` at `size`; `overrides` are config fields set last."""
    import transformers

    if arch in VLM_TEXT:
        return vlm_config(arch, size, vocab_size, special_ids, overrides)
    s = SHAPES[size]
    std = INIT_GAIN / math.sqrt(s["hidden"])  # recorded in the config; init_weights does the actual init
    common = dict(vocab_size=vocab_size, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], max_position_embeddings=s["max_pos"],
                  bos_token_id=special_ids["bos"], eos_token_id=special_ids["eos"], pad_token_id=special_ids["pad"],
                  dtype="float32")
    if arch == "opt":
        kw = dict(common, ffn_dim=s["opt_ffn"], do_layer_norm_before=True, word_embed_proj_dim=s["hidden"],
                  activation_function="relu", enable_bias=True, init_std=std, tie_word_embeddings=True)
        return transformers.OPTConfig(**{**kw, **overrides})
    kw = dict(common, intermediate_size=s["intermediate"], num_key_value_heads=s["kv_heads"],
              initializer_range=std, rms_norm_eps=1e-6,
              rope_theta=s.get("rope_theta", 10000.0), tie_word_embeddings=arch == "qwen2" or size == "0.5b")
    if arch == "llama":
        return transformers.LlamaConfig(**{**kw, **overrides})
    if arch == "mistral":
        return transformers.MistralConfig(**{**kw, "sliding_window": None, **overrides})
    if arch in ("gemma2", "gemma3"):
        return gemma_config(arch, kw, overrides)
    if arch == "phi3":
        return transformers.Phi3Config(**{**kw, "sliding_window": None, **overrides})
    # The 2026 families: windows shorter than the test prompts where the family has them, an explicit
    # head_dim unlike hidden / heads (Qwen3), NoPE layers (SmolLM3), non-trivial multipliers (Granite).
    # (Tiny here; at 0.5b the same features at Qwen2.5-0.5B's shape.)
    tiny, head_dim = size == "tiny", s["hidden"] // s["heads"]
    if arch == "qwen3":   # layer 0 full attention, layer 1 windowed (from max_window_layers)
        return transformers.Qwen3Config(**{**kw, "head_dim": 2 * head_dim, "tie_word_embeddings": True,
                                           "use_sliding_window": tiny, "sliding_window": 16, "max_window_layers": 1,
                                           **overrides})
    if arch == "olmo2":
        return transformers.Olmo2Config(**{**kw, **overrides})
    # Granite 3's are 12, 1/128, 0.22 and 8 (for trained weights); ours keep the greedy margins wide and
    # attention mattering (with 4, 0.15, 0.5, 2 the embeddings drown the blocks: no token changes)
    if arch == "granite":
        return transformers.GraniteConfig(**{**kw, "embedding_multiplier": 1.5, "attention_multiplier": 0.2,
                                             "residual_multiplier": 0.7, "logits_scaling": 1.25,
                                             "tie_word_embeddings": True, **overrides})
    if arch == "smollm3":   # 4 layers: RoPE full, NoPE windowed, RoPE windowed, NoPE full
        layers = dict(num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=16,
                      layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])
        return transformers.SmolLM3Config(**{**kw, **(layers if tiny else {}), **overrides})
    if arch == "ministral":   # Ministral 8B's interleaving: windowed, then full
        types = ["sliding_attention", "full_attention"] * (s["layers"] // 2)
        return transformers.MinistralConfig(**{**kw, "head_dim": head_dim, "sliding_window": 16 if tiny else 4096,
                                               "layer_types": types, **overrides})
    if arch == "ministral3":   # plain RoPE (yarn: rope_parameters), q scaled from position 64 on
        rope = {"rope_type": "default", "rope_theta": kw["rope_theta"], "llama_4_scaling_beta": 0.1,
                "original_max_position_embeddings": 64 if tiny else 16384}
        return transformers.Ministral3Config(**{**kw, "head_dim": head_dim, "rope_parameters": rope,
                                                "sliding_window": None, **overrides})
    if arch in ("qwen2_moe", "qwen3_moe", "mixtral"):
        return moe_config(arch, kw, tiny, head_dim, overrides)
    if arch == "deepseek_v3":
        return deepseek_v3_config(kw, tiny, overrides)
    if arch == "gpt_oss":
        return gpt_oss_config(kw, tiny, head_dim, overrides)
    return transformers.Qwen2Config(**{**kw, "use_sliding_window": False, **overrides})


def moe_config(arch: str, kw: dict, tiny: bool, head_dim: int, overrides: dict):
    """The MoE families: 8 experts, top 2, each expert half the dense MLP's width. Tiny: Qwen2-MoE
    has 3 layers, the middle one dense (mlp_only_layers), a gated shared expert, layer 0 windowed
    (16; its rule: the even layers below max_window_layers); Qwen3-MoE per-head q/k norms, an
    explicit head_dim, renormalised top-k, every layer windowed (48); Mixtral every layer windowed (48)."""
    import transformers

    moe = dict(num_experts_per_tok=2, moe_intermediate_size=kw["intermediate_size"] // 2)
    # every layer windowed (Qwen3-MoE, Mixtral): 48 tokens, so that an early token still reaches
    # enough later ones (with 16, 10% of the predictions change; with 48, about 30%)
    window = dict(use_sliding_window=True, sliding_window=48) if tiny else {}
    if arch == "qwen2_moe":
        layers = dict(num_hidden_layers=3, mlp_only_layers=[1], max_window_layers=1) if tiny else {}
        return transformers.Qwen2MoeConfig(**{**kw, **moe, "num_experts": 8, "norm_topk_prob": False,
                                             "shared_expert_intermediate_size": kw["intermediate_size"],
                                             **window, **(dict(sliding_window=16) if tiny else {}), **layers,
                                             **overrides})
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**kw, **moe, "num_experts": 8, "norm_topk_prob": True,
                                             "head_dim": 2 * head_dim, **window, **overrides})
    return transformers.MixtralConfig(**{**kw, "num_local_experts": 8, "num_experts_per_tok": 2,
                                         "intermediate_size": kw["intermediate_size"] // 2, "head_dim": head_dim,
                                         "sliding_window": 48 if tiny else None, **overrides})


def deepseek_v3_config(kw: dict, tiny: bool, overrides: dict):
    """DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing). Tiny: 3 layers, layer 0
    dense (first_k_dense_replace), the others 8 routed experts in 4 groups (top 2 from the best 2
    groups, renormalised, scaled by 2.5; a random e_score_correction_bias: init_weights) and one
    shared expert; q through a rank-32 latent (q_lora_rank; None: a plain q_proj), K/V through a
    rank-32 latent plus a 16-dim rope key, heads of 16 + 16 (q, k) and 24 (v); interleaved yarn
    RoPE whose mscale_all_dim scales the softmax (transformers folds it into the attention scale)."""
    import transformers

    I = kw["intermediate_size"]
    shape = dict(num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                 qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
                 n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=I // 2,
                 routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                 rope_parameters={"rope_type": "yarn", "rope_theta": kw["rope_theta"], "factor": 4.0,
                                  "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 0.8,
                                  "beta_fast": 32, "beta_slow": 1}) if tiny else {}
    kw = {k: v for k, v in kw.items() if k != "rope_theta"}   # in rope_parameters
    return transformers.DeepseekV3Config(**{**kw, "num_key_value_heads": kw["num_attention_heads"], **shape,
                                            **overrides})


def vlm_config(arch: str, size: str, vocab_size: int, special_ids: dict, overrides: dict):
    """Gemma 3 4B+ (Gemma3ForConditionalGeneration: a SigLIP tower) and Mistral Small 3.1 / Ministral 3
    (Mistral3ForConditionalGeneration: a Pixtral tower) as the Hub ships them: the text family's config
    as text_config, a one-layer vision tower of width 32 on 28-pixel images. `overrides` go to the text
    config, except tie_word_embeddings (the composite config's, as transformers ties by it)."""
    import transformers

    text = build_config(VLM_TEXT[arch], size, vocab_size, special_ids,
                        {k: v for k, v in overrides.items() if k != "tie_word_embeddings"})
    tie = overrides.get("tie_word_embeddings", text.tie_word_embeddings)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    if arch == "gemma3_vlm":
        return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                         tie_word_embeddings=tie)
    return transformers.Mistral3Config(text_config=text, vision_config=dict(vision, head_dim=16),
                                       tie_word_embeddings=tie)


def gpt_oss_config(kw: dict, tiny: bool, head_dim: int, overrides: dict):
    """gpt-oss: 8 experts, top 2, layers alternating windowed (32) and full, YaRN (factor 8 past
    128 positions at tiny size), biases everywhere, and a SwiGLU clamp the tiny model's gates and
    ups reach (swiglu_limit 1.5; 7 in the real models, where activations are larger). Its expert
    sizes are multiples of 32, so that --mxfp4 can write them as MXFP4 blocks."""
    import transformers

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0 if tiny else 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128 if tiny else 4096}
    return transformers.GptOssConfig(**{**kw, "head_dim": head_dim, "num_local_experts": 8 if tiny else 32,
                                        "num_experts_per_tok": 2 if tiny else 4, "sliding_window": 32 if tiny else 128,
                                        "intermediate_size": kw["hidden_size"] if tiny else 2880,
                                        "rope_parameters": rope, "swiglu_limit": 1.5 if tiny else 7.0,
                                        "attention_bias": True, "rms_norm_eps": 1e-5, **overrides})


def gemma_config(arch: str, kw: dict, overrides: dict):
    """Gemma 2 / Gemma 3 (text) at the tiny sizes: head_dim 16 (real Gemma's 256 is beyond the CPU
    attention kernels, which take 16-128), local layers interleaved with global ones (layer 0 local,
    layer 1 global) with a window shorter than the test prompts, an attention scale of its own, and
    soft caps at the tiny model's scale: Gemma 2's attention cap below its largest scores (left out,
    the tokens change) and the final cap near its largest logits (left out, the logits change)."""
    import transformers

    kw = dict(kw, hidden_activation="gelu_pytorch_tanh", head_dim=kw["hidden_size"] // kw["num_attention_heads"],
              query_pre_attn_scalar=32, sliding_window=16, tie_word_embeddings=True,
              final_logit_softcapping=GEMMA_FINAL_CAP)
    if arch == "gemma2":
        return transformers.Gemma2Config(**{**kw, "attn_logit_softcapping": GEMMA2_ATTN_CAP, **overrides})
    # Gemma 3: the local layers' RoPE base apart from the global one's, q/k norms (in the weights)
    kw = dict(kw, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=2)
    return transformers.Gemma3TextConfig(**{**kw, **overrides})


MODEL_CLASSES = {"opt": "OPTForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM"}


def norm_center(gemma: bool, name: str, dim: int) -> float:
    """The mean of a norm's weights: 1. Gemma's norms scale by (1 + w), so w is drawn around 0, except
    in its post-block norms: about sqrt(dim), so that the blocks' outputs weigh in the stream as
    much as the embedding, which Gemma scales by sqrt(dim) (else attention hardly matters)."""
    if not gemma:
        return 1.0
    return math.sqrt(dim) - 1.0 if ".post_" in name else 0.0


MODEL_CLASSES.update(qwen3="Qwen3ForCausalLM", olmo2="Olmo2ForCausalLM", granite="GraniteForCausalLM",
                     smollm3="SmolLM3ForCausalLM", ministral="MinistralForCausalLM",
                     ministral3="Ministral3ForCausalLM", qwen2_moe="Qwen2MoeForCausalLM",
                     qwen3_moe="Qwen3MoeForCausalLM", mixtral="MixtralForCausalLM",
                     deepseek_v3="DeepseekV3ForCausalLM",
                     gemma3_vlm="Gemma3ForConditionalGeneration", mistral3_vlm="Mistral3ForConditionalGeneration",
                     ministral3_vlm="Mistral3ForConditionalGeneration",
                     gpt_oss="GptOssForCausalLM")


def init_weights(model, seed: int, device: str = "cpu") -> None:
    """Peaked random init (see module docstring); the std shrinks with width so 0.5b stays finite.
    device: where the numbers are drawn (the model's parameters are there); each device's generator
    gives its own numbers for a seed."""
    import torch

    gemma = model.config.model_type.startswith("gemma")

    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda shape: torch.randn(shape, generator=gen, device=gen.device)  # noqa: E731
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if p.dim() >= 2:
                gain = EMBED_GAIN if "embed" in name or "lm_head" in name else INIT_GAIN
                # [(experts,) out, in] for linears, [rows, dim] for embeddings; gpt-oss's experts are [E, in, out]
                fan_in = p.shape[-2] if ".experts." in name and model.config.model_type == "gpt_oss" else p.shape[-1]
                std = gain / math.sqrt(fan_in)
                p.copy_(randn(p.shape) * std)
            elif name.endswith("sinks"):   # gpt-oss's sink logits: about the size of the attention scores
                p.copy_(randn(p.shape))
            elif name.endswith("bias"):
                p.copy_(randn(p.shape) * ONE_D_STD)
            else:  # norm weights
                p.copy_(norm_center(gemma, name, p.shape[0]) + randn(p.shape) * ONE_D_STD)
        for name, b in model.named_buffers():   # DeepSeek-V3's router bias (a buffer): choosing must use it
            if name.endswith("e_score_correction_bias"):
                b.copy_(randn(b.shape) * ONE_D_STD)


def make_model(out_dir: str, arch: str = "llama", size: str = "tiny", seed: int = 0, force: bool = False,
               mxfp4: bool = False, dtype: str = "float32", device: str = "cpu", **config_overrides) -> str:
    """Write a random-init checkpoint of `arch` at `size` to out_dir; returns out_dir. mxfp4 (gpt_oss
    only): its experts written as MXFP4 blocks and scales, as the Hub ships gpt-oss. dtype: the
    weights' dtype (bfloat16 builds the larger sizes at half the memory, as the Hub ships them).
    device: where the weights are made and drawn (cuda: the 8b size in seconds)."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise CheckpointError(f"{out_dir}: unknown --arch {arch!r} (choose from {', '.join(ARCHS)})")
    if mxfp4 and arch != "gpt_oss":
        raise CheckpointError(f"{out_dir}: --mxfp4 is for --arch gpt_oss (its experts), not {arch}")
    if size not in SIZES:
        raise CheckpointError(f"{out_dir}: unknown --size {size!r} (choose from {', '.join(SIZES)})")
    if dtype not in ("float32", "bfloat16"):
        raise CheckpointError(f"{out_dir}: unknown --dtype {dtype!r} (choose from float32, bfloat16)")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise CheckpointError(f"{out_dir}: unknown --device {device!r} (cpu, cuda or cuda:N)")
    if device != "cpu" and not torch.cuda.is_available():
        raise CheckpointError(f"{out_dir}: --device {device}: no CUDA device here")
    if size == "hub":
        if arch not in HUB_SHAPES:
            raise CheckpointError(f"{out_dir}: no --size hub shape for {arch!r} (have: {', '.join(HUB_SHAPES)})")
        config_overrides = {**HUB_SHAPES[arch], **config_overrides}
    config_overrides = {**config_overrides, "dtype": dtype}
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir}: exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not force:
            raise CheckpointError(f"{out_dir}: directory exists and is not empty (use --force to overwrite)")
        shutil.rmtree(out_dir)
    os.makedirs(out_dir, exist_ok=True)

    s = SHAPES[size]
    # The tiny tokenizer only needs part of the corpus; it keeps test setup fast.
    tok = train_tokenizer(arch, s["vocab"], corpus_texts(max_story_chars=400_000 if size == "tiny" else None))
    fam = FAMILIES[arch]
    ids = {k: tok.token_to_id(fam[k]) if fam[k] else None for k in ("bos", "eos", "pad")}
    # Embedding rows rounded up to a multiple of 64, as real checkpoints pad their vocabularies.
    vocab = s.get("model_vocab") or 64 * math.ceil(tok.get_vocab_size() / 64)
    torch.manual_seed(seed)
    model_cls = getattr(transformers, MODEL_CLASSES[arch])
    try:
        config = build_config(arch, size, vocab, ids, config_overrides)
        if size == "tiny":
            model = model_cls(config).to(getattr(torch, dtype)).to(device)
            init_weights(model, seed, device)
            with torch.no_grad():  # a bad override (e.g. heads not dividing) fails here, not in a later test
                if not torch.isfinite(model(torch.tensor([[0, 1, 2]], device=device)).logits).all():
                    raise ValueError("non-finite logits")
        else:
            # Skip transformers' own init of 0.5B parameters; init_weights fills them all anyway.
            with torch.device("meta"):
                model = model_cls(config).to(getattr(torch, dtype))
            model = model.to_empty(device=device)
            model.tie_weights()  # to_empty gives tied weights separate storage
            init_weights(model, seed, device)
            # The tokenizer fills only a sliver of the 151936 rows; keep the rest near zero (as unused rows
            # of a trained model are) so greedy output is mostly ids the tokenizer can decode.
            with torch.no_grad():
                for emb in {model.get_input_embeddings().weight, model.get_output_embeddings().weight}:
                    emb[tok.get_vocab_size():] *= 0.01
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{out_dir}: invalid config override {config_overrides} ({reason})") from None
    model.eval()
    eos = [ids["eos"]] + [tok.token_to_id(t) for t in fam["extra_eos"]]
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=eos if len(eos) > 1 else eos[0], pad_token_id=ids["pad"])
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tok, arch, out_dir, config.get_text_config().max_position_embeddings)
    if mxfp4:
        del model   # the file is rewritten from disk: the model's memory is free for the quantizer
        write_mxfp4_experts(out_dir)
    return out_dir


def write_mxfp4_experts(out_dir: str) -> None:
    """Replace a gpt-oss checkpoint's dense experts by MXFP4 in the Hub's layout: for each of
    mlp.experts.gate_up_proj (E, H, 2I) and down_proj (E, I, H), `<name>_blocks` uint8
    (E, out, in / 32, 16) and `<name>_scales` uint8 (E, out, in / 32) of the (E, out, in)
    transpose (pdserve/quantization/mxfp4.py's quantize), and config.json's quantization_config
    quant_method mxfp4 with the modules gpt-oss leaves unquantized."""
    import torch
    from safetensors.torch import load_file, save_file
    from pdserve.quantization.mxfp4 import quantize

    file = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # one expert at a time: quantize's temporaries are ~30 bytes a weight (gpt-oss-20b's shape
        # at once ran out of 24 GB)
        parts = [quantize(w.transpose(0, 1)) for w in tensors.pop(name)]
        tensors[f"{name}_blocks"] = torch.stack([b for b, _ in parts])
        tensors[f"{name}_scales"] = torch.stack([s for _, s in parts])
        del parts
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


# ---------------------------------------------------------------- CLI

def _override(text: str):
    """--set key=value; the value is parsed as JSON when it can be (numbers, bools, null, dicts)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="directory to write the checkpoint to")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty out_dir")
    parser.add_argument("--mxfp4", action="store_true", help="gpt_oss: write the experts in MXFP4, as the Hub ships them")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the weights' dtype")
    parser.add_argument("--device", default="cpu",
                        help="where the weights are made and drawn (cuda: `--size 8b --dtype bfloat16` in seconds)")
    parser.add_argument("--set", dest="overrides", type=_override, action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. --set tie_word_embeddings=true (repeatable)")


def run(args) -> int:
    out = make_model(args.out_dir, args.arch, args.size, args.seed, force=args.force, mxfp4=args.mxfp4,
                     dtype=args.dtype, device=args.device, **dict(args.overrides))
    print(f"wrote {args.arch} {args.size} checkpoint to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from pdserve.errors import CheckpointError
    parser = argparse.ArgumentParser(prog="python -m tools.make_model", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except CheckpointError as e:
        print(f"make_model: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
