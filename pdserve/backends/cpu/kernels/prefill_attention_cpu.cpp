// Prefill attention straight from the paged KV cache: each sequence's chunk of queries attends
// causally over its cached keys (the chunk's own included), read through its block table.
//
// Why: torch's scaled_dot_product_attention does 25-31 GFLOP/s on this CPU, masked or causal,
// and needs the prefix gathered into a padded copy plus a (Q x K) mask; it was a third of a
// 2048-token prefill (docs/BENCHMARKS.md). This is a flash-attention loop on the CPU: a tile of
// query rows walks the keys a vector at a time with an online softmax, skipping every key tile that is
// entirely in the future (half the work of a square mask) or outside the sliding window. A soft cap
// (Gemma 2: cap * tanh(score / cap)) is applied to the scores before the softmax. A head's sink
// logit (gpt-oss) joins the denominator at the end: O / (l + exp(sink - m)), no value of its own.
//
// Work item: (sequence, kv head, tile of query positions). The G query heads sharing a KV head are
// rows of the same tile, so each key block is transposed once for G x QT rows. Per block of NT x KT
// keys (KT: one vector of fp32 lanes):
//   S = Q K^T: keys transposed to NT tiles of (D, KT), so a row's KT scores per tile are one vector
//              built by D FMAs with the query element broadcast (no horizontal sums);
//   softmax:   running max m and sum l per row, P = exp(S - m), O rescaled when m grows;
//   O += P V:  R rows x D accumulators in registers, one value row loaded per key.
// A row's softmax bookkeeping (two horizontal reductions, a scalar exp, O loaded, rescaled and
// stored) is per block: with blocks of 64 keys instead of 16 it is a quarter as much per key.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include "ops.h"
#include "vec.h"
#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

using pdserve::fVec;
using pdserve::kVec;

constexpr int KT = kVec;                        // keys per tile: one vector of scores
constexpr int VP = 16 / kVec;                   // vectors per 16 elements
constexpr int kKtBytes = 16 << 10;              // a block's transposed keys stay in L1: NT <= this / (D x 16 x 4)
constexpr int64_t kTargetRows = 256;            // query rows (positions x heads) per work item: 64 and 128 measured 5-7% slower
constexpr double kMinParallelFlops = 4e6;       // less than this: one thread (see packed_tiles.h)

struct Work { int64_t b, kvh, q0, q1; };        // sequence, kv head, query offsets [q0, q1)

// f(std::integral_constant<int, n>{}) for 1 <= n <= NT: the score loop's tile count as a template
// argument, so that its accumulators stay in registers. A block at the causal diagonal holds fewer
// keys than NT tiles (a 128-token prompt's first: 36 positions): its empty tiles are not computed.
template <int NT, typename F>
inline void with_tiles(int n, F&& f) {
  if constexpr (NT > 1) {
    if (n < NT) return with_tiles<NT - 1>(n, f);
  }
  f(std::integral_constant<int, NT>{});
}

// C = D / 16; R rows per register tile (R x D / KT accumulators fit in the vector registers); NT
// tiles of KT keys per block (R x NT score accumulators, at most 16). cap: the scores' soft cap, 0: none;
// sinks: (H,) sink logits, nullptr: none.
template <typename T, int C, int R, int NT>
void prefill_impl(const float* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* q_starts,
                  const int64_t* q_lens, const int64_t* ctx, float* out, int64_t B, int64_t H, int64_t Hkv,
                  int64_t nb, int64_t bs, float scale, int64_t window, float cap, const float* sinks) {
  constexpr int D = 16 * C, CV = C * VP, KB = NT * KT;   // CV: vectors per row; KB: keys per block
  static_assert(R * NT <= 16 && D * KB * 4 <= kKtBytes, "block too big");
  const int64_t G = H / Hkv, row = Hkv * D;   // row: elements per cache slot
  const int64_t qt = std::max<int64_t>(1, kTargetRows / G);   // query positions per work item
  std::vector<Work> work;
  double flops = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t q0 = 0; q0 < q_lens[b]; q0 += qt) {
      const int64_t q1 = std::min(q_lens[b], q0 + qt);
      for (int64_t h = 0; h < Hkv; ++h) work.push_back({b, h, q0, q1});
      flops += 4.0 * D * H * (q1 - q0) * (ctx[b] - q_lens[b] + q1);
    }
  }
  // Later query tiles see more keys: hand out items dynamically, the biggest first.
  std::reverse(work.begin(), work.end());
  const int threads = flops < kMinParallelFlops ? 1 : at::get_num_threads();
  const int64_t max_rows = (qt * G + R - 1) / R * R;

