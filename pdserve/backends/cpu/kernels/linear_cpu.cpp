// Linear layers for CPU decode: y = x @ W^T (+ bias), on the packed tiles of packed_tiles.h.
#include "ops.h"
#include "packed_tiles.h"
#include "amx_tiles.h"

using namespace pdserve::tiles;

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
  TORCH_CHECK(kBf16Dot, "packed_linear_bf16_pairs needs a build with AVX512-BF16 (this one is ", pdserve::kIsa, ")");
  auto y = pdserve::pooled_empty({M, Npad});
  if (M == 0) return y;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  linear_pairs(x, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), Npad,
               DenseOut{y.data_ptr<float>(), Npad});
#endif
  return y;
}

// Whether the k-pair products run on AMX tiles where they can (amx_tiles.h): `enable` 0 or 1
// switches them off or on (the tests and A/B runs compare both), -1 only asks. Returns whether
// they are on and this CPU and process can use them.
bool set_amx(int64_t enable) {
#if defined(PDSERVE_AMX)
  if (enable >= 0) amx_enabled = enable != 0;
  return amx_enabled && amx_supported();
#else
  return false;
#endif
}

// Rows W[ids] read back from the packed layout, (n, K) fp32: the tied input embedding (one copy of
// the matrix). packed: (Npad/16, K, 16) fp32|bf16|int8 (int8 times scale[id]) or (Npad/16, K/2, 32)
// bf16 k-pairs. One call instead of the four torch ops (and their set-up) of indexing the panels.
torch::Tensor packed_rows(torch::Tensor packed, torch::Tensor scale, torch::Tensor ids) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "bad packed weight");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(), "ids must be 1-D int64");
  const bool pairs = packed.size(2) == 2 * PANEL;
  TORCH_CHECK(pairs ? packed.scalar_type() == at::kBFloat16 : packed.size(2) == PANEL, "bad packed weight");
  const int64_t n = ids.size(0), steps = packed.size(1), K = pairs ? 2 * steps : steps, Npad = packed.size(0) * PANEL;
  const bool scaled = packed.scalar_type() == at::kChar;
  TORCH_CHECK(!scaled || (scale.scalar_type() == at::kFloat && scale.numel() == Npad), "int8 weights need their scale");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < Npad, "row ", id[i], " out of range");
  auto out = torch::empty({n, K});
  float* o = out.data_ptr<float>();
  // element (row r, k) of each layout: panel r / 16, channel r % 16
  auto gather = [&](auto* w, auto index) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = id[i] / PANEL, c = id[i] % PANEL;
      const float s = scaled ? scale.data_ptr<float>()[id[i]] : 1.f;
      for (int64_t k = 0; k < K; ++k) o[i * K + k] = static_cast<float>(w[index(p, k, c)]) * s;
    }
  };
  const int64_t width = packed.size(2);
  auto panel_index = [&](int64_t p, int64_t k, int64_t c) { return (p * steps + k) * width + c; };
  if (pairs)
    gather(packed.data_ptr<at::BFloat16>(), [&](int64_t p, int64_t k, int64_t c) { return panel_index(p, k / 2, 2 * c + k % 2); });
  else if (packed.scalar_type() == at::kFloat)
    gather(packed.data_ptr<float>(), panel_index);
  else if (packed.scalar_type() == at::kBFloat16)
    gather(packed.data_ptr<at::BFloat16>(), panel_index);
  else if (scaled)
    gather(packed.data_ptr<int8_t>(), panel_index);
  else
    TORCH_CHECK(false, "packed weight dtype must be float32, bfloat16 or int8");
  return out;
}
