// Linear layers for CPU decode: y = x @ W^T (+ bias), W pre-packed into panels of 16 output
// channels so that every weight is read once, sequentially, whatever the number of rows.
//
// Why: torch's fp32 GEMM (MKL) reads weights at well under DRAM bandwidth for 1..32 rows on this
// machine (docs/BENCHMARKS.md), and decode is nothing but such products. Packed layout:
// panel p holds W[16p:16p+16, :] transposed, i.e. P[p][k][0:16], so one 64-byte cache line
// per k per panel. Weights are fp32, bf16 or int8 (symmetric, one scale per output channel);
// activations and accumulation are always fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "vec512.h"
#include "buffer_pool.h"
#include <cmath>
#include <cstring>
#include <vector>
#include <algorithm>
#include <type_traits>

namespace {

constexpr int PANEL = 16;   // output channels per panel: one zmm of fp32
constexpr int NP = 4;       // panels per micro-tile (64 outputs)
constexpr int KB = 512;     // k-block: NP panels x KB rows of weights stay in L2 across row tiles
constexpr int MB = 96;      // row block: its x rows stay in L2 while all weights stream past once
constexpr int64_t kMinParallelBytes = 512 << 10;  // less weight traffic (x row tiles) than this: one thread

using pdserve::load16;

// The next weight block a thread reads (its group's next k-block, or the next group's first),
// prefetched into L2 a line per k-step during the later row tiles of the current block, so that
// the first row tile of the next one finds it there instead of waiting on DRAM. Lines of panel j:
// base + j * panel_bytes + i * 64, i < lines; tile t of T issues lines up to lines * NP * t / (T - 1).
// With 2 or 3 row tiles (7-18 rows) there is too little compute after the first tile to spread a
// whole block over, and instead each k-step of a tile asks for its panels' lines `ahead` k-steps
// on: the first tile's stream runs ahead of its loads, and the later tiles start the next k-block's
// stream before the next first tile needs it (AheadTiles says for which tile counts: fp32 engine
// steps at 12-16 rows 1.03-1.09x, bf16 pairs at 6-24 rows 1.05-1.29x: perf/linear_labs/). Past a
// matrix's end it asks for lines that are not ours: harmless, a prefetch never faults.
struct NextBlock {
  const char* base = nullptr;
  int64_t panel_bytes = 0, lines = 0, next = 0, end = 0;
  int64_t ahead = 0;
  inline void prefetch_one() {
    if (next < end) {
      _mm_prefetch(base + (next / lines) * panel_bytes + (next % lines) * 64, _MM_HINT_T2);
      ++next;
    }
  }
};
constexpr int64_t kMinPrefetchTiles = 4;   // from 19 rows; fewer: 0.98-1.0x at 16 rows, slower at 1
constexpr int64_t kAheadSteps = 32;        // k-steps (2 KB of a panel, fp32 or bf16 pairs)

// The row-tile counts whose tiles prefetch `ahead`, measured per kernel (perf/linear_labs/): fp32
// 2-3 tiles (one tile: 0.90-1.03x); bf16 pairs 1-4 tiles, where each k-step does twice the
// multiply-adds and the stream falls behind more (6 rows 1.29x, 8-16 rows 1.11-1.17x, 20-24 rows
// 1.05x alongside the next-block prefetch; 28-32 rows 0.98-1.02x, so not from 5 tiles).
struct AheadTiles {
  int64_t min, max;
};
constexpr AheadTiles kAheadFp32{2, kMinPrefetchTiles - 1};
constexpr AheadTiles kAheadPairs{1, 4};
constexpr AheadTiles kNoAhead{1, 0};   // the widened bf16 and int8 tiles (int8 measured without gain)

// MT rows x NP panels over k in [k0, k1); accumulates into y (row stride ldy) unless first.
// Ahead: prefetch pf.ahead k-steps on (with_ahead picks it).
template <typename W, int MT, bool Ahead>
inline void micro(const float* x, int64_t ldx, const W* w, int64_t panel_stride, float* y, int64_t ldy,
                  int64_t k0, int64_t k1, bool first, NextBlock& pf) {
  __m512 acc[MT][NP];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NP; ++j)
      acc[m][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * ldy + j * PANEL);
  for (int64_t k = k0; k < k1; ++k) {
    pf.prefetch_one();
    if constexpr (Ahead)
      for (int j = 0; j < NP; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * panel_stride + (k + pf.ahead) * PANEL), _MM_HINT_T2);
    __m512 wv[NP];
    for (int j = 0; j < NP; ++j) wv[j] = load16<W>(w + j * panel_stride + k * PANEL);
    for (int m = 0; m < MT; ++m) {
      __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(y + m * ldy + j * PANEL, acc[m][j]);
}

// f(std::integral_constant<int, MT>{}) for a row tile of mt = MT rows, 1 <= mt <= 6: the micro
// kernels take MT as a template argument, so that their accumulators live in registers.
template <typename F>
inline void with_tile_height(int64_t mt, F&& f) {
  switch (mt) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    default: f(std::integral_constant<int, 6>{}); break;
  }
}

