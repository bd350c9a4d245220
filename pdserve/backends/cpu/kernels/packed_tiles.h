// The packed linear kernel's tiles and blocking, shared by the dense products (linear_cpu.cpp)
// and the fused argmax ones (argmax_cpu.cpp): W pre-packed into panels of 16 output channels so
// that every weight is read once, sequentially, whatever the number of rows. The layout is the
// same for every instruction set; a tile's shape is not (kRows x NP below).
//
// Why: torch's fp32 GEMM (MKL) reads weights at well under DRAM bandwidth for 1..32 rows on this
// machine (docs/BENCHMARKS.md), and decode is nothing but such products. Packed layout:
// panel p holds W[16p:16p+16, :] transposed, i.e. P[p][k][0:16], so one 64-byte cache line
// per k per panel. Weights are fp32, bf16 or int8 (symmetric, one scale per output channel);
// activations and accumulation are always fp32. An output policy (DenseOut, or the argmax ones)
// says where a tile's 64 outputs go and what happens once their last k-block is in.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "vec.h"
#include <cstring>
#include <type_traits>

namespace pdserve::tiles {

constexpr int PANEL = 16;   // output channels per panel: a 64-byte line of fp32
constexpr int VP = PANEL / kVec;   // vectors per panel
// A micro-tile is kRows x NP panels, its kRows x NP x VP accumulators in registers beside one
// vector per panel of weights and the broadcast x: 6 x 4 zmm of AVX-512's 32 registers, and the
// classic 6 x 16-channel tile (12 ymm of 16) with AVX2.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int NP = 4;       // panels per micro-tile (64 outputs)
#else
constexpr int NP = 1;
#endif
constexpr int kRows = 6;    // rows per micro-tile
constexpr int KB = 512;     // k-block: NP panels x KB rows of weights stay in L2 across row tiles
constexpr int MB = 96;      // row block: its x rows stay in L2 while all weights stream past once
constexpr int64_t kMinParallelBytes = 512 << 10;  // less weight traffic (x row tiles) than this: one thread

using pdserve::fVec;
using pdserve::kVec;

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 1); }   // prefetcht2 on x86

// The next weight block a thread reads (its group's next k-block, or the next group's first),
// prefetched into L2 a line per k-step during the later row tiles of the current block, so that
// the first row tile of the next one finds it there instead of waiting on DRAM. Lines of panel j:
// base + j * panel_bytes + i * 64, i < lines; tile t of T issues lines up to lines * NP * t / (T - 1).
// With 2 or 3 row tiles (7-18 rows) there is too little compute after the first tile to spread a
// whole block over, and instead each k-step of a tile asks for its panels' lines `ahead` k-steps
// on: the first tile's stream runs ahead of its loads, and the later tiles start the next k-block's
// stream before the next first tile needs it (AheadTiles says for which tile counts). Past a
// matrix's end it asks for lines that are not ours: harmless, a prefetch never faults.
struct NextBlock {
  const char* base = nullptr;
  int64_t panel_bytes = 0, lines = 0, next = 0, end = 0;
  int64_t ahead = 0;
  inline void prefetch_one() {
    if (next < end) {
      prefetch_l2(base + (next / lines) * panel_bytes + (next % lines) * 64);
      ++next;
    }
  }
};
constexpr int64_t kMinPrefetchTiles = 4;   // from 19 rows: with fewer tiles it measured no faster
constexpr int64_t kAheadSteps = 32;        // k-steps (2 KB of a panel, fp32 or bf16 pairs)

// The row-tile counts whose tiles prefetch `ahead`, measured per kernel with AVX-512's tiles: fp32
// 2-3 tiles (one tile gained nothing); bf16 pairs 1-4 tiles, where each k-step does twice the
// multiply-adds and the stream falls behind more (from 5 tiles it gained nothing).
struct AheadTiles {
  int64_t min, max;
};
constexpr AheadTiles kAheadFp32{2, kMinPrefetchTiles - 1};
constexpr AheadTiles kAheadPairs{1, 4};
constexpr AheadTiles kNoAhead{1, 0};   // the widened bf16 and int8 tiles (int8 measured without gain)

// A tile's MT x NP accumulators: zero on its first k-block, else the partial sums in y (row stride
// ldy) that the tile's previous k-block stored there.
template <int MT>
inline void load_acc(fVec (&acc)[MT][NP * VP], const float* y, int64_t ldy, bool first) {
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NP * VP; ++j) acc[m][j] = first ? fVec(0.f) : fVec::loadu(y + m * ldy + j * kVec);
}

template <int MT>
inline void store_acc(const fVec (&acc)[MT][NP * VP], float* y, int64_t ldy) {
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NP * VP; ++j) acc[m][j].store(y + m * ldy + j * kVec);
}

// The ahead prefetch of a tile's NP panels: each panel's line at element offset `at`.
template <typename T>
inline void prefetch_panels(const T* w, int64_t panel_stride, int64_t at) {
  for (int j = 0; j < NP; ++j) prefetch_l2(w + j * panel_stride + at);
}

