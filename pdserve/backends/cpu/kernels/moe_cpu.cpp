// A mixture-of-experts layer's experts in one call (layers/moe.py's FusedMoE is the reference):
// each token's k (expert, weight) pairs, SwiGLU experts stored stacked, gate_up (E, 2I, H) and
// down (E, H, I), fp32, bf16 or MXFP4 (gpt-oss: uint8 blocks of 32 FP4 e2m1 values with one e8m0
// scale each, decoded a row at a time through a 16-entry table, in the row's one read); optional
// biases (E, 2I), (E, H) and gpt-oss's clamped SwiGLU.
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
#include "ops.h"
#include "vec.h"

using pdserve::fVec;
using pdserve::kVec;

namespace {

constexpr int64_t kBlock = 16;   // output channels per task
constexpr int kTokens = 4;       // tokens per weight-row load

// The weight rows of a stack of experts, (E, rows, len): stored as they are (fp32 or bf16) ...
template <typename W>
struct DenseRows {
  using Elem = W;
  const W* w;
  int64_t rows, len;
  const W* row(int64_t e, int64_t r, float*) const { return w + (e * rows + r) * len; }
};

// ... or MXFP4: blocks (E, rows, len / 32, 16) of two FP4 values a byte (low nibble first),
// scales (E, rows, len / 32) the e8m0 exponents (2^(s - 127)); a row is decoded into buf
constexpr float kFp4[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
struct Mxfp4Rows {
  using Elem = float;
  const uint8_t* blocks;
  const uint8_t* scales;
  int64_t rows, len;
  const float* row(int64_t e, int64_t r, float* buf) const {
    const int64_t nb = len / 32, base = (e * rows + r) * nb;
    for (int64_t b = 0; b < nb; ++b) {
      const float scale = std::ldexp(1.f, static_cast<int>(scales[base + b]) - 127);
      const uint8_t* q = blocks + (base + b) * 16;
      float* o = buf + b * 32;
      for (int i = 0; i < 16; ++i) {
        o[2 * i] = kFp4[q[i] & 15] * scale;
        o[2 * i + 1] = kFp4[q[i] >> 4] * scale;
      }
    }
    return buf;
  }
};

// The experts' SwiGLU: silu(g) * u, or gpt-oss's (alpha, limit > 0): g clamped above at limit, u to
// [-limit, limit], then (u + 1) * g * sigmoid(alpha * g)
inline float swiglu(float g, float u, float alpha, float limit) {
  if (limit <= 0.f) return g / (1.f + std::exp(-g)) * u;
  g = std::min(g, limit);
  u = std::clamp(u, -limit, limit);
  return (u + 1.f) * (g * (1.f / (1.f + std::exp(-(g * alpha)))));
}

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

// b13 (E, 2I), b2 (E, H): the biases, nullptr: none
template <typename R>
void experts(const float* x, const float* weights, const int64_t* ids, const R& w13, const R& w2, const float* b13,
             const float* b2, float alpha, float limit, float* out, int64_t T, int64_t k, int64_t E, int64_t H,
             int64_t I) {
  using W = typename R::Elem;
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
    std::vector<float> gbuf(H), ubuf(H);   // an MXFP4 row, decoded
    for (int64_t t = a; t < b; ++t) {
      const auto [e, c0] = up_tasks[t];
      for (int64_t c = c0; c < std::min(c0 + kBlock, I); ++c) {
        const W* wg = w13.row(e, c, gbuf.data());
        const W* wu = w13.row(e, I + c, ubuf.data());
        const float bg = b13 ? b13[e * 2 * I + c] : 0.f, bu = b13 ? b13[e * 2 * I + I + c] : 0.f;
        for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kTokens) {
          const int n = static_cast<int>(std::min<int64_t>(kTokens, start[e + 1] - r0));
          const float* xs[kTokens];
          for (int j = 0; j < n; ++j) xs[j] = x + (pair[r0 + j] / k) * H;
          float g[kTokens], u[kTokens];
          dots(wg, xs, n, H, g);
          dots(wu, xs, n, H, u);
          for (int j = 0; j < n; ++j) act[(r0 + j) * I + c] = swiglu(g[j] + bg, u[j] + bu, alpha, limit);
        }
      }
    }
  });
  // down rows h of expert e, each loaded once for all its tokens
  const auto down_tasks = tasks_of(counts, H);
  at::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t a, int64_t b) {
    std::vector<float> buf(I);
    for (int64_t t = a; t < b; ++t) {
      const auto [e, c0] = down_tasks[t];
      for (int64_t c = c0; c < std::min(c0 + kBlock, H); ++c) {
        const W* wd = w2.row(e, c, buf.data());
        const float bd = b2 ? b2[e * H + c] : 0.f;
        for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kTokens) {
          const int n = static_cast<int>(std::min<int64_t>(kTokens, start[e + 1] - r0));
          const float* as[kTokens];
          for (int j = 0; j < n; ++j) as[j] = act.data() + (r0 + j) * I;
          float y[kTokens];
          dots(wd, as, n, I, y);
          for (int j = 0; j < n; ++j) ys[(r0 + j) * H + c] = b2 ? y[j] + bd : y[j];
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

// An optional (E, n) fp32 bias of the experts, or nullptr.
const float* bias_of(const std::optional<torch::Tensor>& b, int64_t E, int64_t n, const char* name) {
  if (!b.has_value() || !b->defined()) return nullptr;
  TORCH_CHECK(b->dim() == 2 && b->size(0) == E && b->size(1) == n && b->scalar_type() == at::kFloat &&
              b->is_contiguous(), name, " must be (E, ", n, ") fp32 contiguous");
  return b->data_ptr<float>();
}

// x (T, H) fp32; weights (T, k) fp32 and ids (T, k) int64: each token's experts; w13 (E, 2I, H) gate
// rows then up rows, w2 (E, H, I), both fp32 or both bf16, contiguous; or, with their scales s13
// (E, 2I, H / 32) and s2 (E, H, I / 32), both MXFP4 blocks: uint8 (E, 2I, H / 32, 16) and
// (E, H, I / 32, 16). b13 (E, 2I), b2 (E, H): fp32 biases, none: none. swiglu_limit > 0: gpt-oss's
// clamped SwiGLU with swiglu_alpha; 0: silu(gate) * up. Returns (T, H) fp32: for each token, the sum
// over its k experts of weight * (down(act(gate x + b, up x + b)) + b).
torch::Tensor fused_moe(torch::Tensor x, torch::Tensor weights, torch::Tensor ids, torch::Tensor w13, torch::Tensor w2,
                        std::optional<torch::Tensor> b13, std::optional<torch::Tensor> b2, double swiglu_alpha,
                        double swiglu_limit, std::optional<torch::Tensor> s13, std::optional<torch::Tensor> s2) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (T, H) fp32 contiguous");
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.size(0) == x.size(0),
              "ids must be (T, k) int64 contiguous");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.sizes() == ids.sizes(),
              "weights must be fp32 contiguous, shaped as ids");
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = w13.size(0);
  auto out = torch::empty({T, H}, x.options());
  const float alpha = static_cast<float>(swiglu_alpha), limit = static_cast<float>(swiglu_limit);
  const bool mxfp4 = s13.has_value() && s13->defined();
  if (mxfp4) {
    TORCH_CHECK(s2.has_value() && s2->defined(), "MXFP4 experts need both scales, s13 and s2");
    TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.size(3) == 16 && w2.size(3) == 16 &&
                w13.scalar_type() == at::kByte && w2.scalar_type() == at::kByte && w13.is_contiguous() &&
                w2.is_contiguous(), "MXFP4 blocks must be contiguous uint8 (E, rows, len / 32, 16)");
    const int64_t I = w2.size(2) * 32;
    TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) * 32 == H && w2.size(0) == E && w2.size(1) == H,
                "w13 must be (E, 2I, H / 32, 16) and w2 (E, H, I / 32, 16) for x's H");
    TORCH_CHECK(s13->sizes() == w13.sizes().slice(0, 3) && s2->sizes() == w2.sizes().slice(0, 3) &&
                s13->scalar_type() == at::kByte && s2->scalar_type() == at::kByte && s13->is_contiguous() &&
                s2->is_contiguous(), "MXFP4 scales must be contiguous uint8, one per block");
    const Mxfp4Rows r13{w13.data_ptr<uint8_t>(), s13->data_ptr<uint8_t>(), 2 * I, H};
    const Mxfp4Rows r2{w2.data_ptr<uint8_t>(), s2->data_ptr<uint8_t>(), H, I};
    experts(x.data_ptr<float>(), weights.data_ptr<float>(), ids.data_ptr<int64_t>(), r13, r2,
            bias_of(b13, E, 2 * I, "b13"), bias_of(b2, E, H, "b2"), alpha, limit, out.data_ptr<float>(), T, k, E, H, I);
    return out;
  }
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
              w13.scalar_type() == w2.scalar_type() &&
              (w13.scalar_type() == at::kFloat || w13.scalar_type() == at::kBFloat16),
              "w13 and w2 must be contiguous 3-D tensors, both fp32 or both bf16");
  const int64_t I = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H,
              "w13 must be (E, 2I, H) and w2 (E, H, I) for x's H");
  const float* bias13 = bias_of(b13, E, 2 * I, "b13");
  const float* bias2 = bias_of(b2, E, H, "b2");
  if (w13.scalar_type() == at::kFloat)
    experts(x.data_ptr<float>(), weights.data_ptr<float>(), ids.data_ptr<int64_t>(),
            DenseRows<float>{w13.data_ptr<float>(), 2 * I, H}, DenseRows<float>{w2.data_ptr<float>(), H, I}, bias13,
            bias2, alpha, limit, out.data_ptr<float>(), T, k, E, H, I);
  else
    experts(x.data_ptr<float>(), weights.data_ptr<float>(), ids.data_ptr<int64_t>(),
            DenseRows<at::BFloat16>{w13.data_ptr<at::BFloat16>(), 2 * I, H},
            DenseRows<at::BFloat16>{w2.data_ptr<at::BFloat16>(), H, I}, bias13, bias2, alpha, limit,
            out.data_ptr<float>(), T, k, E, H, I);
  return out;
}