// f(std::bool_constant<on>{}): the micro kernels take the ahead prefetch as a template argument,
// so that without it their loop has no branch for it.
template <typename F>
inline void with_ahead(bool on, F&& f) {
  if (on) f(std::true_type{}); else f(std::false_type{});
}

// The blocking both products share. Row blocks of MB: decode (M <= MB) reads the weights once.
// Threads split the output channels into groups of NP panels: each reads a disjoint, contiguous
// part of the weights. Then k-blocks, then balanced row tiles of at most 6 (32 rows: 6,6,5,5,5,5,
// not 6x5 + 2): a thin tile pays the same weight loads for fewer FMAs.
// With kMinPrefetchTiles row tiles or more, the later ones prefetch the next block (NextBlock);
// with as many as `ahead` says, every tile prefetches ahead of its own k-steps.
// tile(mt, m, g, k0, k1, pf): rows [m, m + mt) x group g over k-steps [k0, k1). The weights start
// at w; a k-step of one panel is step_bytes (a group is NP panels of ksteps k-steps each).
template <typename Tile>
void for_each_tile(int64_t M, int64_t ksteps, int64_t kblock, int64_t groups, const void* w, int64_t step_bytes,
                   AheadTiles ahead, const Tile& tile) {
  const int64_t panel_bytes = ksteps * step_bytes, group_bytes = NP * panel_bytes;
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t m1 = std::min(M, m0 + MB);
    // Small products run on one thread: waking a second one costs more than it saves, and on a
    // busy machine a parallel region waits for a descheduled thread.
    const int64_t grain = std::max<int64_t>(1, kMinParallelBytes / (group_bytes * (m1 - m0 + 5) / 6));
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        for (int64_t k0 = 0; k0 < ksteps; k0 += kblock) {
          const int64_t k1 = std::min(ksteps, k0 + kblock);
          const int64_t tiles = (m1 - m0 + 5) / 6;
          NextBlock pf;
          const int64_t ng = k1 < ksteps ? g : g + 1, nk0 = k1 < ksteps ? k1 : 0;
          if (tiles >= kMinPrefetchTiles && ng < g1) {
            pf.base = static_cast<const char*>(w) + ng * group_bytes + nk0 * step_bytes;
            pf.panel_bytes = panel_bytes;
            pf.lines = ((std::min(ksteps, nk0 + kblock) - nk0) * step_bytes + 63) / 64;
          }
          if (tiles >= ahead.min && tiles <= ahead.max) pf.ahead = kAheadSteps;
          for (int64_t t = 0, m = m0; t < tiles; ++t) {
            const int64_t mt = (m1 - m + (tiles - t) - 1) / (tiles - t);
            if (pf.base && t > 0) pf.end = pf.lines * NP * t / (tiles - 1);
            tile(mt, m, g, k0, k1, pf);
            m += mt;
          }
        }
      }
    });
  }
}

