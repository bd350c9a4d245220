"""AWQ checkpoints (AutoAWQ / llm-awq, `quant_method: awq`, version gemm).

Per linear: qweight int32 (K, N / 8), each word holding 8 output columns' 4-bit codes in AutoAWQ's
interleaved order (nibble i, lowest first, is column ORDER[i] of its 8); qzeros int32 (G, N / 8)
packed the same way (the zero points themselves, no offset); scales fp16 (G, N). w = (q - z) * s."""
import torch

from pdserve.errors import CheckpointError
from pdserve.quantization.codes import group_form, unpack_int32

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # nibble i holds column ORDER[i]
COLUMN_NIBBLE = [ORDER.index(c) for c in range(8)]   # column c is in nibble COLUMN_NIBBLE[c]


def parts(scheme) -> tuple[set, set]:
    return {"qweight", "qzeros", "scales"}, set()


def role(suffix: str, tensor: torch.Tensor) -> str | None:
    return "part" if suffix in ("qweight", "qzeros", "scales") else None


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (R, 8 C) codes in column order."""
    R, C = packed.shape
    nibbles = unpack_int32(packed, 4, 1).view(R, C, 8)
    return nibbles[:, :, COLUMN_NIBBLE].reshape(R, C * 8)


def convert(quant, module: str, t: dict, where: str):
    group = quant.scheme.group_size
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    for name in ("qweight", "qzeros"):
        if t[name].dtype != torch.int32:
            raise CheckpointError(f"{where}: {module}.{name} is {t[name].dtype}, AWQ packs int32")
    K, N = qweight.shape[0], qweight.shape[1] * 8
    if K % group or tuple(scales.shape) != (K // group, N) or tuple(qzeros.shape) != (K // group, N // 8):
        raise CheckpointError(f"{where}: {module}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                              f"scales {tuple(scales.shape)} do not fit 4-bit AWQ GEMM with group size {group}")
    return group_form(unpack_awq(qweight).t().contiguous(), unpack_awq(qzeros).t(), scales.t(), 4)