// MT rows x NP panels over k in [k0, k1); accumulates into y (row stride ldy) unless first.
// Ahead: prefetch pf.ahead k-steps on (with_ahead picks it).
template <typename W, int MT, bool Ahead>
inline void micro(const float* x, int64_t ldx, const W* w, int64_t panel_stride, float* y, int64_t ldy,
                  int64_t k0, int64_t k1, bool first, NextBlock& pf) {
  fVec acc[MT][NP * VP];
  load_acc<MT>(acc, y, ldy, first);
  for (int64_t k = k0; k < k1; ++k) {
    pf.prefetch_one();
    if constexpr (Ahead) prefetch_panels(w, panel_stride, (k + pf.ahead) * PANEL);
    fVec wv[NP * VP];
    for (int j = 0; j < NP; ++j)
      for (int v = 0; v < VP; ++v) wv[j * VP + v] = pdserve::load<W>(w + j * panel_stride + k * PANEL + v * kVec);
    for (int m = 0; m < MT; ++m) {
      const fVec xv(x[m * ldx + k]);
      for (int j = 0; j < NP * VP; ++j) acc[m][j] = at::vec::fmadd(xv, wv[j], acc[m][j]);
    }
  }
  store_acc<MT>(acc, y, ldy);
}

// f(std::integral_constant<int, MT>{}) for a row tile of mt = MT rows, 1 <= mt <= kRows: the micro
// kernels take MT as a template argument, so that their accumulators live in registers.
template <int MT = kRows, typename F>
inline void with_tile_height(int64_t mt, F&& f) {
  if constexpr (MT > 1) {
    if (mt < MT) return with_tile_height<MT - 1>(mt, f);
  }
  f(std::integral_constant<int, MT>{});
}

// f(std::bool_constant<on>{}): the micro kernels take the ahead prefetch as a template argument,
// so that without it their loop has no branch for it.
template <typename F>
inline void with_ahead(bool on, F&& f) {
  if (on) f(std::true_type{}); else f(std::false_type{});
}

// The blocking both products share. Row blocks of MB: decode (M <= MB) reads the weights once.
// Threads split the output channels into groups of NP panels: each reads a disjoint, contiguous
// part of the weights. Then k-blocks, then balanced row tiles of at most kRows (32 rows in tiles of
// 6: 6,6,5,5,5,5, not 6x5 + 2): a thin tile pays the same weight loads for fewer FMAs.
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
    const int64_t grain = std::max<int64_t>(1, kMinParallelBytes / (group_bytes * (m1 - m0 + kRows - 1) / kRows));
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        for (int64_t k0 = 0; k0 < ksteps; k0 += kblock) {
          const int64_t k1 = std::min(ksteps, k0 + kblock);
          const int64_t tiles = (m1 - m0 + kRows - 1) / kRows;
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

// Where a tile's NP x 16 outputs go: tile(m, g) and its row stride ld(), then done(m, mt, g) once the
// last k-block is in. DenseOut: the (M, Npad) result. The argmax policies (argmax_cpu.cpp) use a
// scratch block of the running thread and fold it into per-row results in done, so the (M, N)
// logits are never written nor read back.
struct DenseOut {
  float* y;
  int64_t Npad;
  float* tile(int64_t m, int64_t g) const { return y + m * Npad + g * NP * PANEL; }
  int64_t ld() const { return Npad; }
  void done(int64_t, int64_t, int64_t) const {}
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

// bf16 x bf16 -> fp32 dot products (AVX512-BF16's vdpbf16ps, which the vector layer lacks): twice
// the multiply-adds per instruction of fp32 FMAs, for the compute-bound products of a bf16 model
// (prefill, large decode batches). Weights are packed in k-pairs: panel p holds
// P[p][k/2][16 channels][2], activations are bf16. Without the instruction a bf16 model's weights
// are packed as plain bf16 panels instead and widened by micro (pdserve.kernels.cpu_supports_bf16_dot).
// Ahead: prefetch pf.ahead k-pair steps on (a template argument: without it the loop is as before).
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

template <int MT, bool Ahead>
inline void micro_dp(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, float* y, int64_t ldy,
                     int64_t kp0, int64_t kp1, bool first, NextBlock& pf) {
  fVec acc[MT][NP];
  load_acc<MT>(acc, y, ldy, first);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    pf.prefetch_one();
    if constexpr (Ahead) prefetch_panels(w, panel_stride, (kp + pf.ahead) * 2 * PANEL);
    __m512bh wv[NP];
    for (int j = 0; j < NP; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * panel_stride + kp * 2 * PANEL);
    for (int m = 0; m < MT; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  store_acc<MT>(acc, y, ldy);
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
#else
constexpr bool kBf16Dot = false;
#endif

}  // namespace pdserve::tiles