// Where a tile's 64 outputs go. DenseOut: the (M, Npad) result. ArgmaxOut: a scratch block of the
// running thread (M x 64, the group's columns), whose rows are folded into the thread's per-row
// argmax once the last k-block is in (done), so the (M, N) logits are never written nor read back.
struct DenseOut {
  float* y;
  int64_t Npad;
  float* tile(int64_t m, int64_t g) const { return y + m * Npad + g * NP * PANEL; }
  int64_t ld() const { return Npad; }
  void done(int64_t, int64_t, int64_t) const {}
};

// A row's best logit so far: the first maximum, a NaN counting as the maximum (torch.argmax's rule).
struct RowBest {
  float v = -INFINITY;
  int64_t i = -1;
  // (v, i) from a later column or another thread's range
  bool beaten_by(float cv, int64_t ci) const {
    if (i < 0) return true;
    const bool nan = std::isnan(v), cnan = std::isnan(cv);
    if (nan || cnan) return cnan && (!nan || ci < i);
    return cv > v || (cv == v && ci < i);
  }
};

struct ArgmaxOut {
  float* scratch;                    // threads x M x 64
  std::vector<RowBest>* best;        // threads x M
  int64_t M, n;                      // rows; valid columns (the rest is padding)
  const float *scale, *bias;         // per column (scale: Npad, bias: n), or null
  float* tile(int64_t m, int64_t) const { return scratch + (at::get_thread_num() * M + m) * NP * PANEL; }
  int64_t ld() const { return NP * PANEL; }
  void done(int64_t m0, int64_t mt, int64_t g) const {
    const int t = at::get_thread_num();
    const int64_t c0 = g * NP * PANEL, valid = std::min<int64_t>(NP * PANEL, n - c0);
    for (int64_t m = m0; m < m0 + mt; ++m) {
      const float* row = scratch + (t * M + m) * NP * PANEL;
      RowBest& b = best[t][m];
      __m512 v[NP], mx = _mm512_set1_ps(-INFINITY);
      __mmask16 nan = 0;
      for (int j = 0; j < NP; ++j) {
        const __mmask16 in = valid > j * PANEL ? pdserve::lanes(valid - j * PANEL) : 0;   // padding never wins
        v[j] = _mm512_maskz_loadu_ps(in, row + j * PANEL);
        if (scale) {
          v[j] = _mm512_mul_ps(v[j], _mm512_maskz_loadu_ps(in, scale + c0 + j * PANEL));
          asm("" : "+v"(v[j]));   // rounded here, as y.mul_(scale) does: never fused with the bias add
        }
        if (bias) v[j] = _mm512_add_ps(v[j], _mm512_maskz_loadu_ps(in, bias + c0 + j * PANEL));
        v[j] = _mm512_mask_blend_ps(in, _mm512_set1_ps(-INFINITY), v[j]);
        nan |= _mm512_cmp_ps_mask(v[j], v[j], _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v[j]);
      }
      // columns ascend within a thread: a later column wins only if strictly greater (or the first NaN)
      if (!nan && b.i >= 0 && !_mm512_cmp_ps_mask(mx, _mm512_set1_ps(b.v), _CMP_GT_OQ)) continue;
      for (int j = 0; j < NP; ++j) {
        alignas(64) float vals[PANEL];
        _mm512_store_ps(vals, v[j]);
        for (int l = 0; l < PANEL && j * PANEL + l < valid; ++l)
          if (b.beaten_by(vals[l], c0 + j * PANEL + l)) b = RowBest{vals[l], c0 + j * PANEL + l};
      }
    }
  }
};

