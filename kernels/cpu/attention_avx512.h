// The AVX-512 path, for head dims (key and value) that are multiples of 16, any block size.
//
// An item's visible keys are taken in chunks of whole blocks (up to 512 keys for decode, 256
// for prefill tiles): all scores of the chunk first, then one softmax step per row, then P.V,
// so the running max and the accumulator are rescaled once per chunk, not per block. Keys and
// values are read in place through per-key row pointers (half precision converted in
// registers). Two ways to get the scores:
//  * few rows per KV head (decode: group <= 4): each key's dot products with the head's rows,
//    reduced 16 keys at a time by one transpose-add tree;
//  * many rows (prefill tiles, large groups): 16 keys transposed into fp32 once, then every
//    row's scores against them by broadcast FMAs, eight rows at a time.
#pragma once
#if defined(__AVX512F__)

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

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

// s[r * ss + j] = q_r . k_j for R rows (fp32, row stride d) and n keys: per key, R dot
// products over the head dim, reduced 16 keys at a time (s rows hold n rounded up to 16).
// Decode is bound by memory, not arithmetic: the keys a few steps ahead are fetched into L1,
// and their values (dv wide, read after the softmax) into L2 meanwhile.
template <int R, bool kBf16Dot, typename C>
inline void scores_direct(const float* q, const c10::BFloat16* qb, int64_t d,
                          const C* const* keys, const C* const* vals, int64_t dv, int64_t n,
                          float* s, int64_t ss, __m512* tmp) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    for (int64_t jj = 0; jj < m; ++jj) {
      if (j0 + jj + kPrefetchKeys < n) {
        prefetch_row<_MM_HINT_T0>(keys[j0 + jj + kPrefetchKeys], d);
        prefetch_row<_MM_HINT_T1>(vals[j0 + jj + kPrefetchKeys], dv);
      }
      const C* kp = keys[j0 + jj];
      __m512 a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
      if constexpr (kBf16Dot) {
        for (int64_t x = 0; x < d; x += 32) {
          const __m512i kx = _mm512_loadu_si512(kp + x);
          for (int r = 0; r < R; ++r) a[r] = dot_pairs(a[r], load_pairs(qb + r * d + x), kx);
        }
      } else {
        for (int64_t x = 0; x < d; x += 16) {
          const __m512 kx = load16(kp + x);
          for (int r = 0; r < R; ++r)
            a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * d + x), kx, a[r]);
        }
      }
      for (int r = 0; r < R; ++r) tmp[r * 16 + jj] = a[r];
    }
    for (int r = 0; r < R; ++r) {
      for (int64_t jj = m; jj < 16; ++jj) tmp[r * 16 + jj] = _mm512_setzero_ps();
      _mm512_storeu_ps(s + r * ss + j0, hsum16(tmp + r * 16));
    }
  }
}

// s[r * ss + j] for R rows (row stride d) against 16 keys stored transposed: fp32
// (kt[x * 16 + j]), or bf16 pairs (kt[x / 2 * 16 + j] = keys j's dims x, x + 1).
template <int R, bool kBf16Dot, typename T>
inline void scores_tile(const T* q, int64_t d, const float* kt, float* s, int64_t ss) {
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  if constexpr (kBf16Dot) {
    for (int64_t x = 0; x < d; x += 2) {
      const __m512i kx = _mm512_castps_si512(_mm512_loadu_ps(kt + x * 8));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, q + r * d + x, sizeof(pair));
        a[r] = dot_pairs(a[r], _mm512_set1_epi32(pair), kx);
      }
    }
  } else {
    for (int64_t x = 0; x < d; ++x) {
      const __m512 kx = _mm512_loadu_ps(kt + x * 16);
      for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + x]), kx, a[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * ss, a[r]);
}

template <bool kBf16Dot, typename T>
inline void scores_tile_rows(const T* q, int64_t d, const float* kt, float* s, int64_t ss,
                             int64_t rows) {
  int64_t row = 0;
  for (; row + 8 <= rows; row += 8)
    scores_tile<8, kBf16Dot>(q + row * d, d, kt, s + row * ss, ss);
  q += row * d;
  s += row * ss;
  switch (rows - row) {
    case 7: return scores_tile<7, kBf16Dot>(q, d, kt, s, ss);
    case 6: return scores_tile<6, kBf16Dot>(q, d, kt, s, ss);
    case 5: return scores_tile<5, kBf16Dot>(q, d, kt, s, ss);
    case 4: return scores_tile<4, kBf16Dot>(q, d, kt, s, ss);
    case 3: return scores_tile<3, kBf16Dot>(q, d, kt, s, ss);
    case 2: return scores_tile<2, kBf16Dot>(q, d, kt, s, ss);
    case 1: return scores_tile<1, kBf16Dot>(q, d, kt, s, ss);
    default: return;
  }
}

