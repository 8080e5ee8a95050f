// What the paged attention paths share: one call's geometry, a work item, and the softmax
// helpers. See paged_attention.cpp for the semantics (positions, masks, soft-cap, sinks).
#pragma once

#include <algorithm>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <limits>

namespace pd_attn {

// One call's shapes, options and strides (elements), the same for every work item.
struct Ctx {
  int64_t hq, hkv, group, d, dv, bs, window;
  float scale, softcap;
  const float* sinks;  // one logit per query head, or nullptr
  const int32_t *lens, *qsl, *tables;
  int64_t table_stride;
  int64_t qs_t, qs_h, os_t, os_h, kb, ks, kh, vb, vs, vh;
  // FP8 caches: per block and head scales of K and V (element strides sb, sh), else nullptr.
  const float *kscale = nullptr, *vscale = nullptr;
  int64_t sb = 0, sh = 0;
};

template <typename Q, typename C>
struct Ptrs {
  const Q* q;
  Q* o;
  const C* k;
  const C* v;
};

// One request's query tokens [q0, q1) against one KV head: its rows are the tokens times the
// query heads sharing that head (row = t * group + g; query head = head * group + g).
struct Item {
  int64_t req, head, q0, q1;
};

// The position of the item's first query token (the request's new tokens end its context).
inline int64_t first_position(const Ctx& c, const Item& w) {
  return c.lens[w.req] - (c.qsl[w.req + 1] - c.qsl[w.req]) + (w.q0 - c.qsl[w.req]);
}

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// exp(x) for x <= 0 in place, vectorisable (std::exp is a scalar call per element): Cody-Waite
// reduction x = n ln2 + r, |r| <= ln2/2, and a degree-7 polynomial, within ~2 ulp of expf.
inline void exp_inplace(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] > -87.0f ? x[i] : -87.0f;
    // Round to nearest by the 1.5 * 2^23 trick (std::nearbyint is a call gcc won't vectorise).
    const float k = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;
    const float r = (v - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
    float p = 1.0f / 5040.f;
    p = p * r + 1.0f / 720.f;
    p = p * r + 1.0f / 120.f;
    p = p * r + 1.0f / 24.f;
    p = p * r + 1.0f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);  // std::bit_cast is C++20; torch 2.11 builds C++17
    x[i] = p * scale;
  }
}

// One row's online-softmax step over keys [0, n) of a score row (raw q.k), of which [lo, hi)
// are visible: scale, soft-cap, new running max m, p = exp(s - m) in place (0 where hidden),
// l = l * alpha + sum(p). Returns alpha, the factor the row's accumulator must be scaled by.
inline float softmax_step(float* s, int64_t n, int64_t lo, int64_t hi, float scale,
                          float softcap, float& m, float& l) {
  if (hi <= lo) {
    std::fill(s, s + n, 0.f);
    return 1.f;
  }
  float mx = m;
  if (softcap > 0.f) {
    for (int64_t j = lo; j < hi; ++j) s[j] = std::tanh(s[j] * scale / softcap) * softcap;
  } else {
#pragma omp simd
    for (int64_t j = lo; j < hi; ++j) s[j] *= scale;
  }
#pragma omp simd reduction(max : mx)
  for (int64_t j = lo; j < hi; ++j) mx = s[j] > mx ? s[j] : mx;  // (std::max stays scalar)
  const float alpha = std::exp(m - mx);
#pragma omp simd
  for (int64_t j = lo; j < hi; ++j) s[j] -= mx;
  exp_inplace(s + lo, hi - lo);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = lo; j < hi; ++j) sum += s[j];
  std::fill(s, s + lo, 0.f);
  std::fill(s + hi, s + n, 0.f);
  l = l * alpha + sum;
  m = mx;
  return alpha;
}

// out row = acc / denominator, with the sink as one more logit in the denominator.
template <typename Q>
inline void finish_row(const float* acc, int64_t dv, float m, float l, const float* sink,
                       Q* dst) {
  float denom = l, mult = 1.f;
  if (sink != nullptr) {  // rescaled to the larger of the row's max and the sink
    const float mx = std::max(m, *sink);
    mult = std::exp(m - mx);
    denom = l * mult + std::exp(*sink - mx);
  }
  const float inv = mult / denom;
  for (int64_t x = 0; x < dv; ++x) dst[x] = static_cast<Q>(acc[x] * inv);
}

}  // namespace pd_attn
