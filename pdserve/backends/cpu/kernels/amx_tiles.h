// The k-pair bf16 products (packed_tiles.h: linear_dp_impl) on AMX tiles, where the CPU has
// AMX-BF16 (Intel Sapphire Rapids and later) and a product has enough rows to fill them.
//
// Why: AVX512-BF16's dot products top out near 240 GFLOP/s on two cores; one TDPBF16PS multiplies
// a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums, and torch's oneDNN GEMM on the same
// tiles ran 3.5x faster at 32 rows and 7-12x at 128-2048 (docs/PERFORMANCE.md). A bf16 model's
// prefill and its decode batches past a few rows are compute-bound on the dot products; on tiles
// they are bound by the weight read again. No second copy of the weights: the k-pair panel layout
// is already AMX's B-tile layout (a tile row is one k-pair of 16 channels, 64 bytes), so a panel's
// next 16 k-pairs are one contiguous 1 KB tile.
//
// Tiles: C0-C3 (tmm0-3) the 16 rows x 64 channels of one output group (NP panels), A (tmm4) 16 rows
// x 32 k of x, B (tmm5-7) a panel's 32 k x 16 channels. The same output policies as the dot
// products (DenseOut, the argmax ones): a tile's outputs go to out.tile(m, g), then out.done.
#pragma once
#include "packed_tiles.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#define PDSERVE_AMX 1

namespace pdserve::tiles {

constexpr int64_t kAmxRows = 16;    // rows of an A or C tile
constexpr int64_t kAmxK = 32;       // bf16 inputs per A-tile row: 16 k-pairs, 64 bytes
constexpr int64_t kAmxMinRows = 8;  // fewer rows: the dot products (the weight read bounds both)
constexpr int64_t kAmxRowBlock = 256;   // rows whose x stays in L2 while a group's weights are reused

// The CPU has AMX-BF16 and Linux lets this process use the tiles (their 8 KB of state must be
// requested once per process: ARCH_REQ_XCOMP_PERM for XTILEDATA).
inline bool amx_supported() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;   // AMX-BF16, AMX-TILE
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Off by set_amx(false) (the tests and the A/B benchmarks compare both paths).
inline std::atomic<bool> amx_enabled{true};

inline bool use_amx(int64_t M, int64_t K) {
  return M >= kAmxMinRows && K % kAmxK == 0 && amx_enabled.load(std::memory_order_relaxed) && amx_supported();
}

// x rows for the tiles: a 16-row A tile reads past the last row, so a batch that is not a multiple
// of 16 rows is copied into zero-padded rows (a tiny copy beside the product).
inline torch::Tensor amx_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), Mpad = (M + kAmxRows - 1) / kAmxRows * kAmxRows;
  if (Mpad == M) return x;
  auto padded = torch::zeros({Mpad, x.size(1)}, x.options());
  padded.narrow(0, 0, M).copy_(x);
  return padded;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile used 16 rows of 64 bytes (A: 16 x 32 bf16, B: 16 k-pairs x 32, C: 16 x 16 fp32).
inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// The tile intrinsics are asm statements with no memory operands: the compiler must not move
// plain loads and stores of the buffers they read and write across them.
inline void compiler_barrier() { asm volatile("" ::: "memory"); }

// y = x @ W^T on the tiles, x: (ceil16(M), K) bf16 (amx_rows), K % 32 == 0, W: k-pair panels,
// Npad % 64 == 0. Threads split the output groups (NP panels) as for_each_tile does; each group's
// weights (NP x K x 32 bytes) stay in L2 across a row block's 16-row tiles.
template <typename Out>
void linear_amx_impl(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t Npad, const Out& out) {
  const int64_t ps = K * PANEL;                // elements per panel
  const int64_t steps = K / kAmxK, groups = Npad / (PANEL * NP);
  const int64_t lda = K * 2;                   // bytes per x row
  constexpr int64_t kStep = kAmxK / 2 * 2 * PANEL;   // elements of one B tile: 16 k-pairs x 32
  const int64_t group_bytes = NP * ps * 2;
  for (int64_t m0 = 0; m0 < M; m0 += kAmxRowBlock) {
    const int64_t m1 = std::min(M, m0 + kAmxRowBlock);
    const int64_t grain = std::max<int64_t>(1, kMinParallelBytes / (group_bytes * ((m1 - m0 + kAmxRows - 1) / kAmxRows)));
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      amx_configure();
      alignas(64) float tail[kAmxRows * NP * PANEL];
      for (int64_t g = g0; g < g1; ++g) {
        const uint16_t* wg = w + g * NP * ps;
        for (int64_t m = m0; m < m1; m += kAmxRows) {
          const int64_t mt = std::min(kAmxRows, m1 - m);
          const uint16_t* xa = x + m * K;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t s = 0; s < steps; ++s) {
            const uint16_t* b = wg + s * kStep;
            _tile_loadd(4, xa + s * kAmxK, lda);
            _tile_loadd(5, b, 64);
            _tile_loadd(6, b + ps, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(7, b + 2 * ps, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, b + 3 * ps, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 4, 5);
          }
          // a full tile straight into the output; the last rows of a batch through `tail`
          const bool full = mt == kAmxRows;
          float* y = full ? out.tile(m, g) : tail;
          const int64_t ldy = full ? out.ld() : NP * PANEL;
          compiler_barrier();
          _tile_stored(0, y, ldy * 4);
          _tile_stored(1, y + PANEL, ldy * 4);
          _tile_stored(2, y + 2 * PANEL, ldy * 4);
          _tile_stored(3, y + 3 * PANEL, ldy * 4);
          compiler_barrier();
          if (!full) {
            float* dst = out.tile(m, g);
            for (int64_t r = 0; r < mt; ++r) std::memcpy(dst + r * out.ld(), tail + r * NP * PANEL, NP * PANEL * 4);
          }
          out.done(m, mt, g);
        }
      }
      _tile_release();
    });
  }
}

}  // namespace pdserve::tiles
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
namespace pdserve::tiles {

// A k-pair product of bf16 rows x (M, K) contiguous into `out`: on the tiles where use_amx says so,
// else on the dot products.
template <typename Out>
void linear_pairs(const torch::Tensor& x, const uint16_t* w, int64_t Npad, const Out& out) {
  const int64_t M = x.size(0), K = x.size(1);
  auto rows = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
#if defined(PDSERVE_AMX)
  if (use_amx(M, K)) {
    const auto xa = amx_rows(x);
    linear_amx_impl(rows(xa), M, K, w, Npad, out);
    return;
  }
#endif
  linear_dp_impl(rows(x), M, K, w, Npad, out);
}

}  // namespace pdserve::tiles
#endif