// The screen of a screened argmax (packed_linear_argmax_screened): each column's bf16 dot product
// A with an error radius E, such that the exact fp32 logit lies in [A - E, A + E]. Per thread and
// row it keeps the largest lower bound seen so far and every column whose upper bound reaches it
// then: a column whose upper bound reaches the final largest lower bound was kept when it came.
struct ScreenOut {
  struct Candidate {
    int64_t col;
    float hi;
  };
  float* scratch;                                  // threads x M x 64
  std::vector<float>* lo_max;                      // threads x M
  std::vector<std::vector<Candidate>>* kept;       // threads x M
  int64_t M, n;
  const float* col_norm;                           // ||W[c]||_2, rounded up (Npad)
  const float *radius, *slack;                     // per row: E = radius * col_norm + slack + |A| 2^-21
  float* tile(int64_t m, int64_t) const { return scratch + (at::get_thread_num() * M + m) * NP * PANEL; }
  int64_t ld() const { return NP * PANEL; }
  void done(int64_t m0, int64_t mt, int64_t g) const {
    const int t = at::get_thread_num();
    const int64_t c0 = g * NP * PANEL, valid = std::min<int64_t>(NP * PANEL, n - c0);
    const __m512 rel = _mm512_set1_ps(0x1p-21f), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t m = m0; m < m0 + mt; ++m) {
      const float* row = scratch + (t * M + m) * NP * PANEL;
      const __m512 r = _mm512_set1_ps(radius[m]), sl = _mm512_set1_ps(slack[m]);
      __m512 hi[NP], mx = ninf;
      __mmask16 in[NP];
      for (int j = 0; j < NP; ++j) {
        in[j] = valid > j * PANEL ? pdserve::lanes(valid - j * PANEL) : 0;   // padding is never kept
        const __m512 a = _mm512_maskz_loadu_ps(in[j], row + j * PANEL);
        // |A| 2^-21 covers the fp32 rounding of these adds (the radius carries the rest, kernel docs)
        const __m512 e = _mm512_fmadd_ps(r, _mm512_maskz_loadu_ps(in[j], col_norm + c0 + j * PANEL),
                                         _mm512_fmadd_ps(_mm512_abs_ps(a), rel, sl));
        hi[j] = _mm512_add_ps(a, e);
        mx = _mm512_max_ps(mx, _mm512_mask_blend_ps(in[j], ninf, _mm512_sub_ps(a, e)));
      }
      float& lo = lo_max[t][m];
      lo = std::max(lo, _mm512_reduce_max_ps(mx));
      const __m512 lov = _mm512_set1_ps(lo);
      for (int j = 0; j < NP; ++j) {
        uint32_t keep = _mm512_mask_cmp_ps_mask(in[j], hi[j], lov, _CMP_GE_OQ);
        if (!keep) continue;
        alignas(64) float h[PANEL];
        _mm512_store_ps(h, hi[j]);
        for (; keep; keep &= keep - 1) {
          const int l = __builtin_ctz(keep);
          kept[t][m].push_back({c0 + j * PANEL + l, h[l]});
        }
      }
    }
  }
};

template <typename W, typename Out>
void linear_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t Npad, const Out& out) {
  const int64_t ps = K * PANEL;   // elements per panel
  constexpr AheadTiles ahead = std::is_same_v<W, float> ? kAheadFp32 : kNoAhead;
  for_each_tile(M, K, KB, Npad / (PANEL * NP), w, PANEL * int64_t(sizeof(W)), ahead,
                [&](int64_t mt, int64_t m, int64_t g, int64_t k0, int64_t k1, NextBlock& pf) {
                  with_tile_height(mt, [&](auto MT) {
                    with_ahead(pf.ahead, [&](auto A) {
                      micro<W, MT, A>(x + m * K, K, w + g * NP * ps, ps, out.tile(m, g), out.ld(), k0, k1, k0 == 0, pf);
                    });
                  });
                  if (k1 == K) out.done(m, mt, g);
                });
}

