"""Small compiled CPU kernels where torch has none fast enough on our machines (docs/BENCHMARKS.md):
linear_cpu.cpp (linears on pre-packed weights), attention_cpu.cpp (decode attention read
straight from the paged KV cache), prefill_attention_cpu.cpp (causal attention of prefill chunks,
also read in place), activation_cpu.cpp (SwiGLU's silu(gate) * up in one pass), norm_cpu.cpp
(RMSNorm, fused with the residual add before it) and rotary_cpu.cpp (RoPE on q and k in place).

Built on first use with torch's C++ extension loader (needs a C++ compiler; the build is cached
under ~/.cache/torch_extensions). Where it cannot be built (no compiler, no AVX-512) the engine
keeps torch's own ops and says so once."""
import functools
import logging
import os

log = logging.getLogger("pdserve")
_DIR = os.path.dirname(__file__)
SOURCES = [os.path.join(_DIR, f) for f in ("ops.cpp", "linear_cpu.cpp", "attention_cpu.cpp", "prefill_attention_cpu.cpp",
                                           "activation_cpu.cpp", "norm_cpu.cpp", "rotary_cpu.cpp")]


@functools.cache   # asked once per linear layer at load
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_supports_avx512() -> bool:
    return {"avx512f", "avx512bw"} <= _cpu_flags()


def cpu_supports_bf16_dot() -> bool:
    """AVX512-BF16 (vdpbf16ps): the bf16 dot-product path of the packed linear."""
    return "avx512_bf16" in _cpu_flags()


@functools.cache
def cpu_ops():
    """The compiled extension, or None with the reason logged."""
    if not cpu_supports_avx512():
        log.warning("pdserve's CPU kernels need AVX-512; using torch's ops")
        return None
    from torch.utils.cpp_extension import load
    try:
        # -fopenmp: at::parallel_for runs on torch's OpenMP pool (the libgomp torch already loaded)
        return load("pdserve_cpu_ops", SOURCES, extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mfma", "-fopenmp"],
                    extra_ldflags=["-lgomp"], verbose=False)
    except Exception as e:  # compiler missing or failing: fall back, loudly
        msg = str(e).strip().splitlines()
        log.warning("could not build pdserve's CPU kernels (%s); using torch's ops", msg[-1] if msg else type(e).__name__)
        return None
