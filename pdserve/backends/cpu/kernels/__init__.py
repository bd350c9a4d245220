"""Small compiled CPU kernels where torch has none fast enough on our machines (docs/BENCHMARKS.md):
linear_cpu.cpp (linears on pre-packed weights, whose tiles packed_tiles.h holds, the bf16 ones on AMX
in amx_tiles.h), quant_linear_cpu.cpp (the same on 4/8-bit group-quantized codes, dequantized in
registers), argmax_cpu.cpp
(greedy tokens from the packed lm_head without the logits), attention_cpu.cpp (decode attention read
straight from the paged KV cache), prefill_attention_cpu.cpp (causal attention of prefill chunks,
also read in place), activation_cpu.cpp (SwiGLU's silu(gate) * up and GeGLU's gelu_tanh(gate) * up
in one pass), norm_cpu.cpp (RMSNorm, fused with the residual add before it, and in place over q/k
heads), rotary_cpu.cpp (RoPE on q and k in place, full or partial) and moe_cpu.cpp (an MoE
layer's experts, each selected expert's weights read once per step for all its tokens);
buffer_pool.cpp keeps the freed big outputs of the linears and SwiGLU for reuse.

Written once over ATen's portable vector layer (vec.h) and compiled per instruction set: "avx512"
or "avx2" (ISA_FLAGS). PDSERVE_CPU_ISA=auto|avx2|avx512 picks the build; auto, the default, is the
best this CPU runs. Built on first use with torch's C++ extension loader, or ahead of time by
`pdserve build-kernels` (needs a C++ compiler; the build is cached under ~/.cache/torch_extensions,
or $TORCH_EXTENSIONS_DIR, in a directory named after the instruction set and a hash of the sources,
the headers, the flags, the compiler and torch's version: two checkouts with different kernels
never rebuild each other's, two with the same kernels share one build, and each instruction set
has its own). Where it cannot be built (no compiler, a CPU without AVX2) the engine keeps torch's
own ops and says so once."""
import fcntl
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time

log = logging.getLogger("pdserve")
_DIR = os.path.dirname(__file__)
SOURCES = [os.path.join(_DIR, f) for f in ("ops.cpp", "linear_cpu.cpp", "quant_linear_cpu.cpp", "argmax_cpu.cpp",
                                           "attention_cpu.cpp", "prefill_attention_cpu.cpp",
                                           "activation_cpu.cpp", "norm_cpu.cpp", "rotary_cpu.cpp", "buffer_pool.cpp",
                                           "decoder_cpu.cpp", "moe_cpu.cpp")]
HEADERS = [os.path.join(_DIR, f) for f in ("vec.h", "buffer_pool.h", "decoder.h", "ops.h", "packed_tiles.h",
                                           "amx_tiles.h")]
CFLAGS = ["-O3", "-fopenmp"]
# Per instruction set: the compiler's flags (CPU_CAPABILITY picks ATen's vector implementation) and
# the /proc/cpuinfo flags a CPU needs to run the build. The AVX-512 build also takes AVX512-BF16's
# dot products (used only where the CPU has them: cpu_supports_bf16_dot) and AMX's bf16 tiles (used only
# where the CPU has them and the kernel checks at run time: amx_tiles.h).
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
               "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
ISA_CPU_FLAGS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
}
ISAS = tuple(ISA_FLAGS)   # best first


def _cpu_flags() -> frozenset[str]:
    global _FLAGS
    if _FLAGS is None:
        try:
            with open("/proc/cpuinfo") as f:
                _FLAGS = frozenset(next((line for line in f if line.startswith("flags")), "").split())
        except OSError:
            _FLAGS = frozenset()
    return _FLAGS


_FLAGS = None


def supported_isas() -> list[str]:
    """The instruction sets of ISAS this CPU runs, best first."""
    return [isa for isa in ISAS if ISA_CPU_FLAGS[isa] <= _cpu_flags()]


_forced: str | None = None   # use_isa's choice, over the environment's


def selected_isa() -> str | None:
    """The build the kernels use: PDSERVE_CPU_ISA (or use_isa's choice) where this CPU runs it, the
    best it runs for auto; None where it runs none (or a forced one it cannot)."""
    global _selection
    key = (_forced, os.environ.get("PDSERVE_CPU_ISA"))
    if _selection is None or _selection[0] != key:   # asked at every kernel call: decided once per setting
        _selection = (key, _select(*key))
    return _selection[1]


_selection: tuple | None = None


def _select(forced: str | None, env: str | None) -> str | None:
    want = forced or (env or "auto").strip().lower() or "auto"
    have = supported_isas()
    if want == "auto":
        return have[0] if have else None
    if want not in ISAS:
        _warn_once(f"PDSERVE_CPU_ISA={want!r} is not one of auto, {', '.join(ISAS)}; using auto")
        return have[0] if have else None
    if want not in have:
        _warn_once(f"PDSERVE_CPU_ISA={want}: this CPU cannot run that build; using torch's ops")
        return None
    return want


def use_isa(isa: str | None) -> None:
    """Select the build by name for this process, over PDSERVE_CPU_ISA (None: back to it). The
    models built after it use that build; the tests run the kernels once per instruction set so."""
    global _forced
    if isa is not None and isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r}: one of {', '.join(ISAS)}")
    _forced = isa