#pragma omp parallel num_threads(threads)
  {
    std::vector<float> Q(max_rows * D), O(max_rows * D), m(max_rows), l(max_rows), P(max_rows * KB);
    std::vector<int64_t> pos(max_rows);
    alignas(64) float Kt[NT * D * KT];   // tile t: Kt + t * D * KT, (D, KT)
    const T* vrow[KB];
#pragma omp for schedule(dynamic, 1)
    for (size_t w = 0; w < work.size(); ++w) {
      const Work it = work[w];
      const int64_t n = ctx[it.b], first_pos = n - q_lens[it.b];   // absolute position of query 0
      const int64_t* table = tables + it.b * nb;
      const int64_t rows = (it.q1 - it.q0) * G, padded = (rows + R - 1) / R * R;
      // rows: query position major, head minor; queries pre-scaled; padding rows are zeros
      for (int64_t r = 0; r < padded; ++r) {
        const int64_t qi = it.q0 + r / G, h = it.kvh * G + r % G;
        pos[r] = first_pos + std::min(qi, it.q1 - 1);
        m[r] = -INFINITY;
        l[r] = 0.f;
        for (int c = 0; c < CV; ++c) {
          const fVec v = r < rows ? fVec::loadu(q + ((q_starts[it.b] + qi) * H + h) * D + kVec * c) * fVec(scale) : fVec(0.f);
          v.store(Q.data() + r * D + kVec * c);
          fVec(0.f).store(O.data() + r * D + kVec * c);
        }
      }
      const int64_t last = first_pos + it.q1 - 1;                  // the tile's last query position
      const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos + it.q0 - window + 1) : 0;
      for (int64_t k0 = lo; k0 <= last; k0 += KB) {
        const int nk = static_cast<int>(std::min<int64_t>(KB, last + 1 - k0)), nt = (nk + KT - 1) / KT;
        // keys k0..k0+nk transposed into Kt (zero past nk); value rows by pointer
        for (int j = 0; j < KB; ++j) {
          float* kt = Kt + (j / KT) * D * KT + j % KT;
          if (j < nk) {
            const int64_t p = k0 + j;
            const int64_t slot = table[p / bs] * bs + p % bs;
            const T* k = kc + slot * row + it.kvh * D;
            vrow[j] = vc + slot * row + it.kvh * D;
            for (int d = 0; d < D; ++d) kt[d * KT] = static_cast<float>(k[d]);
          } else {
            for (int d = 0; d < D; ++d) kt[d * KT] = 0.f;
          }
        }
        for (int64_t r0 = 0; r0 < padded; r0 += R) {
          // S for R rows x the block's first nt tiles (the rest hold no key: masked out below)
          fVec s[R][NT];
          for (int i = 0; i < R; ++i)
            for (int t = 0; t < NT; ++t) s[i][t] = fVec(0.f);
          const float* qr = Q.data() + r0 * D;
          with_tiles<NT>(nt, [&](auto NTU) {
            for (int d = 0; d < D; ++d) {
              fVec kv[NTU];
              for (int t = 0; t < NTU; ++t) kv[t] = fVec::loadu(Kt + t * D * KT + d * KT);
              for (int i = 0; i < R; ++i) {
                const fVec qv(qr[i * D + d]);
                for (int t = 0; t < NTU; ++t) s[i][t] = at::vec::fmadd(qv, kv[t], s[i][t]);
              }
            }
          });
          // online softmax per row; keys j of the block are visible where from <= j < hi
          float alpha[R];
          bool any = false;
          for (int i = 0; i < R; ++i) {
            const int64_t r = r0 + i, hi = std::min<int64_t>(nk, pos[r] - k0 + 1);
            const int64_t from = window > 0 ? std::max<int64_t>(0, pos[r] - window + 1 - k0) : 0;
            alpha[i] = 1.f;
            if (r >= rows || hi <= from) {   // padding, or no visible key in this block
              for (int t = 0; t < NT; ++t) fVec(0.f).store(P.data() + i * KB + t * KT);
              continue;
            }
            fVec si[NT], mask[NT], mx(-INFINITY);
            const fVec vfrom(static_cast<float>(from)), vhi(static_cast<float>(hi));
            for (int t = 0; t < NT; ++t) {
              const fVec j = fVec::arange(static_cast<float>(t * KT), 1.f);   // the lanes' keys in the block
              mask[t] = (j >= vfrom) & (j < vhi);
              si[t] = fVec::blendv(fVec(-INFINITY), cap > 0 ? pdserve::softcap(s[i][t], cap) : s[i][t], mask[t]);
              mx = pdserve::maxps(mx, si[t]);
            }
            const float mnew = std::max(m[r], pdserve::reduce_max(mx));
            const fVec mv(mnew);
            fVec sum(0.f);
            for (int t = 0; t < NT; ++t) {
              const fVec p = fVec::blendv(fVec(0.f), pdserve::exp(si[t] - mv), mask[t]);
              sum = sum + p;
              p.store(P.data() + i * KB + t * KT);
            }
            alpha[i] = std::exp(m[r] - mnew);   // 0 on the first visible block (m = -inf)
            l[r] = l[r] * alpha[i] + pdserve::reduce_add(sum);
            m[r] = mnew;
            any = true;
          }
          if (!any) continue;
          // O = alpha * O + P V for R rows, accumulated in registers
          fVec acc[R][CV];
          float* orow = O.data() + r0 * D;
          for (int i = 0; i < R; ++i)
            for (int c = 0; c < CV; ++c) acc[i][c] = fVec::loadu(orow + i * D + kVec * c) * fVec(alpha[i]);
          for (int j = 0; j < nk; ++j) {
            fVec vv[CV];
            for (int c = 0; c < CV; ++c) vv[c] = pdserve::load<T>(vrow[j] + kVec * c);
            for (int i = 0; i < R; ++i) {
              const fVec pw(P[i * KB + j]);
              for (int c = 0; c < CV; ++c) acc[i][c] = at::vec::fmadd(pw, vv[c], acc[i][c]);
            }
          }
          for (int i = 0; i < R; ++i)
            for (int c = 0; c < CV; ++c) acc[i][c].store(orow + i * D + kVec * c);
        }
      }
      // out = O / l (every real row saw at least its own key); with a sink, both rescaled to the
      // larger of m and the sink, so that neither exponential overflows
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t qi = it.q0 + r / G, h = it.kvh * G + r % G;
        float inv_l = 1.f / l[r];
        if (sinks) {
          const float mm = std::max(m[r], sinks[h]), a = std::exp(m[r] - mm);
          inv_l = a / (l[r] * a + std::exp(sinks[h] - mm));
        }
        const fVec inv(inv_l);
        float* o = out + ((q_starts[it.b] + qi) * H + h) * D;
        for (int c = 0; c < CV; ++c) (fVec::loadu(O.data() + r * D + kVec * c) * inv).store(o + kVec * c);
      }
    }
  }
}

