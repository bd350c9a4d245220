"""compressed-tensors checkpoints (llm-compressor's output, `quant_method: compressed-tensors`).

Integer weights, no activation quantization (W4A16, W8A16): `pack-quantized` stores weight_packed
int32 (N, K * bits / 32), weight_shape, weight_scale (N, G) and, asymmetric, weight_zero_point
packed along N; `int-quantized` / `naive-quantized` store the int8 codes as `weight`. Codes and
zero points are signed (q in -2^(b-1)..2^(b-1)-1): w = (q - zp) * scale; the package's own
unpack_from_int32 reads the packing. act-order `group` (weight_g_idx) is served dense.

FP8 (`float-quantized`, W8A8 FP8): weight float8_e4m3fn (N, K) with a per-tensor or per-channel
weight_scale; served dense (fp8 x scale in fp32, exact), the activations unquantized, as
transformers' decompressed path runs it; a static input_scale is read past."""
import torch

from pdserve.errors import CheckpointError
from pdserve.quantization.codes import act_order_dense, group_form

FP8 = (torch.float8_e4m3fn,)
PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
DROPPED = ("input_scale", "input_zero_point")


def parts(scheme) -> tuple[set, set]:
    main = {"weight_packed", "weight_shape"} if scheme.kind == "int" and scheme.packed else {"weight"}
    need = main | {"weight_scale"}
    if scheme.zero_point:
        need.add("weight_zero_point")
    if scheme.g_idx:
        need.add("weight_g_idx")
    if scheme.static_input_scale:
        need.add("input_scale")
    return need, set()


def role(suffix: str, tensor: torch.Tensor) -> str | None:
    if suffix in PARTS or suffix in DROPPED:
        return "part"
    if suffix == "weight" and (tensor.dtype == torch.int8 or tensor.dtype in FP8):
        return "part"
    return None


def convert(quant, module: str, t: dict, where: str):
    s = quant.scheme_for(module)
    scale = t["weight_scale"]
    if s.kind == "fp8":
        w = t["weight"]
        if w.dtype not in FP8:
            raise CheckpointError(f"{where}: {module}.weight is {w.dtype}, FP8 (float-quantized) needs float8_e4m3fn")
        N = w.shape[0]
        if scale.numel() == 1:
            scale = scale.reshape(1, 1)
        elif scale.numel() == N:
            scale = scale.reshape(N, 1)
        else:
            raise CheckpointError(f"{where}: {module}.weight_scale {tuple(scale.shape)} is neither per tensor "
                                  f"nor per channel for {N} rows")
        return w.float() * scale.float()
    if s.packed:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
        shape = tuple(int(x) for x in t["weight_shape"].tolist())
        packed = t["weight_packed"]
        if len(shape) != 2 or packed.dtype != torch.int32 or packed.shape[0] != shape[0]:
            raise CheckpointError(f"{where}: {module}.weight_packed {packed.dtype} {tuple(packed.shape)} does not "
                                  f"fit weight_shape {shape}")
        q = unpack_from_int32(packed, s.bits, torch.Size(shape))
    else:
        q = t["weight"]
        if q.dtype != torch.int8:
            raise CheckpointError(f"{where}: {module}.weight is {q.dtype}, integer codes are int8")
    N, K = q.shape
    G = 1 if s.group_size == -1 else K // s.group_size
    if (s.group_size != -1 and K % s.group_size) or tuple(scale.shape) != (N, G):
        raise CheckpointError(f"{where}: {module}.weight_scale {tuple(scale.shape)} does not fit ({N}, {G}) "
                              f"for a ({N}, {K}) weight with group size {s.group_size}")
    lo, hi = -(1 << (s.bits - 1)), (1 << (s.bits - 1)) - 1
    if int(q.min()) < lo or int(q.max()) > hi:
        raise CheckpointError(f"{where}: {module} holds codes outside the {s.bits}-bit range {lo}..{hi}")
    zp = None
    if s.zero_point:
        zp = t["weight_zero_point"]
        if s.packed and zp.dtype == torch.int32:
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
            zp = unpack_from_int32(zp, s.bits, torch.Size((N, G)), packed_dim=0)
        if tuple(zp.shape) != (N, G):
            raise CheckpointError(f"{where}: {module}.weight_zero_point {tuple(zp.shape)} does not fit ({N}, {G})")
    mid = 1 << (s.bits - 1)
    u = q.to(torch.int16) + mid                            # unsigned codes
    zero = None if zp is None else zp.to(torch.int16) + mid
    if s.g_idx:
        g_idx = t["weight_g_idx"]
        if tuple(g_idx.shape) != (K,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= G:
            raise CheckpointError(f"{where}: {module}.weight_g_idx must hold {K} group numbers below {G}")
        return act_order_dense(u, zero, scale, s.bits, g_idx)
    return group_form(u, zero, scale, s.bits)
