// Decode attention straight from the paged KV cache: one query token per sequence attends over
// its cached keys, read block by block through its block table. No gathered copy of K and V and
// no padded mask: each key and value row is read once. Grouped-query attention: the G query heads
// sharing a KV head are handled together, so each K/V row is read once per group, not per head.
// A soft cap (Gemma 2: cap * tanh(score / cap)) is applied to the scores before the softmax.
// Attention sinks (gpt-oss): a learned logit per head joins the softmax's denominator only.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "ops.h"
#include "vec.h"
#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

using pdserve::fVec;
using pdserve::kVec;
constexpr int VP = 16 / kVec;   // vectors per 16 elements

// softmax in place over s[0:n] and a sink logit (-inf: none), which counts in the denominator only
inline void softmax(float* s, int64_t n, float sink) {
  const fVec ninf(-INFINITY);
  fVec mx = ninf;
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t c = std::min<int64_t>(kVec, n - i);
    mx = pdserve::maxps(mx, fVec::set(ninf, fVec::loadu(s + i, c), c));
  }
  const float m = std::max(pdserve::reduce_max(mx), sink);
  const fVec vmax(m);
  fVec sum(0.f);
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t c = std::min<int64_t>(kVec, n - i);
    const fVec e = fVec::set(fVec(0.f), pdserve::exp(fVec::loadu(s + i, c) - vmax), c);
    e.store(s + i, c);
    sum = sum + e;
  }
  const fVec inv(1.f / (pdserve::reduce_add(sum) + std::exp(sink - m)));
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t c = std::min<int64_t>(kVec, n - i);
    (fVec::loadu(s + i, c) * inv).store(s + i, c);
  }
}

// The kVec horizontal sums of v[0..kVec) as one vector (lane j = sum of v[j]), by a transpose-add
// tree instead of kVec latency-bound reductions: shuffles the vector layer does not have.
#if defined(CPU_CAPABILITY_AVX512)
inline fVec transpose_sum(const fVec* fv) {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = fv[i];
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)   // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of 4 consecutive vectors
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // add the four 128-bit lanes: even + odd lanes, twice
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline fVec transpose_sum(const fVec* fv) {
  __m256 v[8];
  for (int i = 0; i < 8; ++i) v[i] = fv[i];
  // per 128-bit lane: pairwise sums, then sums of four, of two vectors at a time
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // low lanes + high lanes: lanes 0-3 the sums of v[0..3], 4-7 those of v[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#else
inline fVec transpose_sum(const fVec* v) {
  alignas(64) float s[kVec];
  for (int i = 0; i < kVec; ++i) s[i] = pdserve::reduce_add(v[i]);
  return fVec::loadu(s);
}
#endif

// prefetcht2 of the line at p, kept even where the compiler would drop a prefetch it finds idle
// (GCC 12 dropped this loop's prefetches when it had nothing else to do, and batch 4-32 ran slower)
inline void prefetch_l2_kept(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht2 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

// Ask for the next tile's cache slots while this one is computed: they sit in scattered blocks,
// where the hardware prefetcher does not look ahead (n may be <= 0). Into L2, not L1 (T2, not T0):
// an L1 prefetch holds one of the core's few L1 miss buffers until its line arrives, and the
// prefetch instructions themselves stalled on them; through L2 more lines are in flight at once.
// A task that reads whole slots (all of a sequence's KV heads: 128 lines a tile at Qwen-0.5B's
// heads) asks for them in parts, one before each of the tile's head loops, rather than all at the
// tile's start, so that the requests do not queue behind each other; a task with part of each
// slot (batch 1-3) asks at the tile's start, where spreading them measured slower. The burst
// keeps its own loop: as prefetch_part(rows, n, bytes, 0, 1) batch 1 measured slower.
template <typename T>
inline void prefetch_rows(const T* const* rows, int64_t n, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t off = 0; off < bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[j]) + off, 0, 1);   // prefetcht2
}

// Part i of n of prefetch_rows(rows, m, bytes): its lines total * i / n .. total * (i + 1) / n.
template <typename T>
inline void prefetch_part(const T* const* rows, int64_t m, int64_t bytes, int64_t i, int64_t n) {
  const int64_t lines = (bytes + 63) / 64, total = std::max<int64_t>(0, m) * lines, end = total * (i + 1) / n;
  int64_t l = total * i / n, j = l / lines, line = l % lines;
  for (; l < end; ++l) {
    prefetch_l2_kept(reinterpret_cast<const char*>(rows[j]) + line * 64);
    if (++line == lines) line = 0, ++j;
  }
}

// scores s[0:n] = cap * tanh(s / cap) in place
inline void cap_scores(float* s, int64_t n, float cap) {
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t c = std::min<int64_t>(kVec, n - i);
    pdserve::softcap(fVec::loadu(s + i, c), cap).store(s + i, c);
  }
}

// Heads per pass-2 chunk: half the vector registers as accumulators (16 of AVX-512's 32).
constexpr int kAccRegs = kVec == 16 ? 16 : 8;
template <int C> constexpr int64_t kMaxHeads = kAccRegs / (C * VP) > 0 ? kAccRegs / (C * VP) : 1;

