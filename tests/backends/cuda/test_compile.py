"""The CUDA backend's kernels compiled for an H100/H200 (sm_90) on this machine, no GPU needed:
Triton's compiled front end is stricter than its interpreter (types carried through loops, constexpr
branches), and ptxas reports what a launch's tiles cost: the shared memory must fit an SM, and at
bf16 model shapes the launcher's tile config (kernels.tile_config) must keep the registers from
spilling more than a few bytes a thread."""
import os
import re
import subprocess

import pytest

triton = pytest.importorskip("triton", reason="the CUDA backend's kernels are Triton's")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pdserve.backends.cuda import kernels as K  # noqa: E402

pytestmark = pytest.mark.skipif(K.interpreted(), reason="TRITON_INTERPRET is set: the kernels are interpreted")
SM90 = GPUTarget("cuda", 90, 32)
SHARED_PER_SM = 227 * 1024
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def signature(fn, dtype: str) -> dict:
    """Every argument's type as the launcher passes it: the tensors of the model's dtype, the
    scratch fp32, the metadata int64, the rest 32-bit scalars, the capitals constexpr."""
    sig = {}
    for name in fn.arg_names:
        if name.isupper():
            sig[name] = "constexpr"
        elif name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "sinks_ptr", "k_ptr", "v_ptr"):
            sig[name] = f"*{dtype}"
        elif name.startswith("part_"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*i64"
        else:
            sig[name] = "fp32" if name in ("scale", "softcap") else "i32"
    return sig


def spilled_bytes(ptx: str, tmp_path) -> int | None:
    if not os.path.exists(PTXAS):
        return None
    path = tmp_path / "kernel.ptx"
    path.write_text(ptx)
    out = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", str(path), "-o", os.devnull], capture_output=True,
                         text=True)
    return int(re.search(r"(\d+) bytes spill stores", out.stderr + out.stdout).group(1))


# (dtype, query heads, KV heads, head, decode step, sinks, soft cap, window, splits): the backend's launches
LAUNCHES = {
    "llama3-8b prefill": ("bf16", 32, 8, 128, False, False, False, False, 1),
    "llama3-8b decode split": ("bf16", 32, 8, 128, True, False, False, False, 16),
    "gemma2 prefill": ("bf16", 8, 4, 256, False, False, True, True, 1),
    "gpt-oss decode split": ("fp16", 64, 8, 64, True, True, False, True, 4),
    "tiny fp32 prefill": ("fp32", 4, 2, 16, False, False, False, False, 1),
}


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_attention_compiles_for_sm90(name, tmp_path):
    dtype, H, Hkv, D, decode, sinks, softcap, window, splits = LAUNCHES[name]
    group_pad = triton.next_power_of_2(H // Hkv)
    d_pad = max(16, triton.next_power_of_2(D))
    rows = 16 if decode else (64 if D <= 128 else 32)   # as CudaBackend's block_q
    block_q = max(1, rows // group_pad)
    block_n, warps = K.tile_config(d_pad, 4 if dtype == "fp32" else 2, block_q * group_pad)
    constexprs = dict(GROUP=H // Hkv, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n, HEAD_DIM=D,
                      D_PAD=d_pad, HAS_SINKS=sinks, SOFTCAP=softcap, WINDOWED=window, FP32_DOT=False,
                      IEEE=dtype == "fp32", SPLITS=splits)
    kernel = triton.compile(ASTSource(K._paged_attention, signature(K._paged_attention, dtype), constexprs),
                            target=SM90, options=dict(num_warps=warps, num_stages=2))
    assert kernel.metadata.shared <= SHARED_PER_SM
    spilled = spilled_bytes(kernel.asm["ptx"], tmp_path)
    if dtype != "fp32" and spilled is not None:   # fp32 (IEEE dots, exactness checks only) may spill
        assert spilled <= 128, f"{spilled} bytes spilled a thread"
    if splits > 1:
        constexprs = {k: constexprs[k] for k in ("GROUP", "GROUP_PAD", "BLOCK_Q", "HEAD_DIM", "D_PAD", "SPLITS")}
        triton.compile(ASTSource(K._combine_splits, signature(K._combine_splits, dtype), constexprs), target=SM90,
                       options=dict(num_warps=warps))


def test_store_kv_compiles_for_sm90():
    triton.compile(ASTSource(K._store_kv, signature(K._store_kv, "bf16"), dict(ROW=1024, ROW_PAD=1024)), target=SM90)
