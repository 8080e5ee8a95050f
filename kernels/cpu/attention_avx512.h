// The AVX-512 path, for head dims (key and value) that are multiples of 16, any block size.
//
// An item's visible keys are taken in chunks of whole blocks (up to 512 keys for decode, 256
// for prefill tiles): all scores of the chunk first, then one softmax step per row, then P.V,
// so the running max and the accumulator are rescaled once per chunk, not per block. Keys and
// values are read in place through per-key row pointers (half precision converted in
// registers; values converted once per chunk for many rows). Two ways to get the scores:
//  * few rows per KV head (decode: group <= 8): each key's dot products with the head's rows,
//    reduced 16 keys at a time by one transpose-add tree (with a bf16 query and cache and
//    AVX512-BF16, pair dot products: vdpbf16ps, exact products, fp32 sums, no conversion);
//    decode is bound by memory, so the keys and values ahead are prefetched;
//  * many rows (prefill tiles, large groups): 16 keys transposed to fp32 once, then the scores
//    of the rows that see them by broadcast FMAs, eight rows at a time (a bf16 query and cache
//    on an AMD CPU with AVX512-BF16: transposed as bf16 pairs, and vdpbf16ps instead).
// Softmax and P.V are fp32 always.
#pragma once
#if defined(__AVX512F__)

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <tuple>
#include <type_traits>
#include <vector>

#include "attention_avx512_tiles.h"
#include "attention_avx512_vec.h"
#include "attention_common.h"

namespace pd_attn::avx512 {

template <typename Q, typename C>
struct Worker {
  // Up to this many rows per KV head: per-key dot products (measured on GQA decode with groups
  // 7-8: 1.4x faster than transposed tiles in bf16; at 16 rows it is a wash, or slower in fp32).
  static constexpr int64_t kDirectRows = 8;
#if defined(__AVX512BF16__)
  static constexpr bool kBf16Cache =
      std::is_same_v<Q, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  static constexpr bool kBf16Cache = false;
#endif
  // Prefill tiles by bf16 pair dot products (scores_tile_pairs), where they pay. Set while
  // the library's constructors run, perhaps before libgcc's CPU probe: it is run here first.
  static inline const bool kPairTiles = kBf16Cache && [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") > 0;
  }();
  std::vector<float> qf, acc, m, l, s, kt, vbuf;
  std::vector<uint32_t> kp;  // 16 keys as transposed bf16 pairs
  std::vector<c10::BFloat16> qb;  // bf16 query rows, for the pair dot products
  std::vector<const C*> keys, vals;
  std::vector<const float*> vals_f;
  std::vector<__m512> tmp;

