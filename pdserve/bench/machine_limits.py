"""This machine's two roofs: how fast it reads memory and how fast it multiplies matrices.

Each probe keeps the best of its repeats: a roof is what the hardware can do, and on a shared
machine the slower runs measure the neighbours. All probes run on the CPU, with torch's own
kernels and, where it is built, pdserve's (the ones the engine's forward uses on CPU)."""
import math
import platform
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from pdserve.backends.cpu import hugepages
from pdserve.backends.cpu.kernels import cpu_ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


@dataclass
class MachineLimits:
    threads: int                                              # torch's intra-op threads (the engine's)
    read_bytes: int                                           # size of the array the read probes read
    read_bandwidth: dict[int, float] = field(default_factory=dict)   # threads -> bytes/s of x.sum()
    gemv_bandwidth: float = 0.0                               # bytes/s of weights read by an fp32 M=1 F.linear
    gemm_n: int = 0                                           # square GEMM size
    gemm_flops: dict[str, float] = field(default_factory=dict)      # dtype -> FLOP/s
    # the same probes through pdserve's CPU kernel (0 where it is not built): its packed fp32
    # GEMV reads faster than x.sum(), and its GEMM beats MKL's here, so the roofs must include them
    kernel_gemv_bandwidth: float = 0.0
    kernel_gemm_flops: float = 0.0

    @property
    def bandwidth(self) -> float:
        """The memory roof: the fastest read measured (a roof is what the machine can do)."""
        return max(*self.read_bandwidth.values(), self.gemv_bandwidth, self.kernel_gemv_bandwidth)

    def best_of(self, other: "MachineLimits") -> "MachineLimits":
        """Each roof at its best over two measurements (say, before and after a long benchmark)."""
        return MachineLimits(
            self.threads, self.read_bytes, {t: max(v, other.read_bandwidth[t]) for t, v in self.read_bandwidth.items()},
            max(self.gemv_bandwidth, other.gemv_bandwidth), self.gemm_n,
            {d: max(v, other.gemm_flops[d]) for d, v in self.gemm_flops.items()},
            max(self.kernel_gemv_bandwidth, other.kernel_gemv_bandwidth), max(self.kernel_gemm_flops, other.kernel_gemm_flops))

    def peak_flops(self, dtype: str) -> float:
        return max(self.gemm_flops[dtype], self.kernel_gemm_flops if dtype == "float32" else 0.0)

    def to_dict(self) -> dict:
        return asdict(self) | {"bandwidth": self.bandwidth, "cpu": cpu_name(), "torch": torch.__version__}


def best_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def probe_array(nbytes: int) -> torch.Tensor:
    """The read probes' array: fp32 ones on huge pages, as the engine's weights and KV cache are
    (the memory roof is the faster of the two page sizes)."""
    return hugepages.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)


def read_bandwidth(x: torch.Tensor, threads: int, repeats: int) -> float:
    """Bytes/s of summing `x` with `threads` threads; `x` must be far larger than the last-level cache."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return x.numel() * x.element_size() / best_time(x.sum, repeats)
    finally:
        torch.set_num_threads(old)


def gemv_bandwidth(x: torch.Tensor, repeats: int) -> float:
    """Bytes/s at which a one-row fp32 F.linear (a batch-1 decode's matmul) reads `x` as its weight."""
    w = x.view(-1, 4096)
    v = torch.ones(1, 4096)
    return w.numel() * 4 / best_time(lambda: F.linear(v, w), repeats)


def kernel_gemv_bandwidth(x: torch.Tensor, repeats: int) -> float:
    """Bytes/s at which pdserve's packed fp32 linear (one row) reads `x` as its weight; 0 if not built."""
    ops = cpu_ops()
    if ops is None:
        return 0.0
    packed, v, none = x.view(-1, 4096, 16), torch.ones(1, 4096), torch.empty(0)
    return x.numel() * 4 / best_time(lambda: ops.packed_linear(v, packed, none), repeats)


def kernel_gemm_flops(n: int, repeats: int) -> float:
    """FLOP/s of pdserve's packed fp32 linear on n x n x n; 0 if not built."""
    ops = cpu_ops()
    if ops is None:
        return 0.0
    a, packed, none = torch.randn(n, n), torch.randn(n // 16, n, 16), torch.empty(0)
    return 2 * n ** 3 / best_time(lambda: ops.packed_linear(a, packed, none), repeats)


def gemm_flops(n: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of an n x n x n matrix multiply (2 n^3 FLOPs)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / best_time(lambda: a @ b, repeats)


def measure(quick: bool, dtypes: list[str], repeats: int, log=print) -> MachineLimits:
    # An array larger than the last-level cache (32-260 MiB on the machines we run on).
    read_bytes = (256 if quick else 1024) << 20
    n = 1024 if quick else 2048
    limits = MachineLimits(torch.get_num_threads(), read_bytes, gemm_n=n)
    x = probe_array(read_bytes)
    for t in range(1, limits.threads + 1):
        limits.read_bandwidth[t] = read_bandwidth(x, t, repeats)
        log(f"  read {read_bytes >> 20} MiB with {t} thread(s): {limits.read_bandwidth[t] / 1e9:.1f} GB/s")
    limits.gemv_bandwidth = gemv_bandwidth(x, repeats)
    log(f"  fp32 GEMV reads the same array as its weight at {limits.gemv_bandwidth / 1e9:.1f} GB/s")
    limits.kernel_gemv_bandwidth = kernel_gemv_bandwidth(x, repeats)
    limits.kernel_gemm_flops = kernel_gemm_flops(n, repeats)
    if limits.kernel_gemm_flops:
        log(f"  pdserve packed fp32 GEMV reads it at {limits.kernel_gemv_bandwidth / 1e9:.1f} GB/s; "
            f"packed fp32 GEMM {n}^3: {limits.kernel_gemm_flops / 1e9:.0f} GFLOP/s")
    del x
    for name in dict.fromkeys(dtypes):   # ordered, no repeats
        limits.gemm_flops[name] = gemm_flops(n, DTYPES[name], repeats)
        log(f"  {name} GEMM {n}^3: {limits.gemm_flops[name] / 1e9:.0f} GFLOP/s")
    return limits