// o[g] += sum_j s[g * ls + j] * v[j] for g < GN heads and j < nk value rows; o rows 16 C apart.
template <typename T, int C, int GN>
inline void weigh_values_n(const T* const* vrows, int64_t off, int64_t nk, const float* s, int64_t ls, float* o) {
  constexpr int CV = C * VP;   // vectors per head row
  fVec acc[GN][CV];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < CV; ++c) acc[g][c] = fVec::loadu(o + (g * CV + c) * kVec);
  for (int64_t j = 0; j < nk; ++j) {
    fVec v[CV];
    for (int c = 0; c < CV; ++c) v[c] = pdserve::load<T>(vrows[j] + off + kVec * c);
    for (int g = 0; g < GN; ++g) {
      const fVec w(s[g * ls + j]);
      for (int c = 0; c < CV; ++c) acc[g][c] = at::vec::fmadd(w, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < CV; ++c) acc[g][c].store(o + (g * CV + c) * kVec);
}

// weigh_values_n with the head count a run-time value in 1..kMaxHeads<C>
template <typename T, int C, int GN = kMaxHeads<C>>
inline void weigh_values(int64_t gn, const T* const* vrows, int64_t off, int64_t nk, const float* s, int64_t ls,
                         float* o) {
  if constexpr (GN > 1) {
    if (gn < GN) return weigh_values<T, C, GN - 1>(gn, vrows, off, nk, s, ls, o);
  }
  weigh_values_n<T, C, GN>(vrows, off, nk, s, ls, o);
}

// C = head_dim / 16 is a template argument so that q and the accumulators live in registers
// (up to head_dim 128 on AVX-512, 64 on AVX2; 256 spills, correct but unmeasured). cap: the
// scores' soft cap, 0: none; sinks: (H,) each head's sink logit, nullptr: none.
template <typename T, int C>
void decode_impl(const float* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* ctx,
                 float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t nb, int64_t bs,
                 float scale, int64_t window, float cap, const float* sinks) {
  const int64_t G = H / Hkv, row = Hkv * D;   // row: elements per cache slot
  // A task is a sequence's KV heads, or a part of them when there are fewer sequences than threads
  // to share: its keys and values are then read as whole contiguous slots, which the hardware
  // prefetcher follows (a head's part of a slot is a strided read).
  const int64_t parts = std::clamp<int64_t>((2 * at::get_num_threads() + B - 1) / B, 1, Hkv);
  // the next tile's slots in parts, one per head loop, when a task reads whole slots
  const bool spread = parts == 1;
  // one thread for small work (see packed_tiles.h)
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += ctx[b];
  const int64_t bytes_per_task = std::max<int64_t>(1, total / B * 2 * row / parts * int64_t(sizeof(T)));
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / bytes_per_task);
  at::parallel_for(0, B * parts, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores, qs;
    std::vector<const T*> krows, vrows;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / parts, h0 = t % parts * Hkv / parts, h1 = (t % parts + 1) * Hkv / parts, nh = h1 - h0;
      const int64_t n = ctx[b], first = window > 0 ? std::max<int64_t>(0, n - window) : 0, len = n - first;
      const int64_t* table = tables + b * nb;
      const int64_t slot_bytes = nh * D * int64_t(sizeof(T));
      // krows[i], vrows[i]: key and value i's slot, at KV head h0
      krows.resize(len);
      vrows.resize(len);
      for (int64_t blk = first / bs; blk * bs < n; ++blk) {
        const int64_t base = table[blk] * bs * row + h0 * D;
        const int64_t lo = std::max(first, blk * bs), hi = std::min(n, blk * bs + bs);
        for (int64_t p = lo; p < hi; ++p) {
          krows[p - first] = kc + base + (p - blk * bs) * row;
          vrows[p - first] = vc + base + (p - blk * bs) * row;
        }
      }
      // query heads h0 * G .. h1 * G: a contiguous (nh * G, D) block of q and of out
      scores.resize(nh * G * len);
      qs.resize(nh * G * D);
      for (int64_t i = 0; i < nh * G * D; ++i) qs[i] = q[(b * H + h0 * G) * D + i] * scale;
      // pass 1: scores q.k, 16 keys at a time while they are in L1, for every query head; 16
      // vectors of partial sums per head and tile, reduced together (no horizontal sum per key)
      for (int64_t i0 = 0; i0 < len; i0 += 16) {
        const int64_t nk = std::min<int64_t>(16, len - i0);   // a short tail repeats its last key
        const int64_t next = std::min<int64_t>(16, len - i0 - 16);
        if (!spread) prefetch_rows(krows.data() + i0 + 16, next, slot_bytes);
        for (int64_t h = 0; h < nh; ++h) {
          for (int64_t g = h * G; g < (h + 1) * G; ++g) {
            if (spread) prefetch_part(krows.data() + i0 + 16, next, slot_bytes, g, nh * G);
            constexpr int CV = C * VP;
            fVec qv[CV];
            for (int c = 0; c < CV; ++c) qv[c] = fVec::loadu(qs.data() + g * D + kVec * c);
            for (int j0 = 0; j0 < 16; j0 += kVec) {   // kVec keys' partial sums, reduced together
              fVec acc[kVec];
              for (int j = 0; j < kVec; ++j) {
                const T* k = krows[i0 + std::min<int64_t>(j0 + j, nk - 1)] + h * D;
                acc[j] = qv[0] * pdserve::load<T>(k);
                for (int c = 1; c < CV; ++c) acc[j] = at::vec::fmadd(qv[c], pdserve::load<T>(k + kVec * c), acc[j]);
              }
              if (j0 < nk) transpose_sum(acc).store(scores.data() + g * len + i0 + j0, std::min<int64_t>(kVec, nk - j0));
            }
          }
        }
      }
      if (cap > 0)
        for (int64_t g = 0; g < nh * G; ++g) cap_scores(scores.data() + g * len, len, cap);
      for (int64_t g = 0; g < nh * G; ++g)
        softmax(scores.data() + g * len, len, sinks ? sinks[h0 * G + g] : -INFINITY);
      // pass 2: weighted sum of values. Each value row is loaded once per tile and head chunk and
      // feeds the accumulators of all the chunk's heads: GN x C independent FMA chains per key
      // (one head's C chains alone wait on the FMA latency).
      float* o = out + (b * H + h0 * G) * D;
      for (int64_t i = 0; i < nh * G * D; ++i) o[i] = 0.f;
      for (int64_t i0 = 0; i0 < len; i0 += 16) {
        const int64_t nk = std::min<int64_t>(16, len - i0);
        const int64_t next = std::min<int64_t>(16, len - i0 - 16);
        if (!spread) prefetch_rows(vrows.data() + i0 + 16, next, slot_bytes);
        const int64_t chunks = nh * ((G + kMaxHeads<C> - 1) / kMaxHeads<C>);
        int64_t chunk = 0;
        for (int64_t h = 0; h < nh; ++h)
          for (int64_t g0 = h * G; g0 < (h + 1) * G; g0 += kMaxHeads<C>, ++chunk) {
            if (spread) prefetch_part(vrows.data() + i0 + 16, next, slot_bytes, chunk, chunks);
            weigh_values<T, C>(std::min<int64_t>(kMaxHeads<C>, (h + 1) * G - g0), vrows.data() + i0, h * D, nk,
                               scores.data() + g0 * len + i0, len, o + g0 * D);
          }
      }
    }
  });
}