// bf16 x bf16 -> fp32 dot products (AVX512-BF16): twice the multiply-adds per instruction of
// fp32 FMAs, for the compute-bound products of a bf16 model (prefill, large decode batches).
// Weights are packed in k-pairs: panel p holds P[p][k/2][16 channels][2], activations are bf16.
// Ahead: prefetch pf.ahead k-pair steps on (a template argument: without it the loop is as before).
template <int MT, bool Ahead>
inline void micro_dp(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, float* y, int64_t ldy,
                     int64_t kp0, int64_t kp1, bool first, NextBlock& pf) {
  __m512 acc[MT][NP];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NP; ++j)
      acc[m][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * ldy + j * PANEL);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    pf.prefetch_one();
    if constexpr (Ahead)
      for (int j = 0; j < NP; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * panel_stride + (kp + pf.ahead) * 2 * PANEL), _MM_HINT_T2);
    __m512bh wv[NP];
    for (int j = 0; j < NP; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * panel_stride + kp * 2 * PANEL);
    for (int m = 0; m < MT; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(y + m * ldy + j * PANEL, acc[m][j]);
}

// The same blocking as linear_impl, over k-pairs.
template <typename Out>
void linear_dp_impl(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t Npad, const Out& out) {
  const int64_t ps = K * PANEL;   // elements per panel: K / 2 pairs of 2 x 16
  for_each_tile(M, K / 2, KB / 2, Npad / (PANEL * NP), w, 2 * PANEL * 2, kAheadPairs,
                [&](int64_t mt, int64_t m, int64_t g, int64_t k0, int64_t k1, NextBlock& pf) {
                  with_tile_height(mt, [&](auto MT) {
                    with_ahead(pf.ahead, [&](auto A) {
                      micro_dp<MT, A>(x + m * K, K, w + g * NP * ps, ps, out.tile(m, g), out.ld(), k0, k1, k0 == 0, pf);
                    });
                  });
                  if (k1 == K / 2) out.done(m, mt, g);
                });
}

}  // namespace

// x: (M, K) fp32 contiguous; packed: (Npad/16, K, 16) fp32|bf16|int8; scale: (Npad,) fp32 or empty.
// Returns (M, Npad) fp32; the caller slices off padding and adds bias.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (M, K) fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.is_contiguous(), "bad packed weight");
  const int64_t M = x.size(0), K = x.size(1), Npad = packed.size(0) * PANEL;
  TORCH_CHECK(packed.size(1) == K && Npad % (PANEL * NP) == 0, "packed weight does not match x");
  auto y = pdserve::pooled_empty({M, Npad});
  if (M == 0) return y;
  const DenseOut out{y.data_ptr<float>(), Npad};
  switch (packed.scalar_type()) {
    case at::kFloat:
      linear_impl<float>(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), Npad, out);
      break;
    case at::kBFloat16:
      linear_impl<at::BFloat16>(x.data_ptr<float>(), M, K, packed.data_ptr<at::BFloat16>(), Npad, out);
      break;
    case at::kChar:
      linear_impl<int8_t>(x.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), Npad, out);
      break;
    default:
      TORCH_CHECK(false, "packed weight dtype must be float32, bfloat16 or int8");
  }
  if (scale.defined() && scale.numel() > 0) y.mul_(scale);
  return y;
}

// x: (M, K) bf16, K even; packed: (Npad/16, K/2, 32) bf16 (k-pairs). Returns (M, Npad) fp32.
torch::Tensor packed_linear_bf16_pairs(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be (M, K) bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * PANEL && packed.scalar_type() == at::kBFloat16 &&
              packed.is_contiguous(), "bad pair-packed weight");
  const int64_t M = x.size(0), K = x.size(1), Npad = packed.size(0) * PANEL;
  TORCH_CHECK(K % 2 == 0 && packed.size(1) * 2 == K && Npad % (PANEL * NP) == 0, "packed weight does not match x");
  auto y = pdserve::pooled_empty({M, Npad});
  if (M == 0) return y;
  linear_dp_impl(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K,
                 reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), Npad, DenseOut{y.data_ptr<float>(), Npad});
  return y;
}

