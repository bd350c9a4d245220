// Linears on group-quantized weights (pdserve/layers/quantized.py's form: w = q * scale + offset per
// group of input columns), in the packed tiles of packed_tiles.h.
//
// Layout (backends/cpu/quant_linear.py packs it), in the 16-channel panels of the dense kernel so
// that every weight byte is read once, sequentially, whatever the number of rows:
//   8-bit: codes (Npad/16, K, 16) int8: panel p, input k, channel c (the int8 PackedLinear's layout);
//   4-bit: codes (Npad/16, K/2, 16) uint8: panel p, input pair k/2, channel c; the low nibble holds
//          input 2i, the high nibble input 2i + 1 (codes 0..15);
//   scale, offset: (Npad/16, G, 16) fp32, G = K / group_size groups; offset empty: none.
// Either way one k-step of a panel is 16 bytes (one 16-channel line of 8-bit codes, or a pair of
// inputs of 4-bit ones). Accumulation is fp32 throughout. Two ways, by the number of rows:
//  - one row tile (decode of up to kRows sequences): the tile sums x * q over one group in
//    registers (the codes widened to fp32, exact), then adds scale_g * that sum and offset_g *
//    sum(x over the group) into the output tile. Nothing but the codes is written or re-read.
//  - more rows: widening the codes in every row tile made the widening, not the multiply-adds, the
//    bound (int4 at 32 rows ran below fp32). Instead each k-block of a tile's panels is dequantized
//    once, w = q * scale + offset rounded once to fp32 (one fused multiply-add), into a buffer that
//    stays in L1, and every row tile runs the fp32 kernel's micro-tile on it.
#include "ops.h"
#include "packed_tiles.h"

using namespace pdserve::tiles;

namespace {

constexpr int64_t kQuantBlock = 2048;   // inputs per k-block of one row tile (whole groups, at least one)
// inputs per dequantized k-block: NP panels x 16 channels of fp32 = 32 KB with AVX-512, in L1
constexpr int64_t kDequantInputs = 128;

// kVec consecutive bytes at p, zero-extended to int32 lanes.
inline pdserve::iVec load_u8(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  int32_t v[kVec];
  for (int i = 0; i < kVec; ++i) v[i] = p[i];
  return pdserve::iVec::loadu(v);
#endif
}

// One input of a 4-bit byte vector, widened to fp32: the low nibbles (half 0) or the high ones.
inline fVec nibble(const pdserve::iVec& b, int half) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepi32_ps(half ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(15)));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepi32_ps(half ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15)));
#else
  int32_t v[kVec];
  float f[kVec];
  b.store(v);
  for (int i = 0; i < kVec; ++i) f[i] = half ? v[i] >> 4 : v[i] & 15;
  return fVec::loadu(f);
#endif
}

// The partial sums over one group: part[m][j] = sum over the group's k of x[m][k] * q[k][j].
// w: the group's first k-step of the tile's first panel; steps: k-steps in the group.
template <int Bits, int MT>
inline void group_sums(fVec (&part)[MT][NP * VP], const float* x, int64_t ldx, const uint8_t* w, int64_t panel_stride,
                       int64_t steps) {
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NP * VP; ++j) part[m][j] = fVec(0.f);
  for (int64_t s = 0; s < steps; ++s) {
    const uint8_t* ws = w + s * PANEL;
    if constexpr (Bits == 8) {
      fVec wv[NP * VP];
      for (int j = 0; j < NP; ++j)
        for (int v = 0; v < VP; ++v)
          wv[j * VP + v] = pdserve::load<int8_t>(reinterpret_cast<const int8_t*>(ws + j * panel_stride + v * kVec));
      for (int m = 0; m < MT; ++m) {
        const fVec xv(x[m * ldx + s]);
        for (int j = 0; j < NP * VP; ++j) part[m][j] = at::vec::fmadd(xv, wv[j], part[m][j]);
      }
    } else {
      // the bytes loaded and widened once, then the pair's two inputs in turn: the low nibbles of the
      // NP panels, then the high ones (reading the bytes twice measured 1.5-2x slower at 2-6 rows)
      pdserve::iVec bv[NP * VP];
      for (int j = 0; j < NP; ++j)
        for (int v = 0; v < VP; ++v) bv[j * VP + v] = load_u8(ws + j * panel_stride + v * kVec);
      for (int half = 0; half < 2; ++half) {
        fVec wv[NP * VP];
        for (int j = 0; j < NP * VP; ++j) wv[j] = nibble(bv[j], half);
        for (int m = 0; m < MT; ++m) {
          const fVec xv(x[m * ldx + 2 * s + half]);
          for (int j = 0; j < NP * VP; ++j) part[m][j] = at::vec::fmadd(xv, wv[j], part[m][j]);
        }
      }
    }
  }
}