  void run(const Ctx& c, const Ptrs<Q, C>& p, const Item& w) {
    const int64_t nq = w.q1 - w.q0, rows = nq * c.group, d = c.d, dv = c.dv, bs = c.bs;
    const int64_t first_pos = first_position(c, w), last_pos = first_pos + nq - 1;
    const bool direct = rows <= kDirectRows;
    const bool bf16_dot = kBf16Cache && direct && d % 32 == 0;
    const bool pair_tiles = kPairTiles && !direct && d % 32 == 0;
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
    if (bf16_dot || pair_tiles) {
      qb.resize(rows * d);
      // exact: qf holds bf16 values
      for (int64_t i = 0; i < rows * d; ++i) qb[i] = c10::BFloat16(qf[i]);
    }
    const int64_t k_lo = c.window > 0 ? std::max<int64_t>(0, first_pos - c.window + 1) : 0;
    const int32_t* table = c.tables + w.req * c.table_stride;
    const int64_t last_block = last_pos / bs;
    for (int64_t b0 = k_lo / bs; b0 <= last_block; b0 += chunk_blocks) {
      const int64_t b1 = std::min(b0 + chunk_blocks, last_block + 1), base = b0 * bs;
      const int64_t n = std::min(b1 * bs, last_pos + 1) - base;
      gather_rows(c, p, table, b0, b1, n, w.head);
      const RowSpan span{first_pos, c.group, c.window, base, n};
      if (direct) {
        if (bf16_dot) {
          scores_direct_rows<true>(rows, d, n, dv, ss);
        } else {
          scores_direct_rows<false>(rows, d, n, dv, ss);
        }
      } else {
        scores_tiled(d, span, rows, ss, pair_tiles);
      }
      for (int64_t row = 0; row < rows; ++row) {
        const float alpha = softmax_step16(s.data() + row * ss, n, span.key_begin(row),
                                           span.key_end(row), c.scale, c.softcap, m[row],
                                           l[row]);
        if (alpha != 1.f) {
          float* ar = acc.data() + row * dv;
#pragma omp simd
          for (int64_t x = 0; x < dv; ++x) ar[x] *= alpha;
        }
      }
      if (direct || std::is_same_v<C, float>) {
        pv_all_rows(vals.data(), span, s.data(), ss, acc.data(), dv, rows);
      } else {  // many rows: convert the chunk's values to fp32 once, not once per row tile
        vbuf.resize(n * dv);
        vals_f.resize(n);
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t x = 0; x < dv; x += 16)
            _mm512_storeu_ps(vbuf.data() + j * dv + x, load16(vals[j] + x));
          vals_f[j] = vbuf.data() + j * dv;
        }
        pv_all_rows(vals_f.data(), span, s.data(), ss, acc.data(), dv, rows);
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
      case 8: return std::apply(scores_direct<8, kBf16Dot, C>, args);
      case 7: return std::apply(scores_direct<7, kBf16Dot, C>, args);
      case 6: return std::apply(scores_direct<6, kBf16Dot, C>, args);
      case 5: return std::apply(scores_direct<5, kBf16Dot, C>, args);
      case 4: return std::apply(scores_direct<4, kBf16Dot, C>, args);
      case 3: return std::apply(scores_direct<3, kBf16Dot, C>, args);
      case 2: return std::apply(scores_direct<2, kBf16Dot, C>, args);
      default: return std::apply(scores_direct<1, kBf16Dot, C>, args);
    }
  }

  // Scores of the rows that see any of each 16 keys (the causal diagonal and the window's edge
  // skip the rest: softmax_step16 never reads those groups), the keys transposed to fp32 first.
  void scores_tiled(int64_t d, const RowSpan& span, int64_t rows, int64_t ss, bool pairs) {
    kt.resize(d * 16);
    kp.resize(d * 8);
    const int64_t n = span.n;
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t mk = std::min<int64_t>(16, n - j0);
      // rows [r0, r1): the first whose token reaches key j0, the last whose window starts
      // before key j0 + 16
      const int64_t r0 = std::clamp<int64_t>((span.base + j0 - span.first_pos) * span.group,
                                             0, rows);
      const int64_t r1 = span.window > 0
          ? std::clamp<int64_t>((span.base + j0 + 15 + span.window - span.first_pos) *
                                    span.group, 0, rows)
          : rows;
      if (r0 >= r1) continue;
      if constexpr (kBf16Cache) {
        if (pairs) {  // 16 pairs (32 dims) of 16 keys a transpose, as 32-bit lanes
          for (int64_t x0 = 0; x0 < d / 2; x0 += 16) {
            __m512 r[16];
            for (int64_t jj = 0; jj < 16; ++jj)
              r[jj] = jj < mk ? _mm512_castsi512_ps(_mm512_loadu_si512(keys[j0 + jj] + 2 * x0))
                              : _mm512_setzero_ps();
            transpose16(r);
            for (int i = 0; i < 16; ++i)
              _mm512_storeu_ps(reinterpret_cast<float*>(kp.data() + (x0 + i) * 16), r[i]);
          }
          scores_tile_pairs_rows(qb.data() + r0 * d, d, kp.data(), s.data() + r0 * ss + j0, ss,
                                 r1 - r0);
          continue;
        }
      }
      for (int64_t x0 = 0; x0 < d; x0 += 16) {
        __m512 r[16];
        for (int64_t jj = 0; jj < 16; ++jj)
          r[jj] = jj < mk ? load16(keys[j0 + jj] + x0) : _mm512_setzero_ps();
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt.data() + (x0 + i) * 16, r[i]);
      }
      scores_tile_rows(qf.data() + r0 * d, d, kt.data(), s.data() + r0 * ss + j0, ss, r1 - r0);
    }
  }
};

}  // namespace pd_attn::avx512

#endif  // __AVX512F__