template <typename T>
void prefill(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& tables,
             const torch::Tensor& q_starts, const torch::Tensor& q_lens, const torch::Tensor& ctx, torch::Tensor& out,
             int64_t bs, float scale, int64_t window, float cap, const float* sinks) {
  const int64_t B = q_lens.size(0), H = q.size(1), D = q.size(2), Hkv = kc.size(1), nb = tables.size(1);
  auto args = std::make_tuple(q.data_ptr<float>(), kc.data_ptr<T>(), vc.data_ptr<T>(), tables.data_ptr<int64_t>(),
                              q_starts.data_ptr<int64_t>(), q_lens.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(),
                              out.data_ptr<float>(), B, H, Hkv, nb, bs, scale, window, cap, sinks);
  switch (D / 16) {
#if defined(CPU_CAPABILITY_AVX512)
    // NT: as many 16-key tiles as fit R x NT <= 16 scores and 16 KB of transposed keys, at most 4
    case 1: std::apply(prefill_impl<T, 1, 8, 2>, args); break;
    case 2: std::apply(prefill_impl<T, 2, 8, 2>, args); break;
    case 4: std::apply(prefill_impl<T, 4, 4, 4>, args); break;
    case 6: std::apply(prefill_impl<T, 6, 2, 2>, args); break;
    case 8: std::apply(prefill_impl<T, 8, 2, 2>, args); break;
    // 256: one row of 16 accumulators, one tile of 16 keys (16 KB transposed)
    case 16: std::apply(prefill_impl<T, 16, 1, 1>, args); break;
#else
    // 16 registers of 8 lanes: R x D / 8 accumulators of O and R x NT of scores at most 12-16,
    // KB = 8 NT keys x D within 16 KB
    case 1: std::apply(prefill_impl<T, 1, 4, 2>, args); break;
    case 2: std::apply(prefill_impl<T, 2, 2, 4>, args); break;
    case 4: std::apply(prefill_impl<T, 4, 1, 8>, args); break;
    case 6: std::apply(prefill_impl<T, 6, 1, 4>, args); break;
    case 8: std::apply(prefill_impl<T, 8, 1, 4>, args); break;
    // 256: a row's 32 accumulators spill (correct, unmeasured); two tiles of 8 keys (16 KB)
    case 16: std::apply(prefill_impl<T, 16, 1, 2>, args); break;
#endif
    default: TORCH_CHECK(false, "prefill attention kernel: head_dim must be 16, 32, 64, 96, 128 or 256");
  }
}

}  // namespace