// Greedy sampling's token: the argmax of each row of x @ W^T * scale + bias over the first n
// columns (torch.argmax's rule), as packed_linear (or packed_linear_bf16_pairs, for k-pair
// panels, with x rounded to bf16 as PackedLinear rounds it) computes them, but without writing the
// (M, n) logits and reading them back. x: (M, K) fp32; scale: (Npad,) or empty; bias: (n,) fp32 or
// empty. Returns (M,) int64.
torch::Tensor packed_linear_argmax(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor bias,
                                   int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (M, K) fp32");
  const bool pairs = packed.dim() == 3 && packed.size(2) == 2 * PANEL;
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == PANEL || pairs) && packed.is_contiguous(), "bad packed weight");
  const int64_t M = x.size(0), K = x.size(1), Npad = packed.size(0) * PANEL;
  TORCH_CHECK(packed.size(1) * (pairs ? 2 : 1) == K && Npad % (PANEL * NP) == 0, "packed weight does not match x");
  TORCH_CHECK(n > 0 && n <= Npad, "n must be in [1, ", Npad, "]");
  const bool scaled = scale.defined() && scale.numel() > 0, biased = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!scaled || (scale.scalar_type() == at::kFloat && scale.numel() == Npad && scale.is_contiguous()), "bad scale");
  TORCH_CHECK(!biased || (bias.scalar_type() == at::kFloat && bias.numel() == n && bias.is_contiguous()), "bad bias");
  auto result = torch::empty({M}, torch::kLong);
  if (M == 0) return result;
  const int threads = at::get_num_threads();
  auto scratch = torch::empty({threads, M, NP * PANEL});
  std::vector<std::vector<RowBest>> best(threads, std::vector<RowBest>(M));
  const ArgmaxOut out{scratch.data_ptr<float>(), best.data(), M, n, scaled ? scale.data_ptr<float>() : nullptr,
                      biased ? bias.data_ptr<float>() : nullptr};
  if (pairs) {
    auto xb = x.to(at::kBFloat16);
    linear_dp_impl(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), M, K,
                   reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), Npad, out);
  } else if (packed.scalar_type() == at::kFloat) {
    linear_impl<float>(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), Npad, out);
  } else if (packed.scalar_type() == at::kBFloat16) {
    linear_impl<at::BFloat16>(x.data_ptr<float>(), M, K, packed.data_ptr<at::BFloat16>(), Npad, out);
  } else if (packed.scalar_type() == at::kChar) {
    linear_impl<int8_t>(x.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), Npad, out);
  } else {
    TORCH_CHECK(false, "packed weight dtype must be float32, bfloat16 or int8");
  }
  auto r = result.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {   // each thread's best over its channel groups, then across threads
    RowBest b;
    for (int t = 0; t < threads; ++t)
      if (best[t][m].i >= 0 && b.beaten_by(best[t][m].v, best[t][m].i)) b = best[t][m];
    r[m] = b.i;
  }
  return result;
}

// The fp32 kernel's logits of columns `cols` (ascending) for one row x, into vals: a panel's 16
// columns in one chain of vector fmas over k from 0, as the kernel's lanes sum them (each lane
// acc = fma(x[k], W[c][k], acc)), four panels at a time so that the chains overlap.
static void exact_logits(const float* x, const float* w, int64_t K, const std::vector<int64_t>& cols,
                         std::vector<int64_t>& panels, std::vector<float>& vals) {
  panels.clear();
  for (int64_t c : cols)
    if (panels.empty() || panels.back() != c / PANEL) panels.push_back(c / PANEL);
  std::vector<float> lanes(panels.size() * PANEL);
  for (size_t i = 0; i < panels.size(); i += 4) {
    const size_t np = std::min<size_t>(4, panels.size() - i);
    const float* pw[4];
    for (size_t j = 0; j < 4; ++j) pw[j] = w + panels[i + (j < np ? j : 0)] * K * PANEL;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; ++k) {
      const __m512 xv = _mm512_set1_ps(x[k]);
      for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(pw[j] + k * PANEL), acc[j]);
    }
    for (size_t j = 0; j < np; ++j) _mm512_storeu_ps(lanes.data() + (i + j) * PANEL, acc[j]);
  }
  vals.resize(cols.size());
  for (size_t i = 0, p = 0; i < cols.size(); ++i) {
    while (panels[p] != cols[i] / PANEL) ++p;
    vals[i] = lanes[p * PANEL + cols[i] % PANEL];
  }
}

