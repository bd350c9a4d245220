// A mixture-of-experts layer's experts in one call (layers/moe.py's FusedMoE is the reference):
// each token's k (expert, weight) pairs, SwiGLU experts stored stacked, gate_up (E, 2I, H) and
// down (E, H, I): fp32, bf16, int8 codes with fp32 scales per channel or per group (--quantization
// int8), or MXFP4 (gpt-oss: uint8 blocks of 32 FP4 e2m1 values with one e8m0 scale each, decoded
// in vector registers a row at a time, in the row's one read); optional biases (E, 2I), (E, H) and
// gpt-oss's clamped SwiGLU.
// Why: a step's tokens share experts. The (token, slot) pairs are grouped by expert (a counting
// sort, stable: ascending tokens within an expert), and each weight row of a selected expert is
// loaded once per step and multiplied with every token routed to that expert (four tokens per
// load, in registers); experts no token chose are never read. The work is split over threads by
// (expert, block of output channels), so a decode step's few experts still spread over all cores.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>
#include "ops.h"
#include "vec.h"

using pdserve::fVec;
using pdserve::iVec;
using pdserve::kVec;

namespace {

constexpr int64_t kBlock = 16;   // output channels per task
constexpr int kTokens = 4;       // tokens per weight-row load

// out[j] = dot(w, x[j]) for n (<= kTokens) rows x[j] of length len: w's vectors loaded once for all.
// Two accumulators a token (even and odd vectors): with one or two tokens, a single chain of
// dependent FMAs would bound a decode step's row to one vector per FMA latency, below the read rate.
template <typename W>
inline void dots(const W* w, const float* const* x, int n, int64_t len, float* out) {
  fVec acc[kTokens], acc2[kTokens];
  for (int j = 0; j < kTokens; ++j) acc[j] = acc2[j] = fVec(0.f);
  int64_t i = 0;
  for (; i + 2 * kVec <= len; i += 2 * kVec) {
    const fVec wv = pdserve::load<W>(w + i), wv2 = pdserve::load<W>(w + i + kVec);
    for (int j = 0; j < n; ++j) {
      acc[j] = at::vec::fmadd(wv, fVec::loadu(x[j] + i), acc[j]);
      acc2[j] = at::vec::fmadd(wv2, fVec::loadu(x[j] + i + kVec), acc2[j]);
    }
  }
  for (; i + kVec <= len; i += kVec) {
    const fVec wv = pdserve::load<W>(w + i);
    for (int j = 0; j < n; ++j) acc[j] = at::vec::fmadd(wv, fVec::loadu(x[j] + i), acc[j]);
  }
  for (int j = 0; j < n; ++j) {
    float s = pdserve::reduce_add(acc[j] + acc2[j]);
    for (int64_t r = i; r < len; ++r) s += static_cast<float>(w[r]) * x[j][r];
    out[j] = s;
  }
}

// The weight rows of a stack of experts, (E, rows, len): row(e, r, buf) is row r of expert e, read
// once and then multiplied by up to kTokens token rows at a time (Row::dots) for all the expert's
// tokens; buf has room for the row in fp32 where it is decoded first. Stored as they are (fp32, bf16) ...
template <typename W>
struct DenseRows {
  struct Row {
    const W* w;
    int64_t len;
    void dots(const float* const* x, int n, float* out) const { ::dots(w, x, n, len, out); }
  };
  const W* w;
  int64_t rows, len;
  Row row(int64_t e, int64_t r, float*) const { return {w + (e * rows + r) * len, len}; }
};

// A row decoded into fp32 (int8 groups, MXFP4)
struct DecodedRow {
  const float* w;
  int64_t len;
  void dots(const float* const* x, int n, float* out) const { ::dots(w, x, n, len, out); }
};

// ... int8 codes q (E, rows, len) with fp32 scales (E, rows, groups), w = q * the scale of its group
// of len / groups inputs (layers/quantized.py's form, no offset). One group (a scale per output
// channel, --quantization int8): the codes' dots, widened in registers, times the scale; groups: the
// row dequantized into buf first, the values the torch path multiplies ...
struct Int8Rows {
  struct Row {
    const int8_t* q;
    const float* decoded;   // groups: the row in fp32; per channel: nullptr
    float scale;
    int64_t len;
    void dots(const float* const* x, int n, float* out) const {
      if (decoded) return ::dots(decoded, x, n, len, out);
      ::dots(q, x, n, len, out);
      for (int j = 0; j < n; ++j) out[j] *= scale;
    }
  };
  const int8_t* q;
  const float* scales;
  int64_t rows, len, groups;
  Row row(int64_t e, int64_t r, float* buf) const {
    const int8_t* c = q + (e * rows + r) * len;
    const float* s = scales + (e * rows + r) * groups;
    if (groups == 1) return {c, nullptr, s[0], len};
    const int64_t size = len / groups;
    for (int64_t g = 0; g < groups; ++g) {
      const fVec sv(s[g]);
      int64_t i = g * size;
      for (; i + kVec <= (g + 1) * size; i += kVec) (pdserve::load<int8_t>(c + i) * sv).store(buf + i);
      for (; i < (g + 1) * size; ++i) buf[i] = static_cast<float>(c[i]) * s[g];
    }
    return {c, buf, 1.f, len};
  }
};

// ... or MXFP4: blocks (E, rows, len / 32, 16) of two FP4 values a byte (low nibble first), scales
// (E, rows, len / 32) the e8m0 exponents (2^(s - 127)); a row is decoded into buf, kVec codes at a
// time (fp4_lookup), then multiplied as fp32
constexpr int kFp4Block = 32;
alignas(64) constexpr float kFp4[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                        -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// FP4 e2m1 codes (one per int32 lane, 0..15) -> their values times the block's scale, given table:
// kFp4's first kVec values times the scale (one product per block, the same roundings as value *
// scale). AVX-512: the 16 values, one vpermps; AVX2: the 8 magnitudes (vpermps reads an index's low
// 3 bits), the sign (bit 3) moved to bit 31. Elsewhere the portable form: sign bit 3, then e (2 bits)
// and m (1 bit); e >= 1 is 2^(e - 1) * (1 + m / 2), the fp32 with exponent 126 + e and m as the
// top mantissa bit; e == 0 is m * 0.5 (0 or 0.5); times the scale.
inline fVec fp4_lookup(const iVec& code, const fVec& table, const fVec& scale) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_permutexvar_ps(code, table);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
  return _mm256_or_ps(_mm256_permutevar8x32_ps(table, code), _mm256_castsi256_ps(sign));
#else
  const iVec m = code & iVec(7);
  const iVec normal = (m << iVec(22)) + iVec(126 << 23);
  const iVec small = iVec(126 << 23) & (m == iVec(1));
  const iVec bits = iVec::blendv(normal, small, m < iVec(2)) | ((code & iVec(8)) << iVec(28));
  return at::vec::cast<float>(bits) * scale;
#endif
}

// 2^(s - 127) for each e8m0 scale byte (255: inf, as the torch path's ldexp gives)
const float* e8m0_scales() {
  static const auto table = [] {
    std::array<float, 256> t;
    for (int s = 0; s < 256; ++s) t[s] = std::ldexp(1.f, s - 127);
    return t;
  }();
  return table.data();
}

struct Mxfp4Rows {
  using Row = DecodedRow;
  const uint8_t* blocks;
  const uint8_t* scales;
  int64_t rows, len;
  Row row(int64_t e, int64_t r, float* buf) const {
    static_assert(kFp4Block / 2 % kVec == 0, "a block's bytes are whole vectors of codes");
    const float* pow2 = e8m0_scales();
    const int64_t nb = len / kFp4Block, base = (e * rows + r) * nb;
    const fVec values = fVec::loadu(kFp4);
    for (int64_t b = 0; b < nb; ++b) {
      const fVec scale(pow2[scales[base + b]]), table = values * scale;
      const uint8_t* q = blocks + (base + b) * (kFp4Block / 2);
      float* o = buf + b * kFp4Block;
      for (int i = 0; i < kFp4Block / 2; i += kVec) {   // kVec bytes: 2 kVec values, even ones low
        const iVec codes = at::vec::convert_to_int32<uint8_t>(q + i);
        const auto [lo, hi] = at::vec::interleave2(fp4_lookup(codes & iVec(15), table, scale),
                                                   fp4_lookup(codes >> iVec(4), table, scale));
        lo.store(o + 2 * i);
        hi.store(o + 2 * i + kVec);
      }
    }
    return {buf, len};
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

  // gate and up rows c of expert e, each read once for all its tokens: act = silu(gate x) * up x,
  // kTokens tokens at a time through both rows (their x rows stay in L1 between the two)
  const auto up_tasks = tasks_of(counts, I);
  at::parallel_for(0, static_cast<int64_t>(up_tasks.size()), 1, [&](int64_t a, int64_t b) {
    std::vector<float> gbuf(H), ubuf(H);   // decoded rows
    std::vector<const float*> xs;
    for (int64_t t = a; t < b; ++t) {
      const auto [e, c0] = up_tasks[t];
      const int64_t n = counts[e];
      xs.resize(n);
      for (int64_t j = 0; j < n; ++j) xs[j] = x + (pair[start[e] + j] / k) * H;
      for (int64_t c = c0; c < std::min(c0 + kBlock, I); ++c) {
        const auto wg = w13.row(e, c, gbuf.data());
        const auto wu = w13.row(e, I + c, ubuf.data());
        const float bg = b13 ? b13[e * 2 * I + c] : 0.f, bu = b13 ? b13[e * 2 * I + I + c] : 0.f;
        for (int64_t j0 = 0; j0 < n; j0 += kTokens) {
          const int m = static_cast<int>(std::min<int64_t>(kTokens, n - j0));
          const float* xg[kTokens];
          for (int j = 0; j < m; ++j) xg[j] = xs[j0 + j];
          float g[kTokens], u[kTokens];
          wg.dots(xg, m, g);
          wu.dots(xg, m, u);
          for (int j = 0; j < m; ++j) act[(start[e] + j0 + j) * I + c] = swiglu(g[j] + bg, u[j] + bu, alpha, limit);
        }
      }
    }
  });
  // down rows c of expert e, each read once for all its tokens
  const auto down_tasks = tasks_of(counts, H);
  at::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t a, int64_t b) {
    std::vector<float> buf(I);   // a decoded row
    for (int64_t t = a; t < b; ++t) {
      const auto [e, c0] = down_tasks[t];
      for (int64_t c = c0; c < std::min(c0 + kBlock, H); ++c) {
        const auto wd = w2.row(e, c, buf.data());
        const float bd = b2 ? b2[e * H + c] : 0.f;
        for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kTokens) {
          const int m = static_cast<int>(std::min<int64_t>(kTokens, start[e + 1] - r0));
          const float* as[kTokens];
          for (int j = 0; j < m; ++j) as[j] = act.data() + (r0 + j) * I;
          float y[kTokens];
          wd.dots(as, m, y);
          for (int j = 0; j < m; ++j) ys[(r0 + j) * H + c] = b2 ? y[j] + bd : y[j];
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

// x (T, H) fp32; weights (T, k) fp32 and ids (T, k) int64: each token's experts. The experts, w13
// (E, 2I, H) gate rows then up rows and w2 (E, H, I), contiguous: both fp32 or both bf16; or both
// int8 codes with their fp32 scales s13 (E, 2I, G13) and s2 (E, H, G2), G groups of a row's inputs
// (1: per output channel); or both MXFP4 blocks, uint8 (E, 2I, H / 32, 16) and (E, H, I / 32, 16),
// with their uint8 scales s13 (E, 2I, H / 32) and s2 (E, H, I / 32). b13 (E, 2I), b2 (E, H): fp32
// biases, none: none. swiglu_limit > 0: gpt-oss's clamped SwiGLU with swiglu_alpha; 0: silu(gate) *
// up. Returns (T, H) fp32: for each token, the sum over its k experts of weight * (down(act(gate x +
// b, up x + b)) + b).
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
  const bool scaled = s13.has_value() && s13->defined();
  TORCH_CHECK(scaled == (s2.has_value() && s2->defined()), "scaled experts need both scales, s13 and s2");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous() && w13.scalar_type() == w2.scalar_type() &&
              (!scaled || (s13->is_contiguous() && s2->is_contiguous())),
              "w13 and w2 must be contiguous and of one dtype, their scales contiguous");
  const float* bias13 = nullptr;
  const float* bias2 = nullptr;
  auto run = [&](const auto& r13, const auto& r2, int64_t I) {
    bias13 = bias_of(b13, E, 2 * I, "b13");
    bias2 = bias_of(b2, E, H, "b2");
    experts(x.data_ptr<float>(), weights.data_ptr<float>(), ids.data_ptr<int64_t>(), r13, r2, bias13, bias2, alpha,
            limit, out.data_ptr<float>(), T, k, E, H, I);
    return out;
  };
  if (scaled && w13.scalar_type() == at::kByte) {   // MXFP4
    TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.size(3) == 16 && w2.size(3) == 16,
                "MXFP4 blocks must be uint8 (E, rows, len / 32, 16)");
    const int64_t I = w2.size(2) * 32;
    TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) * 32 == H && w2.size(0) == E && w2.size(1) == H,
                "w13 must be (E, 2I, H / 32, 16) and w2 (E, H, I / 32, 16) for x's H");
    TORCH_CHECK(s13->sizes() == w13.sizes().slice(0, 3) && s2->sizes() == w2.sizes().slice(0, 3) &&
                s13->scalar_type() == at::kByte && s2->scalar_type() == at::kByte,
                "MXFP4 scales must be uint8, one per block");
    return run(Mxfp4Rows{w13.data_ptr<uint8_t>(), s13->data_ptr<uint8_t>(), 2 * I, H},
               Mxfp4Rows{w2.data_ptr<uint8_t>(), s2->data_ptr<uint8_t>(), H, I}, I);
  }
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3, "w13 and w2 must be 3-D (MXFP4 blocks: 4-D)");
  const int64_t I = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H,
              "w13 must be (E, 2I, H) and w2 (E, H, I) for x's H");
  if (scaled) {
    TORCH_CHECK(w13.scalar_type() == at::kChar, "scaled experts are int8 codes or MXFP4 blocks, got ",
                w13.scalar_type());
    TORCH_CHECK(s13->scalar_type() == at::kFloat && s2->scalar_type() == at::kFloat && s13->dim() == 3 &&
                s2->dim() == 3 && s13->sizes().slice(0, 2) == w13.sizes().slice(0, 2) &&
                s2->sizes().slice(0, 2) == w2.sizes().slice(0, 2) && s13->size(2) > 0 && s2->size(2) > 0 &&
                H % s13->size(2) == 0 && I % s2->size(2) == 0,
                "int8 scales must be fp32 (E, rows, groups), the groups dividing the row");
    return run(Int8Rows{w13.data_ptr<int8_t>(), s13->data_ptr<float>(), 2 * I, H, s13->size(2)},
               Int8Rows{w2.data_ptr<int8_t>(), s2->data_ptr<float>(), H, I, s2->size(2)}, I);
  }
  if (w13.scalar_type() == at::kFloat)
    return run(DenseRows<float>{w13.data_ptr<float>(), 2 * I, H}, DenseRows<float>{w2.data_ptr<float>(), H, I}, I);
  TORCH_CHECK(w13.scalar_type() == at::kBFloat16, "unscaled experts must be both fp32 or both bf16, got ",
              w13.scalar_type());
  return run(DenseRows<at::BFloat16>{w13.data_ptr<at::BFloat16>(), 2 * I, H},
             DenseRows<at::BFloat16>{w2.data_ptr<at::BFloat16>(), H, I}, I);
}
