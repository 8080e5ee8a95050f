// AVX-512 building blocks of the attention path (attention_avx512.h): loads that convert
// half precision in registers, bf16 pair dot products, a 16-way horizontal sum, a 16 x 16
// transpose, exp and the softmax step in 16-lane vectors, software prefetch.
#pragma once
#if defined(__AVX512F__)

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <limits>

#include "attention_common.h"

namespace pd_attn::avx512 {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// bf16 query and cache: products of bf16 pairs summed into fp32 lanes (AVX512-BF16's
// vdpbf16ps, two exact products per lane per instruction); elsewhere never called.
template <typename T>
inline __m512i load_pairs(const T* p) { return _mm512_loadu_si512(p); }
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  (void)a, (void)b;
  return acc;
#endif
}

// Lane j of the result = the sum of v[j]'s 16 lanes.
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 128-bit lane L of b[i]: v[4i..4i+3] summed over lane L
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                  _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                  _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd));
}

// r[i] becomes column i of the 16 x 16 matrix whose rows were r[0..15].
inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int a = 0; a < 4; ++a) {  // u[4a + e], 128-bit lane L: rows 4a..4a+3, column 4L + e
    const __m512d x0 = _mm512_castps_pd(t[4 * a]), x1 = _mm512_castps_pd(t[4 * a + 1]);
    const __m512d y0 = _mm512_castps_pd(t[4 * a + 2]), y1 = _mm512_castps_pd(t[4 * a + 3]);
    u[4 * a] = _mm512_castpd_ps(_mm512_unpacklo_pd(x0, y0));
    u[4 * a + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x0, y0));
    u[4 * a + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(x1, y1));
    u[4 * a + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(x1, y1));
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88);
    const __m512 w0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xdd);
    const __m512 v1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xdd);
    r[e] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    r[8 + e] = _mm512_shuffle_f32x4(v0, v1, 0xdd);
    r[4 + e] = _mm512_shuffle_f32x4(w0, w1, 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(w0, w1, 0xdd);
  }
}

// exp(v) for v <= 0, 16 lanes: the reduction and polynomial of exp_inplace (attention_common.h).
inline __m512 exp16(__m512 v) {
  v = _mm512_max_ps(v, _mm512_set1_ps(-87.0f));
  const __m512 round = _mm512_set1_ps(12582912.f);
  const __m512 k = _mm512_sub_ps(
      _mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), round), round);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f),
                                    _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), v));
  __m512 p = _mm512_set1_ps(1.0f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// softmax_step (attention_common.h) in 16-lane vectors: the same arithmetic, but the row's
// max and sum are vector reductions, and only the 16-key groups overlapping the visible
// range [lo, hi) are computed (the rest of [0, n) is zeroed). s must hold n rounded up to 16.
inline float softmax_step16(float* s, int64_t n, int64_t lo, int64_t hi, float scale,
                            float softcap, float& m, float& l) {
  const int64_t n16 = (n + 15) / 16 * 16;
  if (hi <= lo) {
    for (int64_t j = 0; j < n16; j += 16) _mm512_storeu_ps(s + j, _mm512_setzero_ps());
    return 1.f;
  }
  if (softcap > 0.f) {  // the order of the reference: scale, then cap
    for (int64_t j = lo; j < hi; ++j) s[j] = std::tanh(s[j] * scale / softcap) * softcap;
    scale = 1.f;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t g0 = lo / 16 * 16, g1 = (hi + 15) / 16 * 16;
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i vlo = _mm512_set1_epi32(static_cast<int32_t>(lo));
  const __m512i vhi = _mm512_set1_epi32(static_cast<int32_t>(hi));
  auto visible = [&](int64_t j) {
    const __m512i idx = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(j)));
    return _mm512_cmpge_epi32_mask(idx, vlo) & _mm512_cmplt_epi32_mask(idx, vhi);
  };
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = g0; j < g1; j += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), vscale);
    vmax = _mm512_mask_max_ps(vmax, visible(j), vmax, x);
  }
  const float mx = std::max(m, _mm512_reduce_max_ps(vmax));
  const float alpha = std::exp(m - mx);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < g0; j += 16) _mm512_storeu_ps(s + j, _mm512_setzero_ps());
  for (int64_t j = g0; j < g1; j += 16) {
    const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), vscale), vmx);
    const __m512 p = _mm512_maskz_mov_ps(visible(j), exp16(x));
    _mm512_storeu_ps(s + j, p);
    sum = _mm512_add_ps(sum, p);
  }
  for (int64_t j = g1; j < n16; j += 16) _mm512_storeu_ps(s + j, _mm512_setzero_ps());
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = mx;
  return alpha;
}

constexpr int64_t kPrefetchKeys = 8;  // how far ahead of its use a key's row is fetched

template <int Hint, typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t x = 0; x < n * static_cast<int64_t>(sizeof(T)); x += 64)
    _mm_prefetch(c + x, static_cast<_mm_hint>(Hint));
}

}  // namespace pd_attn::avx512

#endif  // __AVX512F__