// q, out: (T, H, D) fp32, the step's flat batch; sequence b's queries are rows
// q_starts[b] .. q_starts[b] + q_lens[b] and are its last q_lens[b] positions of ctx_lens[b] keys
// (already written to the cache). k_cache, v_cache: (slots, Hkv, D) fp32|bf16; block_tables
// (B, nb), q_starts, q_lens, ctx_lens: int64; softcap: the scores' cap, 0: none; sinks: (H,) fp32
// sink logits, none: no sinks. Writes those rows of out; other rows are untouched.
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                             torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor ctx_lens, torch::Tensor out,
                             int64_t block_size, double scale, int64_t sliding_window, double softcap,
                             std::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be (T, H, D) fp32");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(), "bad out");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "bad cache");
  for (const auto& t : {block_tables, q_starts, q_lens, ctx_lens})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), "tables, starts and lengths must be int64");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK((D == 16 || D == 32 || D == 64 || D == 96 || D == 128 || D == 256) && H % Hkv == 0 &&
              k_cache.size(2) == D, "unsupported head shape");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  const float* sink = pdserve::sink_logits(sinks, H);
  if (q_lens.size(0) == 0) return;
  if (k_cache.scalar_type() == at::kFloat) {
    prefill<float>(q, k_cache, v_cache, block_tables, q_starts, q_lens, ctx_lens, out, block_size,
                   static_cast<float>(scale), sliding_window, static_cast<float>(softcap), sink);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    prefill<at::BFloat16>(q, k_cache, v_cache, block_tables, q_starts, q_lens, ctx_lens, out, block_size,
                          static_cast<float>(scale), sliding_window, static_cast<float>(softcap), sink);
  } else {
    TORCH_CHECK(false, "cache dtype must be float32 or bfloat16");
  }
}
