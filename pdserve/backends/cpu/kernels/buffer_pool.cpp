// The pool of buffer_pool.h: freed buffers by size, under one mutex (tensors may die on any thread).
#include "buffer_pool.h"
#include <sys/mman.h>
#include <cstdlib>
#include <map>
#include <mutex>

namespace pdserve {
namespace {

constexpr int64_t kPoolMinBytes = 8 << 20;   // below this glibc keeps and reuses the block itself
constexpr int64_t kPoolMaxBytes = 1LL << 30;
constexpr int64_t kHuge = 2 << 20;

std::mutex mu;
std::multimap<int64_t, void*> free_buffers;   // size -> buffer
int64_t cached = 0;

void give_back(void* p, int64_t n) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (cached + n <= kPoolMaxBytes) {
      free_buffers.emplace(n, p);
      cached += n;
      return;
    }
  }
  std::free(p);
}

}  // namespace

torch::Tensor pooled_empty(at::IntArrayRef sizes) {
  int64_t bytes = sizeof(float);
  for (int64_t s : sizes) bytes *= s;
  if (bytes < kPoolMinBytes) return torch::empty(sizes, torch::kFloat);
  void* p = nullptr;
  int64_t n = (bytes + kHuge - 1) / kHuge * kHuge;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = free_buffers.lower_bound(n);
    if (it != free_buffers.end() && it->first <= 2 * n) {
      p = it->second;
      n = it->first;
      cached -= n;
      free_buffers.erase(it);
    }
  }
  if (p == nullptr) {
    p = std::aligned_alloc(kHuge, n);
    TORCH_CHECK(p != nullptr, "out of memory allocating ", n, " bytes");
    madvise(p, n, MADV_HUGEPAGE);   // a hint: where huge pages are off this fails, harmlessly
  }
  return torch::from_blob(p, sizes, [n](void* q) { give_back(q, n); }, torch::TensorOptions().dtype(torch::kFloat));
}

int64_t pool_cached_bytes() {
  std::lock_guard<std::mutex> lock(mu);
  return cached;
}

}  // namespace pdserve
