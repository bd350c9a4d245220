"""Widen a trained Llama checkpoint into larger matrix shapes that compute the same function.

    python -m tools.widen_model pdserve/data/default-model /work/copy-05b

There is no model hub here, and a 0.5B-shaped checkpoint from make_model has random weights: it
never repeats its prompt, so speculative decoding has nothing to accept. The widened checkpoint
has a larger model's matrix shapes (by default Qwen2.5-0.5B's: hidden 896, MLP 4864, 24 layers,
q/k/v/o 896x896/128x896/128x896/896x896, vocab 151936), so a decode step reads and multiplies
as many weights as that model, but its greedy tokens are the trained model's:
- the residual stream is the small one, padded with zeros; RMSNorm weights and eps are scaled
  so that the norm over the wider, zero-padded vector equals the norm over the small one;
- the small model's heads keep their head_dim (so RoPE and the softmax scale are unchanged)
  and sit among extra query heads; its KV heads are the wide model's KV heads;
- extra layers are identities (their o_proj and down_proj are zero);
- everything that only reads zeros, or whose output is discarded, is random (as a model's
  weights are), and what would write into the padding is zero;
- extra vocabulary rows copy <unk>'s row, so their logit equals <unk>'s: greedy never
  picks them over the real tokens. Sampled output is not the small model's (the extra rows
  take probability mass): the checkpoint is for greedy measurements.
"""
import argparse
import json
import math
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, vocab_size=151936)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def widen(src: dict[str, torch.Tensor], cfg: dict, hidden: int, inter: int, layers: int, vocab: int,
          unk_id: int = 0, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """The widened state dict and config of a Llama checkpoint (`src`, `cfg`); extra vocabulary
    rows copy row `unk_id`."""
    h, i, n, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if hidden % d:
        raise ValueError(f"hidden size {hidden} is not a multiple of head_dim {d}")
    wide_heads = hidden // d
    group, wide_group = heads // kv, wide_heads // kv
    if wide_heads % kv or wide_group < group or hidden < h or inter < i or layers < n or vocab < v:
        raise ValueError(f"cannot widen {h}/{i}/{n}/{v} with {heads} heads of {d} and {kv} KV heads "
                         f"to {hidden}/{inter}/{layers}/{vocab}")
    gen = torch.Generator().manual_seed(seed)
    std = cfg.get("initializer_range", 0.02)

    def rand(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * std

    # wide query head of each small head: small head g*group+j -> wide head g*wide_group+j
    q_rows = torch.cat([torch.arange(d) + (g * wide_group + j) * d for g in range(kv) for j in range(group)])
    norm_scale = math.sqrt(h / hidden)   # mean of squares over the padded vector is h/hidden of the small one
    out = {}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        real = layer < n
        q, k, vv = rand(hidden, hidden), rand(kv * d, hidden), rand(kv * d, hidden)
        o = torch.zeros(hidden, hidden)
        gate, up, down = rand(inter, hidden), rand(inter, hidden), torch.zeros(hidden, inter)
        ln1, ln2 = torch.ones(hidden), torch.ones(hidden)
        if real:
            q[q_rows, :h] = src[p + "self_attn.q_proj.weight"]
            k[:, :h] = src[p + "self_attn.k_proj.weight"]
            vv[:, :h] = src[p + "self_attn.v_proj.weight"]
            o[:h, q_rows] = src[p + "self_attn.o_proj.weight"]
            gate[:i, :h] = src[p + "mlp.gate_proj.weight"]
            up[:i, :h] = src[p + "mlp.up_proj.weight"]
            down[:h, :i] = src[p + "mlp.down_proj.weight"]
            ln1[:h] = src[p + "input_layernorm.weight"] * norm_scale
            ln2[:h] = src[p + "post_attention_layernorm.weight"] * norm_scale
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": vv, p + "self_attn.o_proj.weight": o,
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": down,
                    p + "input_layernorm.weight": ln1, p + "post_attention_layernorm.weight": ln2})
    norm = torch.ones(hidden)
    norm[:h] = src["model.norm.weight"] * norm_scale
    emb = torch.zeros(vocab, hidden)
    emb[:v, :h] = src["model.embed_tokens.weight"]
    emb[v:] = emb[unk_id]
    out["model.norm.weight"], out["model.embed_tokens.weight"] = norm, emb
    if not cfg.get("tie_word_embeddings", False):
        head = torch.zeros(vocab, hidden)
        head[:v, :h] = src["lm_head.weight"]
        head[v:] = head[unk_id]
        out["lm_head.weight"] = head
    wide = dict(cfg, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, vocab_size=vocab,
                num_attention_heads=wide_heads, head_dim=d, rms_norm_eps=cfg["rms_norm_eps"] * h / hidden)
    wide.pop("layer_types", None)
    return {k: t.contiguous() for k, t in out.items()}, wide


def unk_token_id(model_dir: str) -> int:
    """The id of the tokenizer's unknown token (a token a trained model does not predict), else 0."""
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        unk = json.load(f).get("unk_token")
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        added = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
    return added.get(unk, 0)


def widen_dir(src_dir: str, out_dir: str, hidden: int, inter: int, layers: int, vocab: int, seed: int = 0) -> dict:
    """Write the widened checkpoint; returns its config, with its parameter count."""
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{src_dir}: widening is written for Llama checkpoints, not {cfg.get('model_type')}")
    state, wide = widen(load_file(os.path.join(src_dir, "model.safetensors")), cfg, hidden, inter, layers, vocab,
                        unk_token_id(src_dir), seed)
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(wide, f, indent=2)
    copy_tokenizer(src_dir, out_dir)
    return dict(wide, num_parameters=sum(t.numel() for t in state.values()))


def copy_tokenizer(src_dir: str, out_dir: str) -> None:
    """The tokenizer and generation config of `src_dir`, into `out_dir`."""
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src_dir, name)):
            shutil.copy(os.path.join(src_dir, name), out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.widen_model", description=__doc__.splitlines()[0])
    p.add_argument("src", help="a Llama checkpoint directory (e.g. the bundled default model)")
    p.add_argument("out", help="directory to write the widened checkpoint to")
    p.add_argument("--hidden-size", type=int, default=QWEN2_05B["hidden_size"])
    p.add_argument("--intermediate-size", type=int, default=QWEN2_05B["intermediate_size"])
    p.add_argument("--num-layers", type=int, default=QWEN2_05B["num_hidden_layers"])
    p.add_argument("--vocab-size", type=int, default=QWEN2_05B["vocab_size"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        wide = widen_dir(a.src, a.out, a.hidden_size, a.intermediate_size, a.num_layers, a.vocab_size, a.seed)
    except (OSError, ValueError) as e:
        p.exit(2, f"widen_model: {e}\n")
    print(f"{a.out}: {wide['num_parameters'] / 1e6:.0f}M parameters, "
          f"{wide['num_attention_heads']} heads of {wide['head_dim']}, "
          f"{wide['num_key_value_heads']} KV heads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
