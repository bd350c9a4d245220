// Greedy sampling's token straight from the packed lm_head's tiles (packed_tiles.h), without
// writing the (rows, vocab) logits: the fp32 fused argmax, and the screened one that reads a bf16
// copy of an fp32 lm_head and checks its few candidates exactly.
#include "ops.h"
#include "packed_tiles.h"
#include "amx_tiles.h"
#include <algorithm>
#include <cmath>
#include <vector>

using namespace pdserve::tiles;
using pdserve::fVec;
using pdserve::kVec;

namespace {

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

// What both argmax policies share: each thread's tiles go to its own scratch block (M x NP x 16,
// the group's columns), read back in done() once their last k-block is in; of a group's columns
// the first `valid` are real (the rest is padding, never a result).
struct ThreadScratch {
  float* scratch;                    // threads x M x 64
  int64_t M, n;                      // rows; valid columns
  float* tile(int64_t m, int64_t) const { return row(at::get_thread_num(), m); }
  int64_t ld() const { return NP * PANEL; }
  float* row(int t, int64_t m) const { return scratch + (t * M + m) * NP * PANEL; }
  int64_t valid(int64_t c0) const { return std::min<int64_t>(NP * PANEL, n - c0); }
  // how many of vector j's lanes hold real columns
  static int in(int64_t valid, int j) { return static_cast<int>(std::clamp<int64_t>(valid - j * kVec, 0, kVec)); }
};

// whether any lane of a comparison's result is set
inline bool any(const fVec& mask) { return mask.zero_mask() != (1 << kVec) - 1; }

struct ArgmaxOut : ThreadScratch {
  std::vector<RowBest>* best;        // threads x M
  const float *scale, *bias;         // per column (scale: Npad, bias: n), or null
  void done(int64_t m0, int64_t mt, int64_t g) const {
    const int t = at::get_thread_num();
    const int64_t c0 = g * NP * PANEL, valid = this->valid(c0);
    for (int64_t m = m0; m < m0 + mt; ++m) {
      const float* row = this->row(t, m);
      RowBest& b = best[t][m];
      constexpr int NV = NP * VP;   // vectors of the group's columns
      fVec v[NV], mx(-INFINITY);
      bool nan = false;
      for (int j = 0; j < NV; ++j) {
        const int in = ThreadScratch::in(valid, j);   // padding never wins
        v[j] = fVec::loadu(row + j * kVec, in);
        if (scale) {
          v[j] = v[j] * fVec::loadu(scale + c0 + j * kVec, in);
          pdserve::fence(v[j]);   // rounded here, as y.mul_(scale) does: never fused with the bias add
        }
        if (bias) v[j] = v[j] + fVec::loadu(bias + c0 + j * kVec, in);
        v[j] = fVec::set(fVec(-INFINITY), v[j], in);
        nan = nan || any(v[j].isnan());
        mx = pdserve::maxps(mx, v[j]);
      }
      // columns ascend within a thread: a later column wins only if strictly greater (or the first NaN)
      if (!nan && b.i >= 0 && !any(mx > fVec(b.v))) continue;
      for (int j = 0; j < NV; ++j) {
        alignas(64) float vals[kVec];
        v[j].store(vals);
        for (int l = 0; l < kVec && j * kVec + l < valid; ++l)
          if (b.beaten_by(vals[l], c0 + j * kVec + l)) b = RowBest{vals[l], c0 + j * kVec + l};
      }
    }
  }
};

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// The screen of a screened argmax (packed_linear_argmax_screened): each column's bf16 dot product
// A with an error radius E, such that the exact fp32 logit lies in [A - E, A + E]. Per thread and
// row it keeps the largest lower bound seen so far and every column whose upper bound reaches it
// then: a column whose upper bound reaches the final largest lower bound was kept when it came.
struct ScreenOut : ThreadScratch {
  struct Candidate {
    int64_t col;
    float hi;
  };
  std::vector<float>* lo_max;                      // threads x M
  std::vector<std::vector<Candidate>>* kept;       // threads x M
  const float* col_norm;                           // ||W[c]||_2, rounded up (Npad)
  const float *radius, *slack;                     // per row: E = radius * col_norm + slack + |A| 2^-21
  void done(int64_t m0, int64_t mt, int64_t g) const {
    const int t = at::get_thread_num();
    const int64_t c0 = g * NP * PANEL, valid = this->valid(c0);
    const __m512 rel = _mm512_set1_ps(0x1p-21f), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t m = m0; m < m0 + mt; ++m) {
      const float* row = this->row(t, m);
      const __m512 r = _mm512_set1_ps(radius[m]), sl = _mm512_set1_ps(slack[m]);
      __m512 hi[NP], mx = ninf;
      __mmask16 in[NP];
      for (int j = 0; j < NP; ++j) {
        in[j] = valid > j * PANEL ? (valid - j * PANEL >= 16 ? 0xFFFF : (1u << (valid - j * PANEL)) - 1) : 0;   // padding is never kept
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
#endif

}  // namespace

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
  const ArgmaxOut out{{scratch.data_ptr<float>(), M, n}, best.data(), scaled ? scale.data_ptr<float>() : nullptr,
                      biased ? bias.data_ptr<float>() : nullptr};
  if (pairs) {
    TORCH_CHECK(kBf16Dot, "k-pair panels need a build with AVX512-BF16 (this one is ", pdserve::kIsa, ")");
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    linear_pairs(x.to(at::kBFloat16), reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), Npad, out);
#endif
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

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// The fp32 kernel's logits of columns `cols` (ascending) for one row x, into vals: a panel's 16
// columns in one chain of vector fmas over k from 0, as the kernel's lanes sum them (each lane
// acc = fma(x[k], W[c][k], acc)), four panels at a time so that the chains overlap. panels and
// lanes are scratch the caller keeps across rows.
static void exact_logits(const float* x, const float* w, int64_t K, const std::vector<int64_t>& cols,
                         std::vector<int64_t>& panels, std::vector<float>& lanes, std::vector<float>& vals) {
  panels.clear();
  for (int64_t c : cols)
    if (panels.empty() || panels.back() != c / PANEL) panels.push_back(c / PANEL);
  lanes.resize(panels.size() * PANEL);
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
  // 3.2 gamma, not 2: the dot products' adds (AVX512-BF16's or AMX's: amx_tiles.h) may round other than
  // to nearest (2u each, not u); both flush denormals (the slack below)
  const double u = std::ldexp(1.0, -24), gamma = K * u / (1 - K * u);
  const double rel = (std::ldexp(1.0, -8) + std::ldexp(1.0, -17) + 3.2 * gamma) * 1.0001;
  std::vector<float> radius(M), slack(M);
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t k = 0; k < K; ++k) ss += double(xp[m * K + k]) * xp[m * K + k];
    const double xn = std::sqrt(ss) * (1 + 1e-6);
    if (!(xn < 1e30 && xn * col_norm_max < 1e30)) return fallback();   // NaN, inf, or sums that may overflow
    radius[m] = float(rel * xn * (1 + 1e-6));
    // denormals: the dot products flush them (inputs and sums), bf16 keeps them with an absolute error
    slack[m] = float(std::ldexp(double(K), -120) * (xn + col_norm_max + 1)) + 1e-37f;
  }
  const int threads = at::get_num_threads();
  auto scratch = torch::empty({threads, M, NP * PANEL});
  std::vector<std::vector<float>> lo_max(threads, std::vector<float>(M, -INFINITY));
  std::vector<std::vector<std::vector<ScreenOut::Candidate>>> kept(threads, std::vector<std::vector<ScreenOut::Candidate>>(M));
  const ScreenOut out{{scratch.data_ptr<float>(), M, n}, lo_max.data(), kept.data(), cn, radius.data(), slack.data()};
  linear_pairs(x.to(at::kBFloat16), reinterpret_cast<const uint16_t*>(screen.data_ptr<at::BFloat16>()), Npad, out);
  // A row with more candidates (near-equal logits: an untrained model's flat ones) gets the full fp32
  // argmax instead, all such rows in one call: checking them one panel at a time would cost more.
  constexpr size_t kMaxCandidates = 512;
  auto result = torch::empty({M}, torch::kLong);
  auto r = result.data_ptr<int64_t>();
  const float* w = packed.data_ptr<float>();
  std::vector<int64_t> cols, full_rows, panels;
  std::vector<float> lanes, vals;
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
    exact_logits(xp + m * K, w, K, cols, panels, lanes, vals);
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
#else
torch::Tensor packed_linear_argmax_screened(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double, int64_t,
                                            torch::Tensor) {
  TORCH_CHECK(false, "the screened argmax needs a build with AVX512-BF16 (this one is ", pdserve::kIsa, ")");
}
#endif
