"""Test-side quantization and packing into the Hub formats, written from the formats' published
layouts (not from pdserve's readers): round-to-nearest codes of a tiny model's linears, packed as
AutoAWQ GEMM, GPTQ (v1 / v2 zeros, g_idx) or compressed-tensors (by the compressed-tensors package
itself), written as a real HF checkpoint; plus the plain checkpoint holding the dequantized weights
W_dq that transformers runs as the reference.

Scales are fp16 values (as the formats store them), so (q - z) * s is exact in fp32 whichever way
it is computed: W_dq is one well-defined tensor."""
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
