"""`python -m tools.quantize_hub SRC DST --format gptq|awq|ct ...`: Hub quantized checkpoints
(AWQ, GPTQ, compressed-tensors) made from an HF checkpoint by round-to-nearest, as users have
them, for tests and benchmarks (docs/QUANTIZATION.md).

The packing follows the formats' published layouts, written here (not from pdserve's readers):
AutoAWQ's GEMM order, GPTQ's int32 packing along K with v1 (z - 1) or v2 zeros and g_idx;
compressed-tensors checkpoints are written by the compressed-tensors package itself
(apply_quantization_config + ModelCompressor, as llm-compressor saves). Each writes DST and
DST-dq, the plain checkpoint holding the dequantized weights W_dq (transformers' reference).

Scales are fp16 values (as the formats store them), so (q - z) * s is exact in fp32 whichever way
it is computed: W_dq is one well-defined tensor."""
import argparse
import json
import os
import shutil
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Codes:
    """One linear's RTN quantization: unsigned codes u (N, K), zero points z and scales s per
    group (N, G), each column k in group g_idx[k]."""
    u: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor
    g_idx: torch.Tensor
    bits: int

    @property
    def w_dq(self) -> torch.Tensor:
        cols = self.g_idx.long()
        return ((self.u.double() - self.z[:, cols].double()) * self.s[:, cols].double()).float()


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool, perm: torch.Tensor | None = None,
        min_zero: int = 0) -> Codes:
    """Round-to-nearest codes of w, groups of `group` columns (-1: all), taken in the order `perm`
    (act-order) when given; sym: z = 2^(bits-1). min_zero keeps asymmetric zeros >= it (GPTQ v1
    cannot store z = 0)."""
    N, K = w.shape
    g = K if group == -1 else group
    perm = torch.arange(K) if perm is None else perm
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[perm] = (torch.arange(K) // g).to(torch.int32)
    x = w.double()[:, perm].view(N, K // g, g)
    maxq = (1 << bits) - 1
    if sym:
        s = (x.abs().amax(-1) / ((maxq - 1) / 2)).clamp_min(1e-4)
        s = s.half().double()
        z = torch.full_like(s, 1 << (bits - 1))
    else:
        lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
        s = ((hi - lo) / maxq).clamp_min(1e-4).half().double()
        z = torch.round(-lo / s).clamp(min_zero, maxq)
    u = torch.clamp(torch.round(x / s[..., None]) + z[..., None], 0, maxq).view(N, K)
    unperm = torch.empty_like(u)
    unperm[:, perm] = u
    return Codes(unperm.long(), z.long(), s.float(), g_idx, bits)


def to_int32(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 tensor with those bits."""
    x = x & 0xFFFFFFFF
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight packing: 32 / bits consecutive rows into one int32 word, the first lowest."""
    per = 32 // bits
    R, C = v.shape
    v = v.long().view(R // per, per, C)
    return to_int32(sum(v[:, i] << (bits * i) for i in range(per)))


def pack_cols(v: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """32 / bits consecutive columns into one word: nibble i (lowest first) holds column order[i]
    of its run (GPTQ's qzeros: in order; AutoAWQ's GEMM: 0, 2, 4, 6, 1, 3, 5, 7)."""
    per = 32 // bits
    order = order or list(range(per))
    R, C = v.shape
    v = v.long().view(R, C // per, per)
    return to_int32(sum(v[:, :, order[i]] << (bits * i) for i in range(per)))


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def gptq_tensors(c: Codes, v1: bool = True) -> dict:
    z = c.z - 1 if v1 else c.z
    return {"qweight": pack_rows(c.u.t(), c.bits), "qzeros": pack_cols(z.t() & ((1 << c.bits) - 1), c.bits),
            "scales": c.s.t().half().contiguous(), "g_idx": c.g_idx}


def awq_tensors(c: Codes) -> dict:
    return {"qweight": pack_cols(c.u.t(), 4, AWQ_ORDER), "qzeros": pack_cols(c.z.t(), 4, AWQ_ORDER),
            "scales": c.s.t().half().contiguous()}


def read_tensors(path: str) -> dict:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def copy_checkpoint_files(src: str, dst: str, config: dict) -> None:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_sharded(dst: str, tensors: dict) -> None:
    """Two shards, names alternating, so one linear's parts are spread over both files."""
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[0::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, os.path.join(dst, file), metadata={"format": "pt"})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}, f)


def quantize_checkpoint(src: str, dst: str, quantization_config: dict, quantize, pack) -> dict[str, Codes]:
    """dst: src with every decoder linear replaced by pack(quantize(name, weight)), sharded; and
    dst + "-dq": the plain checkpoint holding the dequantized weights. Returns the codes by name."""
    tensors = read_tensors(src)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    codes, packed, plain = {}, {}, {}
    for name, t in tensors.items():
        module, _, param = name.rpartition(".")
        if param == "weight" and module.rpartition(".")[2] in LINEARS:
            c = codes[module] = quantize(module, t)
            packed.update({f"{module}.{k}": v for k, v in pack(c).items()})
            plain[name] = c.w_dq
        else:
            packed[name] = plain[name] = t
    copy_checkpoint_files(src, dst, dict(config, quantization_config=quantization_config))
    write_sharded(dst, packed)
    copy_checkpoint_files(src, dst + "-dq", config)
    save_file(plain, os.path.join(dst + "-dq", "model.safetensors"), metadata={"format": "pt"})
    return codes


# --- compressed-tensors, written by the package ----------------------------------------


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
            c = rtn(w, bits, group, args.symmetric)
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
    copy_checkpoint_files(dst, dst + "-dq", _plain_config(dst))
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
        return rtn(w, 4, 32, sym=False, perm=torch.randperm(w.shape[1], generator=gen))

    def pack(c):
        return {"weight_packed": pack_to_int32((c.u - 8).to(torch.int8), 4),
                "weight_shape": torch.tensor(c.u.shape), "weight_scale": c.s,
                "weight_zero_point": pack_to_int32((c.z - 8).to(torch.int8), 4, packed_dim=0),
                "weight_g_idx": c.g_idx}

    return quantize_checkpoint(base, dst, qc, quantize, pack)


def _plain_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.quantize_hub", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="an HF checkpoint directory (safetensors)")
    ap.add_argument("dst", help="the quantized checkpoint to write (and DST-dq, its dequantized weights)")
    ap.add_argument("--format", required=True, choices=["gptq", "awq", "ct"],
                    help="GPTQ, AutoAWQ GEMM, or compressed-tensors (pack-quantized, or FP8 with --fp8)")
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--group", type=int, default=128, help="group size; -1: one per output channel")
    ap.add_argument("--asym", action="store_true", help="zero points (AWQ always has them)")
    ap.add_argument("--act-order", action="store_true", help="GPTQ: a random column order with g_idx (desc_act)")
    ap.add_argument("--gptq-v2", action="store_true", help="GPTQ: checkpoint_format gptq_v2 (zeros stored as z)")
    ap.add_argument("--fp8", choices=["static", "dynamic"], help="compressed-tensors FP8 W8A8, per-channel weight scales")
    a = ap.parse_args(argv)
    if a.format == "ct":
        if a.fp8:
            fp8 = dict(num_bits=8, type="float", symmetric=True)
            acts = dict(fp8, strategy="tensor", dynamic=False) if a.fp8 == "static" else \
                dict(fp8, strategy="token", dynamic=True)
            make_compressed(a.src, a.dst, dict(fp8, strategy="channel"), acts)
        else:
            strategy = dict(strategy="channel") if a.group == -1 else dict(strategy="group", group_size=a.group)
            make_compressed(a.src, a.dst, dict(num_bits=a.bits, type="int", symmetric=not a.asym, **strategy))
        return
    gen = torch.Generator().manual_seed(0)
    if a.format == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": a.group, "zero_point": True, "version": "gemm"}
        quantize_checkpoint(a.src, a.dst, qc, lambda m, w: rtn(w, 4, a.group, False), awq_tensors)
        return
    fmt = "gptq_v2" if a.gptq_v2 else "gptq"
    qc = {"quant_method": "gptq", "bits": a.bits, "group_size": a.group, "sym": not a.asym,
          "desc_act": a.act_order, "checkpoint_format": fmt}

    def quantize(module, w):
        perm = torch.randperm(w.shape[1], generator=gen) if a.act_order else None
        return rtn(w, a.bits, a.group, not a.asym, perm, min_zero=0 if a.gptq_v2 else 1)

    quantize_checkpoint(a.src, a.dst, qc, quantize, lambda c: gptq_tensors(c, not a.gptq_v2))


if __name__ == "__main__":
    main()