// MT rows x NP panels over the groups [g0, g1): y (row stride ldy) = (first ? 0 : y) + the groups'
// terms. x: the tile's first row at its first input of group g0; w: the first panel's codes at g0;
// scale, offset: the first panel's at group 0 (panel stride G * 16); xsum: the rows' group sums (row
// stride G), null without offsets.
template <int Bits, int MT>
void qmicro(const float* x, int64_t ldx, const uint8_t* w, int64_t panel_stride, const float* scale,
            const float* offset, const float* xsum, int64_t G, int64_t gs, float* y, int64_t ldy, int64_t g0,
            int64_t g1, bool first) {
  const int64_t steps = Bits == 8 ? gs : gs / 2, group_bytes = steps * PANEL;
  for (int64_t g = g0; g < g1; ++g) {
    fVec part[MT][NP * VP];
    group_sums<Bits, MT>(part, x + (g - g0) * gs, ldx, w + (g - g0) * group_bytes, panel_stride, steps);
    for (int j = 0; j < NP; ++j)
      for (int v = 0; v < VP; ++v) {
        const int64_t at = (j * G + g) * PANEL + v * kVec;
        const fVec s = fVec::loadu(scale + at);
        const fVec o = offset ? fVec::loadu(offset + at) : fVec(0.f);
        for (int m = 0; m < MT; ++m) {
          float* out = y + m * ldy + j * PANEL + v * kVec;
          fVec acc = first && g == g0 ? fVec(0.f) : fVec::loadu(out);
          acc = at::vec::fmadd(s, part[m][j * VP + v], acc);
          if (offset) acc = at::vec::fmadd(o, fVec(xsum[m * G + g]), acc);
          acc.store(out);
        }
      }
  }
}

// Inputs [i0, i1) of a tile's NP panels as fp32 weights, w = q * scale + offset (offset null: 0), into
// buf (panel j at j * (i1 - i0) * 16: the dense fp32 panel layout). w: the first panel's codes at
// input i0; scale, offset: the first panel's at group 0 (panel stride G * 16); gs: inputs per group.
template <int Bits>
void dequantize_block(float* buf, const uint8_t* w, int64_t panel_stride, const float* scale, const float* offset,
                      int64_t G, int64_t gs, int64_t i0, int64_t i1) {
  constexpr int64_t per = Bits == 8 ? 1 : 2;   // inputs per k-step
  for (int j = 0; j < NP; ++j) {
    float* out = buf + j * (i1 - i0) * PANEL;
    const uint8_t* wj = w + j * panel_stride;
    for (int64_t i = i0; i < i1;) {
      const int64_t g = i / gs, end = std::min(i1, (g + 1) * gs);
      fVec s[VP], o[VP];
      for (int v = 0; v < VP; ++v) {
        s[v] = fVec::loadu(scale + (j * G + g) * PANEL + v * kVec);
        o[v] = offset ? fVec::loadu(offset + (j * G + g) * PANEL + v * kVec) : fVec(0.f);
      }
      for (; i < end; i += per) {
        const uint8_t* ws = wj + (i - i0) / per * PANEL;
        float* os = out + (i - i0) * PANEL;
        for (int v = 0; v < VP; ++v) {
          if constexpr (Bits == 8) {
            at::vec::fmadd(pdserve::load<int8_t>(reinterpret_cast<const int8_t*>(ws + v * kVec)), s[v], o[v])
                .store(os + v * kVec);
          } else {
            const pdserve::iVec b = load_u8(ws + v * kVec);
            at::vec::fmadd(nibble(b, 0), s[v], o[v]).store(os + v * kVec);
            at::vec::fmadd(nibble(b, 1), s[v], o[v]).store(os + PANEL + v * kVec);
          }
        }
      }
    }
  }
}

// One row tile: the codes widened in registers, the group terms added per group (qmicro).
template <int Bits>
void quant_direct(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scale, const float* offset,
                  const float* xsum, int64_t G, int64_t Npad, float* y) {
  const int64_t gs = K / G, per = Bits == 8 ? 1 : 2;   // inputs per k-step
  const int64_t ksteps = K / per, panel_stride = ksteps * PANEL;
  const int64_t block = std::max<int64_t>(1, kQuantBlock / gs) * gs;   // inputs per k-block, whole groups
  const DenseOut out{y, Npad};
  for_each_tile(M, ksteps, block / per, Npad / (PANEL * NP), w, PANEL, kNoAhead,
                [&](int64_t mt, int64_t m, int64_t g, int64_t k0, int64_t k1, NextBlock&) {
                  const int64_t g0 = k0 * per / gs, g1 = k1 * per / gs;
                  const uint8_t* wp = w + g * NP * panel_stride + k0 * PANEL;
                  const int64_t pg = g * NP;   // first panel of the tile
                  with_tile_height(mt, [&](auto MT) {
                    qmicro<Bits, MT>(x + m * K + g0 * gs, K, wp, panel_stride, scale + pg * G * PANEL,
                                     offset ? offset + pg * G * PANEL : nullptr, xsum ? xsum + m * G : nullptr, G, gs,
                                     out.tile(m, g), out.ld(), g0, g1, k0 == 0);
                  });
                });
}

