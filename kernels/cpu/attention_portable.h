// The portable path: plain C++ the compiler vectorises, for any head dim and any CPU. One work
// item walks its visible blocks with an online softmax per block (fp32), converting half
// precision and FP8 blocks to fp32 buffers (FP8 times its block's per-head scale). The AVX-512 path
// (attention_avx512.h) takes the shapes it supports; this one takes the rest.
#pragma once

#include <vector>

#include "attention_common.h"

namespace pd_attn::portable {

// One block's keys (valid rows only) and values as fp32, read in place for fp32 caches.
template <typename T>
struct BlockView {
  std::vector<float> kbuf, vbuf;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t k_stride = 0, v_stride = 0;

  // ksc/vsc: the block's K/V scale for this head (FP8 caches; 1 otherwise).
  void load(const T* kp, const T* vp, int64_t ks, int64_t vs, int64_t n, int64_t d,
            int64_t dv, float ksc = 1.f, float vsc = 1.f) {
    kbuf.resize(n * d);
    vbuf.resize(n * dv);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t x = 0; x < d; ++x) kbuf[j * d + x] = to_f(kp[j * ks + x]) * ksc;
      for (int64_t x = 0; x < dv; ++x) vbuf[j * dv + x] = to_f(vp[j * vs + x]) * vsc;
    }
    k = kbuf.data();
    v = vbuf.data();
    k_stride = d;
    v_stride = dv;
  }
};

template <>
inline void BlockView<float>::load(const float* kp, const float* vp, int64_t ks, int64_t vs,
                                   int64_t, int64_t, int64_t, float, float) {
  k = kp;
  v = vp;
  k_stride = ks;
  v_stride = vs;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t x = 0; x < n; ++x) s += a[x] * b[x];
  return s;
}

// s[r * BS + j] = q_r . k_j for R rows against a block's BS keys stored transposed
// (kt[x * BS + j]): each key column is loaded once for all R rows, the R x BS accumulators
// stay in registers across the head dim.
template <int BS, int R>
inline void scores_rows(const float* __restrict q, int64_t d, const float* __restrict kt,
                        float* __restrict s) {
  float a[R][BS] = {};
  for (int64_t x = 0; x < d; ++x) {
    const float* kx = kt + x * BS;
    for (int r = 0; r < R; ++r) {
      const float qx = q[r * d + x];
#pragma omp simd
      for (int j = 0; j < BS; ++j) a[r][j] += qx * kx[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < BS; ++j) s[r * BS + j] = a[r][j];
}

// acc_r[x] += sum_{j < n} p_r[j] * v_j[x] for R rows (p row stride ps, acc row stride dv),
// 16 output lanes at a time: each value chunk is loaded once for all R rows.
template <int R>
inline void pv_rows(const float* __restrict p, int64_t ps, int64_t n, const float* __restrict v,
                    int64_t v_stride, int64_t dv, float* __restrict acc) {
  int64_t x0 = 0;
  for (; x0 + 16 <= dv; x0 += 16) {
    float a[R][16];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 16; ++i) a[r][i] = acc[r * dv + x0 + i];
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v + j * v_stride + x0;
      for (int r = 0; r < R; ++r) {
        const float pj = p[r * ps + j];
#pragma omp simd
        for (int i = 0; i < 16; ++i) a[r][i] += pj * vj[i];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 16; ++i) acc[r * dv + x0 + i] = a[r][i];
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t x = x0; x < dv; ++x) acc[r * dv + x] += p[r * ps + j] * v[j * v_stride + x];
}

template <typename Q, typename C>
struct Worker {
  std::vector<float> qf, acc, m, l, s, kt;
  BlockView<C> blk;

  void run(const Ctx& c, const Ptrs<Q, C>& p, const Item& w) {
    const int64_t nq = w.q1 - w.q0, rows = nq * c.group, d = c.d, dv = c.dv, bs = c.bs;
    const int64_t first_pos = first_position(c, w), last_pos = first_pos + nq - 1;
    qf.resize(rows * d);
    acc.assign(rows * dv, 0.f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.f);
    s.resize(rows * bs);
    for (int64_t t = 0; t < nq; ++t)
      for (int64_t g = 0; g < c.group; ++g) {
        const Q* src = p.q + (w.q0 + t) * c.qs_t + (w.head * c.group + g) * c.qs_h;
        float* dst = qf.data() + (t * c.group + g) * d;
        for (int64_t x = 0; x < d; ++x) dst[x] = to_f(src[x]);
      }
    const int64_t k_lo = c.window > 0 ? std::max<int64_t>(0, first_pos - c.window + 1) : 0;
    const int32_t* table = c.tables + w.req * c.table_stride;
    for (int64_t b = k_lo / bs; b * bs <= last_pos; ++b) {
      const int64_t base = b * bs, n = std::min(bs, last_pos + 1 - base);
      const int64_t phys = table[b];
      const int64_t si = phys * c.sb + w.head * c.sh;
      blk.load(p.k + phys * c.kb + w.head * c.kh, p.v + phys * c.vb + w.head * c.vh, c.ks,
               c.vs, n, d, dv, c.kscale ? c.kscale[si] : 1.f, c.vscale ? c.vscale[si] : 1.f);
      // Raw scores of every row against the block's n keys: with many rows against the keys
      // transposed, four rows at a time; with few (decode), dot products.
      if (rows >= 4 && bs == 16) {
        kt.assign(d * bs, 0.f);
        for (int64_t j = 0; j < n; ++j)
          for (int64_t x = 0; x < d; ++x) kt[x * bs + j] = blk.k[j * blk.k_stride + x];
        int64_t row = 0;
        for (; row + 4 <= rows; row += 4)
          scores_rows<16, 4>(qf.data() + row * d, d, kt.data(), s.data() + row * bs);
        for (; row < rows; ++row)
          scores_rows<16, 1>(qf.data() + row * d, d, kt.data(), s.data() + row * bs);
      } else {
        for (int64_t row = 0; row < rows; ++row)
          for (int64_t j = 0; j < n; ++j)
            s[row * bs + j] = dot(qf.data() + row * d, blk.k + j * blk.k_stride, d);
      }
      for (int64_t row = 0; row < rows; ++row) {  // online softmax over the visible keys
        const int64_t pos = first_pos + row / c.group;
        const int64_t hi = std::min(n, pos - base + 1);
        const int64_t lo = c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1 - base) : 0;
        const float alpha =
            softmax_step(s.data() + row * bs, n, lo, hi, c.scale, c.softcap, m[row], l[row]);
        if (alpha != 1.f) {
          float* ar = acc.data() + row * dv;
#pragma omp simd
          for (int64_t x = 0; x < dv; ++x) ar[x] *= alpha;
        }
      }
      int64_t row = 0;  // values, four rows at a time
      for (; row + 4 <= rows; row += 4)
        pv_rows<4>(s.data() + row * bs, bs, n, blk.v, blk.v_stride, dv, acc.data() + row * dv);
      for (; row < rows; ++row)
        pv_rows<1>(s.data() + row * bs, bs, n, blk.v, blk.v_stride, dv, acc.data() + row * dv);
    }
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t t = row / c.group, hd = w.head * c.group + row % c.group;
      finish_row(acc.data() + row * dv, dv, m[row], l[row],
                 c.sinks != nullptr ? c.sinks + hd : nullptr,
                 p.o + (w.q0 + t) * c.os_t + hd * c.os_h);
    }
  }
};

}  // namespace pd_attn::portable
