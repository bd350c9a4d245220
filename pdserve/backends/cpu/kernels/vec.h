// The CPU kernels' vector layer: ATen's at::vec::Vectorized<float>, whose instruction set (AVX-512,
// AVX2, NEON, or plain C++) the build's flags pick, plus the few things the kernels need beside it:
// widening loads of bf16 and int8, exp, reductions in a fixed order, and a fence against fusing.
// Intrinsics appear only where one instruction set has an instruction the layer lacks (vscalefps),
// each with the portable form beside it giving the same bits.
#pragma once
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#include <cstring>

namespace pdserve {

using fVec = at::vec::Vectorized<float>;
using iVec = at::vec::Vectorized<int32_t>;
constexpr int kVec = fVec::size();   // fp32 lanes: 16 with AVX-512, 8 with AVX2

#if defined(CPU_CAPABILITY_AVX512)
constexpr const char* kIsa = "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "default";
#endif

// Keeps the compiler from contracting the product that made v with a later add into one fused
// multiply-add (GCC does by default): the kernels round where torch's ops round.
inline void fence(fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
  asm("" : "+v"(r));
  v = r;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = v;
  asm("" : "+x"(r));
  v = r;
#else
  asm volatile("" : : "r"(&v) : "memory");
#endif
}

// kVec elements at p, widened to fp32 (exactly: bf16 and int8 fit in fp32)
template <typename T> inline fVec load(const T* p);
template <> inline fVec load<float>(const float* p) { return fVec::loadu(p); }
template <> inline fVec load<at::BFloat16>(const at::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  fVec v;
  at::vec::load_fp32_from_bf16(p, v);
  return v;
#else
  float f[kVec];
  for (int i = 0; i < kVec; ++i) f[i] = static_cast<float>(p[i]);
  return fVec::loadu(f);
#endif
}
template <> inline fVec load<int8_t>(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  float f[kVec];
  for (int i = 0; i < kVec; ++i) f[i] = p[i];
  return fVec::loadu(f);
#endif
}

// max as vmaxps computes it: a where a > b, else b (so a NaN in a yields b), which is not
// at::vec::maximum's NaN-propagating rule
inline fVec maxps(const fVec& a, const fVec& b) { return fVec::blendv(b, a, a > b); }

// The lanes' sum and max, halving the vector each step (lane i with lane i + half): the order of
// _mm512_reduce_add_ps, so that every build sums a row's lanes the same way.
inline float reduce_add(const fVec& v) {
  alignas(64) float a[kVec];
  v.store(a);
  for (int w = kVec / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = a[i + w] + a[i];
  return a[0];
}
inline float reduce_max(const fVec& v) {
  alignas(64) float a[kVec];
  v.store(a);
  for (int w = kVec / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = a[i + w] > a[i] ? a[i + w] : a[i];
  return a[0];
}

// p * 2^n for integer-valued n: one vscalefps on AVX-512; elsewhere two exact power-of-two
// products (each factor a normal number for n in [-252, 254]), which round once, as it does.
inline fVec scale2(const fVec& p, const fVec& n) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_scalef_ps(p, n);
#else
  const fVec c = at::vec::minimum(n, fVec(254.f));
  const fVec a = (c * fVec(0.5f)).floor(), b = c - a;
  auto pow2 = [](const fVec& e) { return at::vec::cast<float>((at::vec::convert_to_int_of_same_size(e) + iVec(127)) * iVec(1 << 23)); };
  fVec r = p * pow2(a);
  fence(r);
  r = r * pow2(b);
  fence(r);
  return r;
#endif
}

// exp: 2^n * poly(r), |r| <= ln2/2, rel. error ~1e-7 for x in [-87, 88]; below -87 it is ~0, above
// 88.7 inf (softmax calls it on x <= 0, SiLU on any x); a NaN gives exp(-87)
inline fVec exp(fVec x) {
  x = at::vec::minimum(maxps(x, fVec(-87.0f)), fVec(89.0f));   // 89 and more: inf, +inf included
  const fVec n = (x * fVec(1.44269504088896341f)).round();
  fVec r = at::vec::fnmadd(n, fVec(0.693145751953125f), x);
  r = at::vec::fnmadd(n, fVec(1.428606765330187045e-06f), r);
  fVec p(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = at::vec::fmadd(p, r, fVec(c));
  return scale2(p, n);
}

// tanh(y) = 2 / (1 + exp(-2y)) - 1: absolute error ~1e-7 (relative error grows near 0, where the
// two terms cancel); what a soft cap needs, whose scores enter the softmax by their absolute value
inline fVec tanh(const fVec& y) {
  return fVec(2.f) / (fVec(1.f) + exp(fVec(-2.f) * y)) - fVec(1.f);
}

// An attention score's soft cap (Gemma 2): cap * tanh(s / cap)
inline fVec softcap(const fVec& s, float cap) { return fVec(cap) * tanh(s / fVec(cap)); }

}  // namespace pdserve
