"""The weights of a GGUF file as (file, HF tensor name, tensor) for loader.load_model.

Names: llama.cpp's `blk.N.attn_q.weight` back to the HF checkpoint's
`model.layers.N.self_attn.q_proj.weight` (the families' tensor maps in gguf-py's
tensor_mapping.py, inverted for the tensors pdserve's models have). Values: a linear's quantized
weight (quants.py's types) becomes a GroupQuantized, kept quantized; F32/F16/BF16 tensors and
every other tensor (embeddings, norms, an output head in any type) are dequantized with
`gguf.quants.dequantize` and the loader casts them to the model dtype. llama.cpp's converter
reorders the rows of Llama-family q and k projections for its rotary layout (LlamaModel.permute in
convert_hf_to_gguf); that is undone here, on the codes and their scales alike (whole rows move)."""
import logging
import re
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from gguf.quants import dequantize

from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.gguf.quants import DECODERS, DENSE, FORMS
from pdserve.gguf.reader import GGUFFile
from pdserve.layers.quantized import GroupQuantized

log = logging.getLogger("pdserve")

GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
BLOCK = {   # blk.N.<key> -> model.layers.N.<value>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    # OLMo 2's norms after the attention and the MLP (it has none before them)
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
LINEARS = {"attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
# linears pdserve runs as one merged linear (qkv, gate_up): their shards must share one form
MERGED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
PERMUTED = {"llama", "granite", "smollm3"}   # GGUF architectures whose converter permuted q/k (LlamaModel.undo_permute)
# a family's own names where they differ from BLOCK's: Gemma's ffn_norm is the MLP's input norm (its
# post_attention_norm the attention output's, as OLMo 2's); Phi-3 keeps q/k/v as one attn_qkv and
# gate/up as one ffn_up (its checkpoint's own qkv_proj, gate_up_proj)
GEMMA_BLOCK = {"ffn_norm": "pre_feedforward_layernorm"}
BLOCK_OVERRIDES = {"gemma2": GEMMA_BLOCK, "gemma3": GEMMA_BLOCK,
                   "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
# Gemma's norms are stored as offsets from one (norm(x) * (1 + w)); llama.cpp's converter adds the
# one (Gemma3Model.norm_shift), taken off again here: fl(1 + w) - 1 is exact, so 1 + it is fl(1 + w)
NORM_SHIFTED = {"gemma2", "gemma3"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str, arch: str = "llama") -> tuple[str, str | None]:
    """(HF name, the block key or None); KeyError for a tensor pdserve has no place for."""
    if name in GLOBAL:
        return GLOBAL[name], None
    m = _BLK.fullmatch(name)
    block = BLOCK | BLOCK_OVERRIDES.get(arch, {})
    if m is None or m.group(2) not in block:
        raise KeyError(name)
    return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}", m.group(2)


def unpermute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of the converter's permute along dim 0: GGUF's (head, d/2, 2) row order -> HF's (head, 2, d/2)."""
    n = rows.shape[0]
    return rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def merged_forms(f: GGUFFile) -> dict[str, tuple[int, int, bool] | None]:
    """Tensor name -> the (bits, group size, offset) its shard of a merged linear is widened to, where
    the shards' types differ (Q4_K_M keeps q/k in Q4_K and v in Q6_K); None: load the shards dense
    (some are F32/F16/BF16). The widened form holds the same values: 4-bit codes as 8-bit ones, a
    group's scale and offset repeated over its finer groups, a zero offset where one is missing."""
    out = {}
    for i in range(int(f.arch_get("block_count", 0) or 0)):
        for keys in MERGED:
            names = [f"blk.{i}.{k}.weight" for k in keys if f"blk.{i}.{k}.weight" in f.tensors]
            types = {f.tensors[n].tensor_type for n in names}
            if len(types) < 2:
                continue
            if not all(t in DECODERS for t in types):
                out.update(dict.fromkeys(names))
                continue
            forms = [FORMS[t] for t in types]
            target = (max(b for b, _, _ in forms), min(g for _, g, _ in forms), any(o for _, _, o in forms))
            out.update(dict.fromkeys(names, target))
    return out


def widen(gq: GroupQuantized, bits: int, group: int, offset: bool) -> GroupQuantized:
    q = gq.q.to(torch.int8) if bits == 8 else gq.q   # 4-bit codes 0..15 are the same 8-bit codes
    k = gq.group_size // group
    scale = gq.scale.repeat_interleave(k, dim=1)
    off = gq.offset.repeat_interleave(k, dim=1) if gq.offset is not None else \
        torch.zeros_like(scale) if offset else None
    return GroupQuantized(q, scale, off, group, bits)


def gguf_tensors(f: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, str, torch.Tensor | GroupQuantized]]:
    forms = Counter()
    widened = merged_forms(f)
    for name, t in f.tensors.items():
        try:
            hf, key = hf_name(name, f.architecture)
        except KeyError:
            why = " (long-rope scaling factors, which pdserve does not read from GGUF)" if "rope_factors" in name else ""
            raise CheckpointError(f"{f.path}: unexpected tensor {name!r} for {f.architecture}{why}") from None
        qtype = t.tensor_type
        shape = tuple(int(x) for x in reversed(t.shape))   # ggml lists the fastest dimension first
        linear = key in LINEARS and name.endswith(".weight")
        if linear and qtype in DECODERS and not (name in widened and widened[name] is None):
            decode, form = DECODERS[qtype]
            try:
                value = decode(np.asarray(t.data), *shape)
            except Exception as e:
                raise CheckpointError(f"{f.path}: tensor {name!r} ({qtype.name}) does not decode: {e}") from None
            if name in widened and widened[name] != FORMS[qtype]:
                bits, group, offset = widened[name]
                value = widen(value, bits, group, offset)
                form = f"{bits}-bit group {group}{' + offset' if offset else ''} (widened: a merged linear's shards differ)"
            forms[f"{qtype.name} -> {form}"] += 1
        elif qtype in DENSE or qtype in DECODERS:
            value = torch.from_numpy(np.array(dequantize(np.asarray(t.data), qtype), dtype=np.float32))
            value = value.reshape(shape)
            forms[f"{qtype.name} -> dense" if qtype in DENSE or linear else f"{qtype.name} -> dequantized"] += 1
        else:
            raise CheckpointError(f"{f.path}: tensor {name!r} has type {qtype.name}, which pdserve cannot load "
                                  f"(supported: {', '.join(x.name for x in (*DENSE, *DECODERS))})")
        if f.architecture in NORM_SHIFTED and name.endswith("norm.weight"):
            value = value - 1
        if f.architecture in PERMUTED and key in ("attn_q", "attn_k"):
            heads = cfg.num_heads if key == "attn_q" else cfg.num_kv_heads
            value = _unpermute_value(value, heads)
        yield f.path, hf, value
    log.info("%s: %s", f.path, "; ".join(f"{n} {k}" for k, n in sorted(forms.items())))


def _unpermute_value(value, heads: int):
    if isinstance(value, GroupQuantized):
        return GroupQuantized(unpermute(value.q, heads), unpermute(value.scale, heads),
                              None if value.offset is None else unpermute(value.offset, heads),
                              value.group_size, value.bits)
    return unpermute(value, heads)
