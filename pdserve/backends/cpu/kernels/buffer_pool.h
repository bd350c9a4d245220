// Big kernel outputs (the linears' and SwiGLU's activations) from a pool of freed buffers.
#pragma once
#include <torch/extension.h>

namespace pdserve {

// torch::empty(sizes, fp32) for small outputs. An output of kPoolMinBytes or more reuses a freed
// buffer of at least its size (and at most twice it) when there is one, else gets a new one on
// huge pages; when its tensor dies the buffer goes back to the pool, up to kPoolMaxBytes cached.
// Why: glibc unmaps blocks above 32 MiB on free, so every long prefill step faulted its big
// activations in anew, a zero-filled 4 KiB page at a time (docs/BENCHMARKS.md).
torch::Tensor pooled_empty(at::IntArrayRef sizes);

int64_t pool_cached_bytes();   // bytes of free buffers the pool holds (tests, /metrics)

}  // namespace pdserve