// Greedy's token from an fp32 lm_head, reading a bf16 copy of its weights instead of the fp32 ones
// (half the bytes, twice the multiply-adds per instruction), with the same result as
// packed_linear_argmax. The screen: every column's bf16 dot product A_c (x and W rounded to bf16,
// AVX512-BF16) differs from the fp32 kernel's logit L_c by at most
//   E_c = (2^-8 + 2^-17 + 3.2 gamma_K) ||x|| ||W[c]|| + (tiny terms for denormals and rounding),
// gamma_K = K u / (1 - K u), u = 2^-24: each bf16 rounding moves a product by at most 2^-9 of
// it, an fp32 sum of K products (the kernel's fma chain, or the dot products' adds) by at most
// gamma_K of the sum of |products|, which is at most ||x|| ||W[c]|| (Cauchy-Schwarz). The argmax
// c* has L_c* >= max_c (A_c - E_c), so it is among the columns with A_c + E_c >= that bound; those
// (a handful: the runners-up within a few E of the best) get their exact logits, summed as the
// fp32 kernel sums them (exact_logits), and the first maximum wins. A batch with
// non-finite or huge values falls back to packed_linear_argmax, and so do rows with too many
// candidates (those rows only).
// x: (M, K) fp32; packed: (Npad/16, K, 16) fp32; screen: (Npad/16, K/2, 32) bf16 k-pairs of the
// same weights; col_norm: (Npad,) fp32 >= each column's norm (0 on padding), col_norm_max >= all
// of them (finite weights: the layer builds no screen otherwise). counts, if not
// empty: (M,) int64, the candidates each row checked exactly (-1: it fell back).
torch::Tensor packed_linear_argmax_screened(torch::Tensor x, torch::Tensor packed, torch::Tensor screen,
                                            torch::Tensor col_norm, double col_norm_max, int64_t n,
                                            torch::Tensor counts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (M, K) fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.scalar_type() == at::kFloat &&
              packed.is_contiguous(), "bad packed fp32 weight");
  const int64_t M = x.size(0), K = x.size(1), Npad = packed.size(0) * PANEL;
  TORCH_CHECK(packed.size(1) == K && K % 2 == 0 && Npad % (PANEL * NP) == 0, "packed weight does not match x");
  TORCH_CHECK(screen.dim() == 3 && screen.scalar_type() == at::kBFloat16 && screen.size(0) == packed.size(0) &&
              screen.size(1) * 2 == K && screen.size(2) == 2 * PANEL && screen.is_contiguous(), "bad screen weight");
  TORCH_CHECK(col_norm.scalar_type() == at::kFloat && col_norm.numel() == Npad && col_norm.is_contiguous(),
              "bad col_norm");
  TORCH_CHECK(n > 0 && n <= Npad, "n must be in [1, ", Npad, "]");
  const bool counted = counts.defined() && counts.numel() > 0;
  TORCH_CHECK(!counted || (counts.scalar_type() == at::kLong && counts.numel() == M), "bad counts");
  auto fallback = [&]() {
    if (counted) counts.fill_(-1);
    return packed_linear_argmax(x, packed, torch::Tensor(), torch::Tensor(), n);
  };
  if (M == 0) return torch::empty({0}, torch::kLong);
  const float* xp = x.data_ptr<float>();
  const float* cn = col_norm.data_ptr<float>();
  if (!(col_norm_max < 1e30)) return fallback();
  const double cn_max = col_norm_max;
  // 3.2 gamma, not 2: the dot products' adds may round other than to nearest (2u each, not u)
  const double u = std::ldexp(1.0, -24), gamma = K * u / (1 - K * u);
  const double rel = (std::ldexp(1.0, -8) + std::ldexp(1.0, -17) + 3.2 * gamma) * 1.0001;
  std::vector<float> radius(M), slack(M);
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t k = 0; k < K; ++k) ss += double(xp[m * K + k]) * xp[m * K + k];
    const double xn = std::sqrt(ss) * (1 + 1e-6);
    if (!(xn < 1e30 && xn * cn_max < 1e30)) return fallback();   // NaN, inf, or sums that may overflow
    radius[m] = float(rel * xn * (1 + 1e-6));
    // denormals: the dot products flush them (inputs and sums), bf16 keeps them with an absolute error
    slack[m] = float(std::ldexp(double(K), -120) * (xn + cn_max + 1)) + 1e-37f;
  }
  const int threads = at::get_num_threads();
  auto scratch = torch::empty({threads, M, NP * PANEL});
  std::vector<std::vector<float>> lo_max(threads, std::vector<float>(M, -INFINITY));
  std::vector<std::vector<std::vector<ScreenOut::Candidate>>> kept(threads, std::vector<std::vector<ScreenOut::Candidate>>(M));
  const ScreenOut out{scratch.data_ptr<float>(), lo_max.data(), kept.data(), M, n, cn, radius.data(), slack.data()};
  auto xb = x.to(at::kBFloat16);
  linear_dp_impl(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), M, K,
                 reinterpret_cast<const uint16_t*>(screen.data_ptr<at::BFloat16>()), Npad, out);
  // A row with more candidates (near-equal logits: an untrained model's flat ones) gets the full fp32
  // argmax instead, all such rows in one call: checking them one panel at a time would cost more.
  constexpr size_t kMaxCandidates = 512;
  auto result = torch::empty({M}, torch::kLong);
  auto r = result.data_ptr<int64_t>();
  const float* w = packed.data_ptr<float>();
  std::vector<int64_t> cols, full_rows, panels;
  std::vector<float> vals;
  for (int64_t m = 0; m < M; ++m) {
    float lo = -INFINITY;
    for (int t = 0; t < threads; ++t) lo = std::max(lo, lo_max[t][m]);
    if (!std::isfinite(lo)) return fallback();
    cols.clear();
    for (int t = 0; t < threads; ++t)
      for (const auto& c : kept[t][m])
        if (c.hi >= lo) cols.push_back(c.col);
    if (cols.size() > kMaxCandidates) {
      full_rows.push_back(m);
      if (counted) counts.data_ptr<int64_t>()[m] = -1;
      continue;
    }
    std::sort(cols.begin(), cols.end());
    exact_logits(xp + m * K, w, K, cols, panels, vals);
    RowBest b;
    for (size_t i = 0; i < cols.size(); ++i) {
      if (!std::isfinite(vals[i])) return fallback();
      if (b.beaten_by(vals[i], cols[i])) b = RowBest{vals[i], cols[i]};
    }
    TORCH_CHECK(b.i >= 0, "screened argmax kept no column");   // the column of the largest lower bound always stays
    r[m] = b.i;
    if (counted) counts.data_ptr<int64_t>()[m] = int64_t(cols.size());
  }
  if (!full_rows.empty()) {
    auto idx = torch::tensor(full_rows, torch::kLong);
    auto full = packed_linear_argmax(x.index_select(0, idx), packed, torch::Tensor(), torch::Tensor(), n);
    for (size_t i = 0; i < full_rows.size(); ++i) r[full_rows[i]] = full.data_ptr<int64_t>()[i];
  }
  return result;
}
