// RMSNorm of fp32 rows, alone or fused with the residual add before it (vLLM's fused_add_rms_norm):
// one pass over the rows where torch runs an add and then rms_norm's own passes, each a parallel
// region (a few tens of microseconds apiece at decode sizes, 2 x 24 of them per step). Also in
// place over the heads of q or k, views of the qkv product (Qwen3's, Gemma 3's, OLMo 2's q/k norms).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "vec.h"
#include <cmath>

namespace {

using pdserve::fVec;
using pdserve::kVec;

constexpr int64_t kMinParallelBytes = 256 << 10;   // smaller: one thread (see packed_tiles.h)


// y = w * x / sqrt(mean(x^2) + eps) for one row of n; with add, x is first replaced by x + r
// (written back to r: the residual stream), and the norm is taken of that sum.
// Lanes past a row's end load as zeros and are not stored.
inline void norm_row(float* x, float* r, const float* w, float* y, int64_t n, float eps, bool add) {
  fVec ss(0.f);
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t c = std::min<int64_t>(kVec, n - i);
    fVec v = fVec::loadu(x + i, c);
    if (add) {
      v = v + fVec::loadu(r + i, c);
      v.store(r + i, c);
    }
    ss = at::vec::fmadd(v, v, ss);
  }
  const float inv = 1.0f / std::sqrt(pdserve::reduce_add(ss) / float(n) + eps);
  const float* src = add ? r : x;
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t c = std::min<int64_t>(kVec, n - i);
    (fVec::loadu(src + i, c) * fVec(inv) * fVec::loadu(w + i, c)).store(y + i, c);
  }
}

void norm_rows(float* x, float* r, const float* w, float* y, int64_t M, int64_t n, float eps, bool add) {
  const int64_t grain = std::max<int64_t>(1, kMinParallelBytes / (n * int64_t(sizeof(float)) * (add ? 3 : 2)));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      norm_row(x + m * n, add ? r + m * n : nullptr, w, y + m * n, n, eps, add);
  });
}

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.is_contiguous(), name, " must be (M, n) fp32 contiguous");
}

}  // namespace

// x: (M, n) fp32; weight: (n,). Returns the normalised rows.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check(x, "x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1) && weight.is_contiguous(), "bad weight");
  auto y = torch::empty_like(x);
  norm_rows(x.data_ptr<float>(), nullptr, weight.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1),
            float(eps), false);
  return y;
}

// In place: residual += x, then x = rms_norm(residual) * weight.
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check(x, "x");
  check(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have x's shape");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1) && weight.is_contiguous(), "bad weight");
  norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(), x.data_ptr<float>(),
            x.size(0), x.size(1), float(eps), true);
}

// In place: each head row x[t, h] (n elements) = rms_norm(x[t, h]) * weight. x: (T, heads, n) fp32
// with contiguous heads, its tokens strided (a view of the qkv product): per head (weight of
// head_dim) or, viewed as (T, 1, H x head_dim), over the whole projection. The same rounding as
// rms_norm on a contiguous copy of the rows.
void rms_norm_heads_(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be (T, heads, n) fp32 with contiguous heads");
  const int64_t T = x.size(0), heads = x.size(1), n = x.size(2), stride = x.stride(0);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == n && weight.is_contiguous(), "bad weight");
  float* px = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kMinParallelBytes / (heads * n * int64_t(sizeof(float)) * 2));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        float* row = px + t * stride + h * n;
        norm_row(row, nullptr, w, row, n, float(eps), false);
      }
  });
}
