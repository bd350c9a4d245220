#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// x: (M, K) fp32, packed: (P, K, 16) fp32. y: (M, P*16). Row tiles of MT rows x 1 panel: each
// weight line is used by MT rows right after it is loaded; a panel's next row tile finds it in L2.
template <int MT>
inline void tile1(const float* x, int64_t K, int64_t ldm, const float* w, float* y, int64_t ldy) {
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv = _mm512_loadu_ps(w + k * 16);
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[k * ldm + m]), wv, acc[m]);
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(y + m * ldy, acc[m]);
}

// MT rows x 2 panels
template <int MT>
inline void tile2(const float* x, int64_t K, int64_t ldm, const float* w, int64_t ps, float* y, int64_t ldy) {
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w0 = _mm512_loadu_ps(w + k * 16), w1 = _mm512_loadu_ps(w + ps + k * 16);
    for (int m = 0; m < MT; ++m) {
      __m512 xv = _mm512_set1_ps(x[k * ldm + m]);
      acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < MT; ++m) { _mm512_storeu_ps(y + m * ldy, acc[m][0]); _mm512_storeu_ps(y + m * ldy + 16, acc[m][1]); }
}

torch::Tensor tall_linear(torch::Tensor x, torch::Tensor packed, int64_t variant) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  auto y = torch::empty({M, P * 16}, x.options());
  auto xt = x.t().contiguous();
  const float* xp = xt.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = P * 16, ps = K * 16;
  TORCH_CHECK(M % 16 == 0 || variant == 2);
  if (variant == 1) {   // 16 x 1
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t m = 0; m < M; m += 16) tile1<16>(xp + m, K, M, wp + p * ps, yp + m * ldy + p * 16, ldy);
    });
  } else {              // 12 x 2 (M multiple of ... 8 rows tiles of 8 for the lab)
    TORCH_CHECK(P % 2 == 0 && M % 8 == 0);
    at::parallel_for(0, P / 2, 1, [&](int64_t q0, int64_t q1) {
      for (int64_t q = q0; q < q1; ++q)
        for (int64_t m = 0; m < M; m += 8) tile2<8>(xp + m, K, M, wp + 2 * q * ps, ps, yp + m * ldy + 2 * q * 16, ldy);
    });
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("tall_linear", &tall_linear, py::call_guard<py::gil_scoped_release>()); }