// More rows: each k-block of kDequantInputs inputs of a tile's panels dequantized once by the block's
// first row tile (for_each_tile runs a block's row tiles in order on one thread, the first at the
// row block's start m0, a multiple of MB), then every row tile multiplies it as fp32 weights.
template <int Bits>
void quant_buffered(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scale, const float* offset,
                    int64_t G, int64_t Npad, float* y) {
  const int64_t gs = K / G, per = Bits == 8 ? 1 : 2;
  const int64_t ksteps = K / per, panel_stride = ksteps * PANEL;
  const DenseOut out{y, Npad};
  for_each_tile(M, ksteps, kDequantInputs / per, Npad / (PANEL * NP), w, PANEL, kNoAhead,
                [&](int64_t mt, int64_t m, int64_t g, int64_t k0, int64_t k1, NextBlock& pf) {
                  alignas(64) static thread_local float buf[NP * kDequantInputs * PANEL];
                  const int64_t i0 = k0 * per, i1 = k1 * per;
                  if (m % MB == 0)
                    dequantize_block<Bits>(buf, w + g * NP * panel_stride + k0 * PANEL, panel_stride,
                                           scale + g * NP * G * PANEL, offset ? offset + g * NP * G * PANEL : nullptr,
                                           G, gs, i0, i1);
                  with_tile_height(mt, [&](auto MT) {
                    micro<float, MT, false>(x + m * K + i0, K, buf, (i1 - i0) * PANEL, out.tile(m, g), out.ld(), 0,
                                            i1 - i0, k0 == 0, pf);
                  });
                });
}

}  // namespace

// x: (M, K) fp32 contiguous; packed: (Npad/16, K/2, 16) uint8 (4-bit) or (Npad/16, K, 16) int8
// (8-bit); scale and offset (offset empty: none): (Npad/16, G, 16) fp32. Returns (M, Npad) fp32.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor offset) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (M, K) fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.is_contiguous() &&
              (packed.scalar_type() == at::kByte || packed.scalar_type() == at::kChar), "bad quantized weight");
  const int bits = packed.scalar_type() == at::kByte ? 4 : 8;
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), Npad = P * PANEL;
  TORCH_CHECK(packed.size(1) * (bits == 4 ? 2 : 1) == K && Npad % (PANEL * NP) == 0, "quantized weight does not match x");
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == P && scale.size(2) == PANEL && scale.scalar_type() == at::kFloat &&
              scale.is_contiguous(), "scale must be (Npad/16, groups, 16) fp32");
  const int64_t G = scale.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (bits == 8 || (K / G) % 2 == 0), "groups of ", K, " inputs: ", G);
  const bool has_offset = offset.defined() && offset.numel() > 0;
  TORCH_CHECK(!has_offset || (offset.sizes() == scale.sizes() && offset.scalar_type() == at::kFloat &&
                              offset.is_contiguous()), "offset must be shaped as scale");
  auto y = pdserve::pooled_empty({M, Npad});
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum;
  if (has_offset && M <= kRows) {   // the direct tile's offset term: sum(x over the group), per row and group
    const int64_t gs = K / G;
    xsum.resize(M * G);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        for (int64_t k = 0; k < gs; ++k) s += xp[m * K + g * gs + k];
        xsum[m * G + g] = s;
      }
  }
  const auto* w = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const float* o = has_offset ? offset.data_ptr<float>() : nullptr;
  const float* xs = has_offset ? xsum.data() : nullptr;
  float* yp = y.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  if (M > kRows)
    bits == 4 ? quant_buffered<4>(xp, M, K, w, sp, o, G, Npad, yp) : quant_buffered<8>(xp, M, K, w, sp, o, G, Npad, yp);
  else
    bits == 4 ? quant_direct<4>(xp, M, K, w, sp, o, xs, G, Npad, yp) : quant_direct<8>(xp, M, K, w, sp, o, xs, G, Npad, yp);
  return y;
}
