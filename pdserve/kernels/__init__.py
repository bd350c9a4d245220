"""Small compiled CPU kernels where torch has none fast enough on our machines (docs/BENCHMARKS.md):
linear_cpu.cpp (linears on pre-packed weights, whose tiles packed_tiles.h holds), argmax_cpu.cpp
(greedy tokens from the packed lm_head without the logits), attention_cpu.cpp (decode attention read
straight from the paged KV cache), prefill_attention_cpu.cpp (causal attention of prefill chunks,
also read in place), activation_cpu.cpp (SwiGLU's silu(gate) * up in one pass), norm_cpu.cpp
(RMSNorm, fused with the residual add before it) and rotary_cpu.cpp (RoPE on q and k in place);
buffer_pool.cpp keeps the freed big outputs of the linears and SwiGLU for reuse.

Built on first use with torch's C++ extension loader (needs a C++ compiler; the build is cached
under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR, in a directory named after a hash of the
sources, the headers, the flags, the compiler and torch's version: two checkouts with different
kernels never rebuild each other's, two with the same kernels share one build, and an edit to
vec512.h alone or a new compiler gets a fresh build). Where it cannot be built (no compiler, no
AVX-512) the engine keeps torch's own ops and says so once."""
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys

log = logging.getLogger("pdserve")
_DIR = os.path.dirname(__file__)
SOURCES = [os.path.join(_DIR, f) for f in ("ops.cpp", "linear_cpu.cpp", "argmax_cpu.cpp", "attention_cpu.cpp", "prefill_attention_cpu.cpp",
                                           "activation_cpu.cpp", "norm_cpu.cpp", "rotary_cpu.cpp", "buffer_pool.cpp",
                                           "decoder_cpu.cpp")]
HEADERS = [os.path.join(_DIR, f) for f in ("vec512.h", "buffer_pool.h", "decoder.h", "ops.h", "packed_tiles.h")]
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mfma", "-fopenmp"]


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


def compiler_version() -> str:
    """The compiler torch's loader runs ($CXX, else c++) and its `--version` banner ("" if it does
    not run): a build made by another compiler (an upgrade, another $CXX) is another build."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{cxx}: {out.strip()}"


def build_name() -> str:
    """pdserve_cpu_ops_<hash of sources, header, flags, compiler and torch version>."""
    import torch
    h = hashlib.sha256(" ".join(CFLAGS + [torch.__version__, compiler_version()]).encode())
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            h.update(f.read())
    return "pdserve_cpu_ops_" + h.hexdigest()[:12]


def build_directory(name: str) -> str:
    from torch.utils.cpp_extension import get_default_build_root
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return os.path.join(root, f"py{sys.version_info.major}{sys.version_info.minor}_cpu", name)   # torch's layout


def load_cpu_ops():
    """Build (or find) and import the extension.

    torch's loader serialises builds with a `lock` file that a killed build leaves behind, and every
    later load then waits on it forever, silently. We hold an flock (released by the kernel when its
    process dies, however it dies) around torch's loader, so a `lock` we find while holding it is
    always stale and is removed."""
    from torch.utils.cpp_extension import load
    name = build_name()
    directory = build_directory(name)
    os.makedirs(directory, exist_ok=True)
    with open(directory + ".flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            stale = os.path.join(directory, "lock")
            if os.path.exists(stale):
                log.warning("removing a stale build lock left by a killed build: %s", stale)
                os.remove(stale)
            built = os.path.join(directory, name + ".so")
            if os.path.exists(built):
                # Named after everything the build reads, so it is this very build, whichever checkout
                # made it; torch's loader would compile it again when only the sources' path differs.
                try:
                    return _import_extension(name, built)
                except ImportError as e:   # e.g. a link cut short: build again
                    log.warning("rebuilding pdserve's CPU kernels: %s does not load (%s)", built, e)
            else:
                log.info("compiling pdserve's CPU kernels once (about a minute) into %s", directory)
            # -fopenmp: at::parallel_for runs on torch's OpenMP pool (the libgomp torch already loaded)
            return load(name, SOURCES, extra_cflags=CFLAGS, extra_ldflags=["-lgomp"], build_directory=directory,
                        verbose=False)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _import_extension(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def cpu_ops():
    """The compiled extension, or None with the reason logged."""
    if not cpu_supports_avx512():
        log.warning("pdserve's CPU kernels need AVX-512; using torch's ops")
        return None
    try:
        return load_cpu_ops()
    except Exception as e:  # compiler missing or failing: fall back, loudly
        msg = str(e).strip().splitlines()
        log.warning("could not build pdserve's CPU kernels (%s); using torch's ops", msg[-1] if msg else type(e).__name__)
        return None


def pool_cached_bytes() -> int:
    """Bytes of freed big kernel outputs the pool keeps for reuse (buffer_pool.cpp); 0 while the
    kernels are not loaded (a metrics scrape must not build them)."""
    if cpu_ops.cache_info().currsize == 0:
        return 0
    ops = cpu_ops()
    return 0 if ops is None else ops.pool_cached_bytes()
