"""This machine's two roofs: how fast it reads memory and how fast it multiplies matrices.

Each probe keeps the best of its repeats: a roof is what the hardware can do, and on a shared
machine the slower runs measure the neighbours. All probes run on the CPU with torch's own
kernels, the ones the engine's forward uses."""
import math
import platform
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

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

    @property
    def bandwidth(self) -> float:
        """The memory roof: the fastest read measured (a roof is what the machine can do)."""
        return max(*self.read_bandwidth.values(), self.gemv_bandwidth)

    def best_of(self, other: "MachineLimits") -> "MachineLimits":
        """Each roof at its best over two measurements (say, before and after a long benchmark)."""
        return MachineLimits(
            self.threads, self.read_bytes, {t: max(v, other.read_bandwidth[t]) for t, v in self.read_bandwidth.items()},
            max(self.gemv_bandwidth, other.gemv_bandwidth), self.gemm_n,
            {d: max(v, other.gemm_flops[d]) for d, v in self.gemm_flops.items()})

    def peak_flops(self, dtype: str) -> float:
        return self.gemm_flops[dtype]

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


def gemm_flops(n: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of an n x n x n matrix multiply (2 n^3 FLOPs)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / best_time(lambda: a @ b, repeats)


def measure(quick: bool, dtypes: list[str], repeats: int, log=print) -> MachineLimits:
    # An array larger than the last-level cache (32-260 MiB on the machines we run on).
    read_bytes = (256 if quick else 1024) << 20
    n = 1024 if quick else 2048
    limits = MachineLimits(torch.get_num_threads(), read_bytes, gemm_n=n)
    x = torch.ones(read_bytes // 4)
    for t in range(1, limits.threads + 1):
        limits.read_bandwidth[t] = read_bandwidth(x, t, repeats)
        log(f"  read {read_bytes >> 20} MiB with {t} thread(s): {limits.read_bandwidth[t] / 1e9:.1f} GB/s")
    limits.gemv_bandwidth = gemv_bandwidth(x, repeats)
    del x
    log(f"  fp32 GEMV reads the same array as its weight at {limits.gemv_bandwidth / 1e9:.1f} GB/s")
    for name in dict.fromkeys(dtypes):   # ordered, no repeats
        limits.gemm_flops[name] = gemm_flops(n, DTYPES[name], repeats)
        log(f"  {name} GEMM {n}^3: {limits.gemm_flops[name] / 1e9:.0f} GFLOP/s")
    return limits
