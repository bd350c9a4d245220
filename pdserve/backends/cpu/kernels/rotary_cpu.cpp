// Rotary position embedding applied in place to q and k (the rotate-half layout of HF checkpoints):
// x[i] = x[i] cos[i] - x[i + R/2] sin[i], x[i + R/2] = x[i + R/2] cos[i + R/2] + x[i] sin[i + R/2]
// for i < R/2, where R (rotary_dim) is the width of cos and sin: the head size D, or less with a
// partial rotary (Phi-4-mini), whose dims R.. pass through.
// Why: in torch that is a dozen ops per layer (two chunks, negations, cats, four products, two
// sums), each a pass over q or k; here it is one pass, on the views of the merged qkv product.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "vec.h"

namespace {

using pdserve::fVec;
using pdserve::kVec;

// a * b, rounded: fenced so that the compiler does not contract it with the sum after it into a
// fused multiply-add (torch's ops round products and sums separately)
inline fVec mul(const fVec& a, const fVec& b) {
  fVec p = a * b;
  pdserve::fence(p);
  return p;
}

// heads rows of D at x, x + D, ...; cos and sin: R each, rotating each row's first R dims
inline void rotate_heads(float* x, int64_t heads, int64_t D, int64_t R, const float* cos, const float* sin) {
  const int64_t h = R / 2;
  for (int64_t j = 0; j < heads; ++j, x += D) {
    for (int64_t i = 0; i < h; i += kVec) {
      const int64_t c = std::min<int64_t>(kVec, h - i);
      const fVec x1 = fVec::loadu(x + i, c), x2 = fVec::loadu(x + h + i, c);
      const fVec a = mul(x1, fVec::loadu(cos + i, c)) - mul(x2, fVec::loadu(sin + i, c));
      const fVec b = mul(x2, fVec::loadu(cos + h + i, c)) + mul(x1, fVec::loadu(sin + h + i, c));
      a.store(x + i, c);
      b.store(x + h + i, c);
    }
  }
}

void check_heads(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, " must be (T, heads, D) fp32 with contiguous heads");
}

}  // namespace

// q: (T, H, D), k: (T, Hkv, D), fp32, rows may be strided (views into one qkv product);
// cos, sin: (T, R) (or (T, 1, R)) fp32 contiguous, the rows of each token's position, R <= D even.
void rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(D % 2 == 0 && k.size(0) == T && k.size(2) == D, "q and k must have the same tokens and head size");
  const int64_t R = cos.dim() > 0 ? cos.size(-1) : 0;
  TORCH_CHECK(R > 0 && R % 2 == 0 && R <= D, "cos/sin must be as wide as the head or narrower (even), got ", R,
              " for heads of ", D);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.numel() == T * R && sin.sizes() == cos.sizes(), "bad cos/sin");
  float *pq = q.data_ptr<float>(), *pk = k.data_ptr<float>();
  const float *pc = cos.data_ptr<float>(), *ps = sin.data_ptr<float>();
  const int64_t H = q.size(1), Hkv = k.size(1), sq = q.stride(0), sk = k.stride(0);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / ((H + Hkv) * D));   // small steps: one thread
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      rotate_heads(pq + t * sq, H, D, R, pc + t * R, ps + t * R);
      rotate_heads(pk + t * sk, Hkv, D, R, pc + t * R, ps + t * R);
    }
  });
}
