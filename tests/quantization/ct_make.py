"""compressed-tensors checkpoints made with the compressed-tensors package itself: a transformers
model of the tiny checkpoint gets a QuantizationConfig applied (apply_quantization_config), its
scales / zero points / weights set to known RTN values (scales fp16-representable, weights W_dq),
and ModelCompressor compresses and saves it, as llm-compressor's save does."""
import os
import shutil

import torch

from tests.quantization import formats


def fp8_codes(w: torch.Tensor, per_channel: bool):
    """FP8 e4m3 codes of w with fp16-representable scales (per channel or one per tensor)."""
    amax = w.abs().amax(-1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
    s = (amax / 448).half().float()
    q = (w / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def make_compressed(base: str, dst: str, weights: dict, input_activations: dict | None = None,
                    fmt: str | None = None, ignore=("lm_head",)) -> dict:
    """dst: the compressed checkpoint; dst + "-dq": the plain one holding W_dq. Returns
    {linear: Codes} (integer schemes) or {linear: (fp8 codes, scale)} (float)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=None if input_activations is None
                                else QuantizationArgs(**input_activations))
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore),
                                quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, config)
    bits, fp = args.num_bits, args.type == "float"
    group = args.group_size if args.strategy == "group" else -1
    mid = 1 << (bits - 1)
    out = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            if not hasattr(m, "weight_scale"):
                continue
            w = m.weight.data
            if fp:
                q, s = fp8_codes(w, args.strategy == "channel")
                m.weight_scale.data.copy_(s.reshape(m.weight_scale.shape))
                m.weight.data.copy_(q.float() * s)
                out[name] = (q, s)
                if hasattr(m, "input_scale"):
                    m.input_scale.data.fill_(0.05)
                continue
            c = formats.rtn(w, bits, group, args.symmetric)
            m.weight_scale.data.copy_(c.s)
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(c.z - mid)
            m.weight.data.copy_(c.w_dq)
            out[name] = c
    dq = {n: p.detach().clone() for n, p in model.state_dict().items()
          if not n.rpartition(".")[2].startswith(("weight_", "input_"))}
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for f in os.listdir(base):   # the tokenizer
        if not f.endswith(".safetensors") and not os.path.exists(os.path.join(dst, f)):
            shutil.copy(os.path.join(base, f), dst)
    # the reference: the same weights, plain
    formats.copy_checkpoint_files(dst, dst + "-dq", _plain_config(dst))
    from safetensors.torch import save_file
    if model.config.tie_word_embeddings:
        dq.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in dq.items()}, os.path.join(dst + "-dq", "model.safetensors"))
    return out


def make_legacy_act_order(base: str, dst: str, seed: int = 1) -> dict:
    """A W4A16 group-32 asymmetric checkpoint with actorder "group" as llm-compressor wrote them
    before compressed-tensors dropped it (weight_g_idx: each input column's group, groups not
    contiguous), packed with the package's pack_to_int32; dst + "-dq" the plain reference."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    gen = torch.Generator().manual_seed(seed)
    scheme = {"targets": ["Linear"], "input_activations": None, "output_activations": None,
              "format": "pack-quantized",
              "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
                          "actorder": "group", "dynamic": False}}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": scheme}, "ignore": ["lm_head"], "version": "0.9.0"}

    def quantize(module, w):
        return formats.rtn(w, 4, 32, sym=False, perm=torch.randperm(w.shape[1], generator=gen))

    def pack(c):
        return {"weight_packed": pack_to_int32((c.u - 8).to(torch.int8), 4),
                "weight_shape": torch.tensor(c.u.shape), "weight_scale": c.s,
                "weight_zero_point": pack_to_int32((c.z - 8).to(torch.int8), 4, packed_dim=0),
                "weight_g_idx": c.g_idx}

    return formats.quantize_checkpoint(base, dst, qc, quantize, pack)


def _plain_config(path: str) -> dict:
    import json
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    return cfg