// acc_r[x0 .. x0 + 16 NV) += sum_{j < n} p_r[j] * v_j[...] for R rows (p row stride ps, acc row
// stride dv): each value chunk is loaded once for all R rows, the sums stay in registers.
template <int R, int NV, typename V>
inline void pv_block(const V* const* vals, int64_t n, const float* p, int64_t ps, float* acc,
                     int64_t dv, int64_t x0) {
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_loadu_ps(acc + r * dv + x0 + 16 * i);
  for (int64_t j = 0; j < n; ++j) {
    const V* vp = vals[j] + x0;
    __m512 v[NV];
    for (int i = 0; i < NV; ++i) v[i] = load16(vp + 16 * i);
    for (int r = 0; r < R; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * ps + j]);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(pj, v[i], a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + r * dv + x0 + 16 * i, a[r][i]);
}

template <int R, typename V>
inline void pv_rows(const V* const* vals, int64_t n, const float* p, int64_t ps, float* acc,
                    int64_t dv) {
  for (int64_t x0 = 0; x0 < dv; x0 += 64) {
    switch (std::min<int64_t>(64, dv - x0) / 16) {
      case 4: pv_block<R, 4>(vals, n, p, ps, acc, dv, x0); break;
      case 3: pv_block<R, 3>(vals, n, p, ps, acc, dv, x0); break;
      case 2: pv_block<R, 2>(vals, n, p, ps, acc, dv, x0); break;
      default: pv_block<R, 1>(vals, n, p, ps, acc, dv, x0); break;
    }
  }
}

template <typename V>
inline void pv_all_rows(const V* const* vals, int64_t n, const float* p, int64_t ps,
                        float* acc, int64_t dv, int64_t rows) {
  int64_t row = 0;
  for (; row + 4 <= rows; row += 4) pv_rows<4>(vals, n, p + row * ps, ps, acc + row * dv, dv);
  switch (rows - row) {
    case 3: return pv_rows<3>(vals, n, p + row * ps, ps, acc + row * dv, dv);
    case 2: return pv_rows<2>(vals, n, p + row * ps, ps, acc + row * dv, dv);
    case 1: return pv_rows<1>(vals, n, p + row * ps, ps, acc + row * dv, dv);
    default: return;
  }
}

template <typename Q, typename C>
struct Worker {
  static constexpr int64_t kDirectRows = 4;  // up to this many rows: per-key dot products
#if defined(__AVX512BF16__)
  static constexpr bool kBf16Cache =
      std::is_same_v<Q, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  static constexpr bool kBf16Cache = false;
#endif
  std::vector<float> qf, acc, m, l, s, kt, vbuf;
  std::vector<c10::BFloat16> qb;  // bf16 query rows, for the pair dot products
  std::vector<const C*> keys, vals;
  std::vector<const float*> vals_f;
  std::vector<__m512> tmp;