def cpu_supports_avx512() -> bool:
    """Whether the kernels in use are the AVX-512 build (False under PDSERVE_CPU_ISA=avx2)."""
    return selected_isa() == "avx512"


def cpu_supports_bf16_dot() -> bool:
    """AVX512-BF16 (vdpbf16ps) in the build in use: the bf16 dot-product path of the packed linear."""
    return selected_isa() == "avx512" and "avx512_bf16" in _cpu_flags()


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def compiler_version() -> str:
    """The compiler torch's loader runs ($CXX, else c++) and its `--version` banner ("" if it does
    not run): a build made by another compiler (an upgrade, another $CXX) is another build."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{cxx}: {out.strip()}"


def cflags(isa: str) -> list[str]:
    return CFLAGS + ISA_FLAGS[isa]


def build_name(isa: str | None = None) -> str:
    """pdserve_cpu_ops_<isa>_<hash of sources, headers, flags, compiler and torch version>."""
    import torch
    isa = isa or selected_isa() or ISAS[-1]
    h = hashlib.sha256(" ".join(cflags(isa) + [torch.__version__, compiler_version()]).encode())
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            h.update(f.read())
    return f"pdserve_cpu_ops_{isa}_" + h.hexdigest()[:12]


def build_directory(name: str) -> str:
    from torch.utils.cpp_extension import get_default_build_root
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return os.path.join(root, f"py{sys.version_info.major}{sys.version_info.minor}_cpu", name)   # torch's layout


def load_cpu_ops(isa: str | None = None):
    """Build (or find) and import the extension of one instruction set (default: selected_isa()).

    torch's loader serialises builds with a `lock` file that a killed build leaves behind, and every
    later load then waits on it forever, silently. We hold an flock (released by the kernel when its
    process dies, however it dies) around torch's loader, so a `lock` we find while holding it is
    always stale and is removed; a second process arriving during a build waits on the flock and
    then imports what the first built."""
    from torch.utils.cpp_extension import load
    isa = isa or selected_isa()
    if isa is None:
        raise RuntimeError("this CPU runs none of the kernels' builds (" + ", ".join(ISAS) + ")")
    name = build_name(isa)
    directory = build_directory(name)
    os.makedirs(directory, exist_ok=True)
    with open(directory + ".flock", "w") as guard:
        if not _try_lock(guard):
            log.warning("waiting for another process's build of pdserve's CPU kernels (%s)", isa)
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
            # -fopenmp: at::parallel_for runs on torch's OpenMP pool (the libgomp torch already loaded)
            with _progress(f"compiling pdserve's CPU kernels for {isa} once (a few minutes on a busy machine) "
                           f"into {directory}"):
                return load(name, SOURCES, extra_cflags=cflags(isa), extra_ldflags=["-lgomp"],
                            build_directory=directory, verbose=False)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _try_lock(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class _progress:
    """Says what it does on stderr when it starts, then every 30 s how long it has taken."""

    def __init__(self, what: str, every: float = 30.0):
        self.what, self.every, self.done = what, every, threading.Event()

    def __enter__(self):
        self.t0 = time.monotonic()
        log.warning(self.what)
        threading.Thread(target=self._tick, daemon=True).start()
        return self

    def _tick(self):
        while not self.done.wait(self.every):
            log.warning("  still compiling pdserve's CPU kernels (%.0f s)", time.monotonic() - self.t0)

    def __exit__(self, *exc):
        self.done.set()
        if exc[0] is None:
            log.warning("  compiled pdserve's CPU kernels in %.0f s", time.monotonic() - self.t0)


def _import_extension(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_loaded: dict[str, object] = {}   # instruction set -> extension, or None where it failed


def cpu_ops():
    """The compiled extension of the selected build, or None with the reason logged once."""
    isa = selected_isa()
    if isa in _loaded:
        return _loaded[isa]
    if isa is None:
        _warn_once("pdserve's CPU kernels need AVX2 or AVX-512; using torch's ops (several times slower on CPU)")
        return None
    try:
        _loaded[isa] = load_cpu_ops(isa)
    except Exception as e:  # compiler missing or failing: fall back, loudly
        msg = str(e).strip().splitlines()
        _warn_once(f"could not build pdserve's CPU kernels ({msg[-1] if msg else type(e).__name__}); using torch's "
                   "ops: CPU steps run several times slower")
        _loaded[isa] = None
    return _loaded[isa]


def kernel_path() -> str:
    """What the CPU fast path runs on, for the startup log: "kernels avx512 (<path>)" or "torch ops"."""
    isa = selected_isa()
    ops = _loaded.get(isa) if isa else None
    return f"kernels {isa} ({ops.__file__})" if ops is not None else "torch ops"


def pool_cached_bytes() -> int:
    """Bytes of freed big kernel outputs the pool keeps for reuse (buffer_pool.cpp); 0 while the
    kernels are not loaded (a metrics scrape must not build them)."""
    return sum(ops.pool_cached_bytes() for ops in _loaded.values() if ops is not None)
