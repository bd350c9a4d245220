// A mixture-of-experts layer's experts in one call (layers/moe.py's FusedMoE is the reference):
// each token's k (expert, weight) pairs, SwiGLU experts stored stacked, gate_up (E, 2I, H) and
// down (E, H, I), fp32 or bf16.
// Why: a step's tokens share experts. The (token, slot) pairs are grouped by expert (a counting
// sort, stable: ascending tokens within an expert), and each weight row of a selected expert is
// loaded once per step and multiplied with every token routed to that expert (four tokens per
// load, in registers); experts no token chose are never read. The work is split over threads by
// (expert, block of output channels), so a decode step's few experts still spread over all cores.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include "vec.h"

using pdserve::fVec;
using pdserve::kVec;

namespace {

constexpr int64_t kBlock = 16;   // output channels per task
constexpr int kTokens = 4;       // tokens per weight-row load

// out[j] = dot(w, x[j]) for n (<= kTokens) rows x[j] of length len: w's vectors loaded once for all
template <typename W>
inline void dots(const W* w, const float* const* x, int n, int64_t len, float* out) {
  fVec acc[kTokens];
  for (int j = 0; j < kTokens; ++j) acc[j] = fVec(0.f);
  int64_t i = 0;
  for (; i + kVec <= len; i += kVec) {
    const fVec wv = pdserve::load<W>(w + i);
    for (int j = 0; j < n; ++j) acc[j] = at::vec::fmadd(wv, fVec::loadu(x[j] + i), acc[j]);
  }
  for (int j = 0; j < n; ++j) {
    float s = pdserve::reduce_add(acc[j]);
    for (int64_t r = i; r < len; ++r) s += static_cast<float>(w[r]) * x[j][r];
    out[j] = s;
  }
}

// (expert, first channel) tasks over the selected experts' `channels` output channels
std::vector<std::pair<int64_t, int64_t>> tasks_of(const std::vector<int64_t>& counts, int64_t channels) {
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e)
    if (counts[e])
      for (int64_t c = 0; c < channels; c += kBlock) tasks.emplace_back(e, c);
  return tasks;
}

template <typename W>
void experts(const float* x, const float* weights, const int64_t* ids, const W* w13, const W* w2, float* out,
             int64_t T, int64_t k, int64_t E, int64_t H, int64_t I) {
  const int64_t P = T * k;
  // the pairs grouped by expert: rows [start[e], start[e] + counts[e]) of the sorted order
  std::vector<int64_t> counts(E, 0), start(E + 1, 0), pair(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "expert id ", ids[p], " out of range 0..", E - 1);
    ++counts[ids[p]];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < P; ++p) pair[next[ids[p]]++] = p;
  }
  std::vector<float> act(P * I), ys(P * H);   // by sorted row: silu(gate) * up, then the expert's output

  // gate and up rows i of expert e, each loaded once for all its tokens: act = silu(gate x) * up x
  const auto up_tasks = tasks_of(counts, I);
  at::parallel_for(0, static_cast<int64_t>(up_tasks.size()), 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const auto [e, c0] = up_tasks[t];
      const W* we = w13 + e * 2 * I * H;
      for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kTokens) {
        const int n = static_cast<int>(std::min<int64_t>(kTokens, start[e + 1] - r0));
        const float* xs[kTokens];
        for (int j = 0; j < n; ++j) xs[j] = x + (pair[r0 + j] / k) * H;
        for (int64_t c = c0; c < std::min(c0 + kBlock, I); ++c) {
          float g[kTokens], u[kTokens];
          dots(we + c * H, xs, n, H, g);
          dots(we + (I + c) * H, xs, n, H, u);
          for (int j = 0; j < n; ++j) act[(r0 + j) * I + c] = g[j] / (1.f + std::exp(-g[j])) * u[j];
        }
      }
    }
  });
  // down rows h of expert e, each loaded once for all its tokens
  const auto down_tasks = tasks_of(counts, H);
  at::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const auto [e, c0] = down_tasks[t];
      const W* we = w2 + e * H * I;
      for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kTokens) {
        const int n = static_cast<int>(std::min<int64_t>(kTokens, start[e + 1] - r0));
        const float* as[kTokens];
        for (int j = 0; j < n; ++j) as[j] = act.data() + (r0 + j) * I;
        for (int64_t c = c0; c < std::min(c0 + kBlock, H); ++c) {
          float y[kTokens];
          dots(we + c * I, as, n, I, y);
          for (int j = 0; j < n; ++j) ys[(r0 + j) * H + c] = y[j];
        }
      }
    }
  });
  // each token: the sum of its experts' weighted outputs, in ascending expert order (the reference's)
  std::vector<int64_t> row_of(P);
  for (int64_t r = 0; r < P; ++r) row_of[pair[r]] = r;
  at::parallel_for(0, T, 1, [&](int64_t a, int64_t b) {
    std::vector<int64_t> slots(k);
    for (int64_t t = a; t < b; ++t) {
      for (int64_t j = 0; j < k; ++j) slots[j] = t * k + j;
      std::sort(slots.begin(), slots.end(), [&](int64_t p, int64_t q) { return row_of[p] < row_of[q]; });
      float* o = out + t * H;
      std::fill(o, o + H, 0.f);
      for (int64_t p : slots) {
        const float* y = ys.data() + row_of[p] * H;
        const fVec w(weights[p]);
        int64_t h = 0;
        for (; h + kVec <= H; h += kVec) {
          fVec prod = fVec::loadu(y + h) * w;
          pdserve::fence(prod);   // rounded before the add, as the reference's product is
          (fVec::loadu(o + h) + prod).store(o + h);
        }
        for (; h < H; ++h) o[h] += y[h] * weights[p];
      }
    }
  });
}

}  // namespace

// x (T, H) fp32; weights (T, k) fp32 and ids (T, k) int64: each token's experts; w13 (E, 2I, H) gate
// rows then up rows, w2 (E, H, I), both fp32 or both bf16, contiguous. Returns (T, H) fp32: for each
// token, the sum over its k experts of weight * down(silu(gate x) * up x).
torch::Tensor fused_moe(torch::Tensor x, torch::Tensor weights, torch::Tensor ids, torch::Tensor w13, torch::Tensor w2) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (T, H) fp32 contiguous");
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.size(0) == x.size(0),
              "ids must be (T, k) int64 contiguous");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.sizes() == ids.sizes(),
              "weights must be fp32 contiguous, shaped as ids");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
              w13.scalar_type() == w2.scalar_type() &&
              (w13.scalar_type() == at::kFloat || w13.scalar_type() == at::kBFloat16),
              "w13 and w2 must be contiguous 3-D tensors, both fp32 or both bf16");
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = w13.size(0), I = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H,
              "w13 must be (E, 2I, H) and w2 (E, H, I) for x's H");
  auto out = torch::empty({T, H}, x.options());
  if (w13.scalar_type() == at::kFloat)
    experts<float>(x.data_ptr<float>(), weights.data_ptr<float>(), ids.data_ptr<int64_t>(), w13.data_ptr<float>(),
                   w2.data_ptr<float>(), out.data_ptr<float>(), T, k, E, H, I);
  else
    experts<at::BFloat16>(x.data_ptr<float>(), weights.data_ptr<float>(), ids.data_ptr<int64_t>(),
                          w13.data_ptr<at::BFloat16>(), w2.data_ptr<at::BFloat16>(), out.data_ptr<float>(), T, k, E, H,
                          I);
  return out;
}