  void run(const Ctx& c, const Ptrs<Q, C>& p, const Item& w) {
    const int64_t nq = w.q1 - w.q0, rows = nq * c.group, d = c.d, dv = c.dv, bs = c.bs;
    const int64_t first_pos = first_position(c, w), last_pos = first_pos + nq - 1;
    const bool direct = rows <= kDirectRows;
    const bool bf16_dot = kBf16Cache && d % 32 == 0;
    const int64_t chunk_blocks = std::max<int64_t>(1, (direct ? 512 : 256) / bs);
    const int64_t ss = (chunk_blocks * bs + 15) / 16 * 16;  // score row stride
    qf.resize(rows * d);
    acc.assign(rows * dv, 0.f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.f);
    s.resize(rows * ss);
    tmp.resize(kDirectRows * 16);
    for (int64_t t = 0; t < nq; ++t)
      for (int64_t g = 0; g < c.group; ++g) {
        const Q* src = p.q + (w.q0 + t) * c.qs_t + (w.head * c.group + g) * c.qs_h;
        float* dst = qf.data() + (t * c.group + g) * d;
        for (int64_t x = 0; x < d; ++x) dst[x] = to_f(src[x]);
      }
    if (bf16_dot) {
      qb.resize(rows * d);
      for (int64_t i = 0; i < rows * d; ++i) qb[i] = c10::BFloat16(qf[i]);  // exact: qf came from bf16
    }
    const int64_t k_lo = c.window > 0 ? std::max<int64_t>(0, first_pos - c.window + 1) : 0;
    const int32_t* table = c.tables + w.req * c.table_stride;
    const int64_t last_block = last_pos / bs;
    for (int64_t b0 = k_lo / bs; b0 <= last_block; b0 += chunk_blocks) {
      const int64_t b1 = std::min(b0 + chunk_blocks, last_block + 1), base = b0 * bs;
      const int64_t n = std::min(b1 * bs, last_pos + 1) - base;
      gather_rows(c, p, table, b0, b1, n, w.head);
      if (direct) {
        if (bf16_dot) {
          scores_direct_rows<true>(rows, d, n, dv, ss);
        } else {
          scores_direct_rows<false>(rows, d, n, dv, ss);
        }
      } else {
        if (bf16_dot) {
          scores_tiled<true>(d, n, rows, ss);
        } else {
          scores_tiled<false>(d, n, rows, ss);
        }
      }
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t pos = first_pos + row / c.group;
        const int64_t hi = std::min(n, pos - base + 1);
        const int64_t lo = c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1 - base) : 0;
        const float alpha =
            softmax_step16(s.data() + row * ss, n, lo, hi, c.scale, c.softcap, m[row], l[row]);
        if (alpha != 1.f) {
          float* ar = acc.data() + row * dv;
#pragma omp simd
          for (int64_t x = 0; x < dv; ++x) ar[x] *= alpha;
        }
      }
      if (direct || std::is_same_v<C, float>) {
        pv_all_rows(vals.data(), n, s.data(), ss, acc.data(), dv, rows);
      } else {  // many rows: convert the chunk's values to fp32 once, not once per row tile
        vbuf.resize(n * dv);
        vals_f.resize(n);
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t x = 0; x < dv; x += 16)
            _mm512_storeu_ps(vbuf.data() + j * dv + x, load16(vals[j] + x));
          vals_f[j] = vbuf.data() + j * dv;
        }
        pv_all_rows(vals_f.data(), n, s.data(), ss, acc.data(), dv, rows);
      }
    }
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t t = row / c.group, hd = w.head * c.group + row % c.group;
      finish_row(acc.data() + row * dv, dv, m[row], l[row],
                 c.sinks != nullptr ? c.sinks + hd : nullptr,
                 p.o + (w.q0 + t) * c.os_t + hd * c.os_h);
    }
  }

  // keys[j], vals[j]: where key base + j of the chunk (blocks [b0, b1)) lives in the cache.
  void gather_rows(const Ctx& c, const Ptrs<Q, C>& p, const int32_t* table, int64_t b0,
                   int64_t b1, int64_t n, int64_t head) {
    keys.resize(n);
    vals.resize(n);
    int64_t j = 0;
    for (int64_t b = b0; b < b1; ++b) {
      const C* kp = p.k + table[b] * c.kb + head * c.kh;
      const C* vp = p.v + table[b] * c.vb + head * c.vh;
      for (int64_t i = 0; i < c.bs && j < n; ++i, ++j) {
        keys[j] = kp + i * c.ks;
        vals[j] = vp + i * c.vs;
      }
    }
  }

  template <bool kBf16Dot>
  void scores_direct_rows(int64_t rows, int64_t d, int64_t n, int64_t dv, int64_t ss) {
    const auto args = std::make_tuple(qf.data(), qb.data(), d, keys.data(), vals.data(), dv, n,
                                      s.data(), ss, tmp.data());
    switch (rows) {
      case 4: return std::apply(scores_direct<4, kBf16Dot, C>, args);
      case 3: return std::apply(scores_direct<3, kBf16Dot, C>, args);
      case 2: return std::apply(scores_direct<2, kBf16Dot, C>, args);
      default: return std::apply(scores_direct<1, kBf16Dot, C>, args);
    }
  }

  // Scores of all rows against the chunk's keys, 16 keys transposed at a time: to fp32, or
  // (bf16 dot products) as 32-bit pairs of bf16 dims.
  template <bool kBf16Dot>
  void scores_tiled(int64_t d, int64_t n, int64_t rows, int64_t ss) {
    kt.resize(d * 16);
    constexpr int64_t step = kBf16Dot ? 32 : 16;  // dims per transposed 16 x 16 block
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t mk = std::min<int64_t>(16, n - j0);
      for (int64_t x0 = 0; x0 < d; x0 += step) {
        __m512 r[16];
        for (int64_t jj = 0; jj < 16; ++jj) {
          if (jj >= mk) {
            r[jj] = _mm512_setzero_ps();
          } else if constexpr (kBf16Dot) {
            r[jj] = _mm512_castsi512_ps(load_pairs(keys[j0 + jj] + x0));
          } else {
            r[jj] = load16(keys[j0 + jj] + x0);
          }
        }
        transpose16(r);
        for (int i = 0; i < 16; ++i)
          _mm512_storeu_ps(kt.data() + (x0 / (step / 16) + i) * 16, r[i]);
      }
      if constexpr (kBf16Dot) {
        scores_tile_rows<true>(qb.data(), d, kt.data(), s.data() + j0, ss, rows);
      } else {
        scores_tile_rows<false>(qf.data(), d, kt.data(), s.data() + j0, ss, rows);
      }
    }
  }
};

}  // namespace pd_attn::avx512

#endif  // __AVX512F__
