"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: gptq`).

Per linear: qweight int32 (K * bits / 32, N), codes packed along K, lowest bits first; qzeros
int32 (G, N * bits / 32), packed along N the same way; scales fp16 (G, N); g_idx int32 (K,), the
group of each input column. Checkpoint format v1 (`gptq`, the default) stores z - 1 (vLLM and the
exllama kernels add 1 back, unmasked: a stored 15 is z = 16), v2 (`gptq_v2`) stores z."""
import torch

from pdserve.errors import CheckpointError
from pdserve.quantization.codes import act_order_dense, group_form, trivial_g_idx, unpack_int32

PARTS = ("qweight", "qzeros", "scales", "g_idx")


def parts(scheme) -> tuple[set, set]:
    return {"qweight", "qzeros", "scales"}, {"g_idx"}


def role(suffix: str, tensor: torch.Tensor) -> str | None:
    return "part" if suffix in PARTS else None


def convert(quant, module: str, t: dict, where: str):
    s = quant.scheme
    bits = s.bits
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    for name in ("qweight", "qzeros"):
        if t[name].dtype != torch.int32:
            raise CheckpointError(f"{where}: {module}.{name} is {t[name].dtype}, GPTQ packs int32")
    K, N = qweight.shape[0] * 32 // bits, qweight.shape[1]
    group = K if s.group_size == -1 else s.group_size
    G = K // group
    if K % group or tuple(scales.shape) != (G, N) or tuple(qzeros.shape) != (G, N * bits // 32):
        raise CheckpointError(f"{where}: {module}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                              f"scales {tuple(scales.shape)} do not fit {bits}-bit GPTQ with group size {s.group_size}")
    u = unpack_int32(qweight, bits, 0).t().contiguous()           # (N, K)
    zero = unpack_int32(qzeros, bits, 1).t()                       # (N, G)
    if quant.checkpoint_format == "gptq":
        zero = zero + 1
    scale = scales.t()
    g_idx = t.get("g_idx")
    if s.g_idx:   # act-order: groups are not contiguous in k
        if g_idx is None:
            raise CheckpointError(f"{where}: {module}.g_idx is missing (desc_act is true)")
        if tuple(g_idx.shape) != (K,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= G:
            raise CheckpointError(f"{where}: {module}.g_idx must hold {K} group numbers below {G}")
        return act_order_dense(u, zero, scale, bits, g_idx)
    if g_idx is not None and not trivial_g_idx(g_idx, K, group):
        raise CheckpointError(f"{where}: {module}.g_idx reorders the groups but desc_act is false")
    return group_form(u, zero, scale, bits)
