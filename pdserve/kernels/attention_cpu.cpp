// Decode attention straight from the paged KV cache: one query token per sequence attends over
// its cached keys, read block by block through its block table. No gathered copy of K and V and
// no padded mask: each key and value row is read once. Grouped-query attention: the G query heads
// sharing a KV head are handled together, so each K/V row is read once per group, not per head.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

template <typename T> inline __m512 load16(const T* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T>
void decode_impl(const float* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* ctx,
                 float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t nb, int64_t bs,
                 float scale, int64_t window) {
  const int64_t G = H / Hkv, row = Hkv * D;   // row: elements per cache slot
  // one thread for small work (see linear_cpu.cpp): grain in (sequence, kv head) tasks
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += ctx[b];
  const int64_t bytes_per_task = std::max<int64_t>(1, total / B * 2 * D * int64_t(sizeof(T)));
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / bytes_per_task);
  at::parallel_for(0, B * Hkv, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / Hkv, kvh = t % Hkv, n = ctx[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const float* qb = q + (b * H + kvh * G) * D;    // the G query heads of this KV head
      scores.assign(G * (n - first), 0.f);
      // pass 1: scores q.k for every cached key
      for (int64_t p = first; p < n; ++p) {
        const T* k = kc + (tables[b * nb + p / bs] * bs + p % bs) * row + kvh * D;
        for (int64_t g = 0; g < G; ++g) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qb + g * D + d), load16<T>(k + d), acc);
          scores[g * (n - first) + p - first] = _mm512_reduce_add_ps(acc) * scale;
        }
      }
      // softmax per head, then pass 2: the weighted sum of values
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * (n - first);
        float mx = -INFINITY, sum = 0.f;
        for (int64_t i = 0; i < n - first; ++i) mx = std::max(mx, s[i]);
        for (int64_t i = 0; i < n - first; ++i) { s[i] = std::exp(s[i] - mx); sum += s[i]; }
        for (int64_t i = 0; i < n - first; ++i) s[i] /= sum;
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + (b * H + kvh * G + g) * D + d, _mm512_setzero_ps());
      for (int64_t p = first; p < n; ++p) {
        const T* v = vc + (tables[b * nb + p / bs] * bs + p % bs) * row + kvh * D;
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 vv = load16<T>(v + d);
          for (int64_t g = 0; g < G; ++g) {
            float* o = out + (b * H + kvh * G + g) * D + d;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * (n - first) + p - first]), vv, _mm512_loadu_ps(o)));
          }
        }
      }
    }
  });
}

}  // namespace

// q: (B, H, D) fp32; k_cache, v_cache: (slots, Hkv, D) fp32|bf16; block_tables: (B, nb) int64;
// ctx_lens: (B,) int64 keys per sequence (including this step's). Returns (B, H, D) fp32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t block_size,
                                     double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be (B, H, D) fp32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "bad cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && ctx_lens.is_contiguous(), "tables and lengths must be int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(D % 16 == 0 && H % Hkv == 0 && k_cache.size(2) == D, "unsupported head shape");
  auto out = torch::empty_like(q);
  if (B == 0) return out;
  const int64_t nb = block_tables.size(1);
  if (k_cache.scalar_type() == at::kFloat) {
    decode_impl<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                       block_tables.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H,
                       Hkv, D, nb, block_size, static_cast<float>(scale), sliding_window);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    decode_impl<at::BFloat16>(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(),
                              v_cache.data_ptr<at::BFloat16>(), block_tables.data_ptr<int64_t>(),
                              ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, Hkv, D, nb, block_size,
                              static_cast<float>(scale), sliding_window);
  } else {
    TORCH_CHECK(false, "cache dtype must be float32 or bfloat16");
  }
  return out;
}