template <typename T>
void decode(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& tables,
            const torch::Tensor& ctx, torch::Tensor& out, int64_t bs, float scale, int64_t window, float cap,
            const float* sinks) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = kc.size(1), nb = tables.size(1);
  auto args = std::make_tuple(q.data_ptr<float>(), kc.data_ptr<T>(), vc.data_ptr<T>(), tables.data_ptr<int64_t>(),
                              ctx.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, Hkv, D, nb, bs, scale, window, cap,
                              sinks);
  switch (D / 16) {
    case 1: std::apply(decode_impl<T, 1>, args); break;
    case 2: std::apply(decode_impl<T, 2>, args); break;
    case 4: std::apply(decode_impl<T, 4>, args); break;
    case 6: std::apply(decode_impl<T, 6>, args); break;
    case 8: std::apply(decode_impl<T, 8>, args); break;
    case 16: std::apply(decode_impl<T, 16>, args); break;
    default: TORCH_CHECK(false, "decode attention kernel: head_dim must be 16, 32, 64, 96, 128 or 256");
  }
}

}  // namespace

// q: (B, H, D) fp32; k_cache, v_cache: (slots, Hkv, D) fp32|bf16; block_tables: (B, nb) int64;
// ctx_lens: (B,) int64 keys per sequence (including this step's); softcap: the scores' cap, 0: none;
// sinks: (H,) fp32 sink logits (gpt-oss), none: no sinks. Returns (B, H, D) fp32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t block_size,
                                     double scale, int64_t sliding_window, double softcap,
                                     std::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be (B, H, D) fp32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "bad cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && ctx_lens.is_contiguous(), "tables and lengths must be int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK((D == 16 || D == 32 || D == 64 || D == 96 || D == 128 || D == 256) && H % Hkv == 0 &&
              k_cache.size(2) == D, "unsupported head shape");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  const float* sink = pdserve::sink_logits(sinks, H);
  auto out = torch::empty_like(q);
  if (B == 0) return out;
  if (k_cache.scalar_type() == at::kFloat) {
    decode<float>(q, k_cache, v_cache, block_tables, ctx_lens, out, block_size, static_cast<float>(scale), sliding_window,
                  static_cast<float>(softcap), sink);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    decode<at::BFloat16>(q, k_cache, v_cache, block_tables, ctx_lens, out, block_size, static_cast<float>(scale),
                         sliding_window, static_cast<float>(softcap), sink);
  } else {
    TORCH_CHECK(false, "cache dtype must be float32 or bfloat16");
  }
  return out;
}
