// AVX-512 micro-kernels of the attention path (attention_avx512.h): scores of a few rows by
// per-key dot products, of many rows against transposed keys, and P.V in register tiles.
#pragma once
#if defined(__AVX512F__)

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <tuple>
#include <type_traits>

#include "attention_avx512_vec.h"

namespace pd_attn::avx512 {

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

// s[r * ss + j] for R rows (fp32, row stride d) against 16 keys stored transposed as fp32
// (kt[x * 16 + j]).
template <int R>
inline void scores_tile(const float* q, int64_t d, const float* kt, float* s, int64_t ss) {
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t x = 0; x < d; ++x) {
    const __m512 kx = _mm512_loadu_ps(kt + x * 16);
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + x]), kx, a[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * ss, a[r]);
}

// f(std::integral_constant<int, R>{}, row) over [0, rows): eight rows a call, then the rest.
template <typename F>
inline void by_row_groups(int64_t rows, F&& f) {
  int64_t row = 0;
  for (; row + 8 <= rows; row += 8) f(std::integral_constant<int, 8>{}, row);
  switch (rows - row) {
    case 7: return f(std::integral_constant<int, 7>{}, row);
    case 6: return f(std::integral_constant<int, 6>{}, row);
    case 5: return f(std::integral_constant<int, 5>{}, row);
    case 4: return f(std::integral_constant<int, 4>{}, row);
    case 3: return f(std::integral_constant<int, 3>{}, row);
    case 2: return f(std::integral_constant<int, 2>{}, row);
    case 1: return f(std::integral_constant<int, 1>{}, row);
    default: return;
  }
}

inline void scores_tile_rows(const float* q, int64_t d, const float* kt, float* s, int64_t ss,
                             int64_t rows) {
  by_row_groups(rows, [&](auto r, int64_t row) {
    scores_tile<decltype(r)::value>(q + row * d, d, kt, s + row * ss, ss);
  });
}

// The same for bf16 rows (row stride d) against 16 bf16 keys stored as transposed pairs
// (kp[i * 16 + j] = dims 2i and 2i + 1 of key j): one vdpbf16ps per pair of dims, exact
// products summed in fp32. Where the CPU issues it at the FMA's rate (AMD Zen 4) that is twice
// the multiply-adds an instruction; Intel's cores issue it at half the rate of their two FMA
// ports, so there the fp32 tile is as fast and stays (Worker::kPairTiles).
template <int R>
inline void scores_tile_pairs(const c10::BFloat16* qb, int64_t d, const uint32_t* kp, float* s,
                              int64_t ss) {
  const uint32_t* q = reinterpret_cast<const uint32_t*>(qb);
  const int64_t pairs = d / 2;
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512i kx = _mm512_loadu_si512(kp + i * 16);
    for (int r = 0; r < R; ++r)
      a[r] = dot_pairs(a[r], _mm512_set1_epi32(static_cast<int>(q[r * pairs + i])), kx);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * ss, a[r]);
}

inline void scores_tile_pairs_rows(const c10::BFloat16* qb, int64_t d, const uint32_t* kp,
                                   float* s, int64_t ss, int64_t rows) {
  by_row_groups(rows, [&](auto r, int64_t row) {
    scores_tile_pairs<decltype(r)::value>(qb + row * d, d, kp, s + row * ss, ss);
  });
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

// Which keys of a chunk (starting at position base, n keys) rows see: a row's query token
// sits at first_pos + row / group (rows in position order).
struct RowSpan {
  int64_t first_pos, group, window, base, n;
  int64_t pos(int64_t row) const { return first_pos + row / group; }
  int64_t key_end(int64_t row) const { return std::min(n, pos(row) - base + 1); }
  int64_t key_begin(int64_t row) const {
    return window > 0 ? std::max<int64_t>(0, pos(row) - window + 1 - base) : 0;
  }
};

// P.V for all rows, four at a time, each tile over only the keys its rows can see (the
// causal diagonal and the window's edge leave the rest of the chunk's p at zero).
template <typename V>
inline void pv_all_rows(const V* const* vals, const RowSpan& span, const float* p, int64_t ps,
                        float* acc, int64_t dv, int64_t rows) {
  for (int64_t row = 0; row < rows; row += 4) {
    const int64_t nr = std::min<int64_t>(4, rows - row);
    const int64_t ja = span.key_begin(row), jb = span.key_end(row + nr - 1);
    if (jb <= ja) continue;
    const V* const* v = vals + ja;
    const float* pr = p + row * ps + ja;
    float* ar = acc + row * dv;
    switch (nr) {
      case 4: pv_rows<4>(v, jb - ja, pr, ps, ar, dv); break;
      case 3: pv_rows<3>(v, jb - ja, pr, ps, ar, dv); break;
      case 2: pv_rows<2>(v, jb - ja, pr, ps, ar, dv); break;
      default: pv_rows<1>(v, jb - ja, pr, ps, ar, dv); break;
    }
  }
}

}  // namespace pd_attn::avx512

#endif  // __AVX512F__
