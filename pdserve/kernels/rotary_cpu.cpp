// Rotary position embedding applied in place to q and k (the rotate-half layout of HF checkpoints):
// x[i] = x[i] cos[i] - x[i + D/2] sin[i], x[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2].
// Why: in torch that is a dozen ops per layer (two chunks, negations, cats, four products, two
// sums), each a pass over q or k; here it is one pass, on the views of the merged qkv product.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "vec512.h"

namespace {

using pdserve::lanes;

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
inline __m512 mul(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, kRound); }
inline __m512 add(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, kRound); }
inline __m512 sub(__m512 a, __m512 b) { return _mm512_sub_round_ps(a, b, kRound); }

// heads rows of D at x, x + D, ...; cos and sin: D each
inline void rotate_heads(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t h = D / 2;
  for (int64_t j = 0; j < heads; ++j, x += D) {
    for (int64_t i = 0; i < h; i += 16) {
      const __mmask16 m = lanes(h - i);
      const __m512 x1 = _mm512_maskz_loadu_ps(m, x + i), x2 = _mm512_maskz_loadu_ps(m, x + h + i);
      // products and sums rounded separately, as torch's ops round them: the explicit-rounding forms
      // keep the compiler from contracting them into fused multiply-adds
      const __m512 a = sub(mul(x1, _mm512_maskz_loadu_ps(m, cos + i)), mul(x2, _mm512_maskz_loadu_ps(m, sin + i)));
      const __m512 b = add(mul(x2, _mm512_maskz_loadu_ps(m, cos + h + i)), mul(x1, _mm512_maskz_loadu_ps(m, sin + h + i)));
      _mm512_mask_storeu_ps(x + i, m, a);
      _mm512_mask_storeu_ps(x + h + i, m, b);
    }
  }
}

void check_heads(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, " must be (T, heads, D) fp32 with contiguous heads");
}

}  // namespace

// q: (T, H, D), k: (T, Hkv, D), fp32, rows may be strided (views into one qkv product);
// cos, sin: (T, D) fp32 contiguous, the rows of each token's position.
void rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(D % 2 == 0 && k.size(0) == T && k.size(2) == D, "q and k must have the same tokens and head size");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.numel() == T * D && sin.numel() == T * D, "bad cos/sin");
  float *pq = q.data_ptr<float>(), *pk = k.data_ptr<float>();
  const float *pc = cos.data_ptr<float>(), *ps = sin.data_ptr<float>();
  const int64_t H = q.size(1), Hkv = k.size(1), sq = q.stride(0), sk = k.stride(0);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / ((H + Hkv) * D));   // small steps: one thread
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      rotate_heads(pq + t * sq, H, D, pc + t * D, ps + t * D);
      rotate_heads(pk + t * sk, Hkv, D, pc + t * D, ps + t * D);
    }
  });
}
