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
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.gguf.quants import DECODERS, DENSE
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
LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
PERMUTED = {"llama", "granite"}   # GGUF architectures whose converter permuted q/k (LlamaModel.undo_permute)
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> tuple[str, str | None]:
    """(HF name, the block key or None); KeyError for a tensor pdserve has no place for."""
    if name in GLOBAL:
        return GLOBAL[name], None
    m = _BLK.fullmatch(name)
    if m is None or m.group(2) not in BLOCK:
        raise KeyError(name)
    return f"model.layers.{m.group(1)}.{BLOCK[m.group(2)]}.{m.group(3)}", m.group(2)


def unpermute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of the converter's permute along dim 0: GGUF's (head, d/2, 2) row order -> HF's (head, 2, d/2)."""
    n = rows.shape[0]
    return rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def gguf_tensors(f: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, str, torch.Tensor | GroupQuantized]]:
    forms = Counter()
    for name, t in f.tensors.items():
        try:
            hf, key = hf_name(name)
        except KeyError:
            raise CheckpointError(f"{f.path}: unexpected tensor {name!r} for {f.architecture}") from None
        qtype = t.tensor_type
        shape = tuple(int(x) for x in reversed(t.shape))   # ggml lists the fastest dimension first
        linear = key in LINEARS and name.endswith(".weight")
        if linear and qtype in DECODERS:
            decode, form = DECODERS[qtype]
            try:
                value = decode(np.asarray(t.data), *shape)
            except Exception as e:
                raise CheckpointError(f"{f.path}: tensor {name!r} ({qtype.name}) does not decode: {e}") from None
            forms[f"{qtype.name} -> {form}"] += 1
        elif qtype in DENSE or qtype in DECODERS:
            value = torch.from_numpy(np.array(dequantize(np.asarray(t.data), qtype), dtype=np.float32))
            value = value.reshape(shape)
            forms[f"{qtype.name} -> dense" if qtype in DENSE or linear else f"{qtype.name} -> dequantized"] += 1
        else:
            raise CheckpointError(f"{f.path}: tensor {name!r} has type {qtype.name}, which pdserve cannot load "
                                  f"(supported: {', '.join(x.name for x in (*DENSE, *DECODERS))})")
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
