// Paged attention on CPU: every request of a batch (decode tokens and prefill chunks with a
// cached prefix alike) attends over K/V read in place from the paged cache's blocks.
//
// One work item = (request, KV head, tile of up to TILE_Q query tokens); its rows are the tile's
// queries times the query heads sharing that KV head (GQA). Each item walks only the blocks its
// queries can see (causal, and the sliding window's lower edge), with an online softmax in fp32,
// so no request's context is ever copied out of the cache. Items run on ATen's thread pool (the
// engine's torch.set_num_threads), one OpenMP runtime for the whole process.
//
// Query i of a request with q_len new tokens and seq_len context sits at position
// seq_len - q_len + i and sees keys k with k <= pos and (window == 0 or k > pos - window).
// Scores: q.k * scale, then soft-cap cap * tanh(s / cap), then mask; sinks join the softmax
// denominator as one logit per head and carry no value (the order of the torch reference).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t TILE_Q = 16;  // query tokens per work item (rows = TILE_Q * group)

struct Item {
  int64_t req, head, q0, q1;
};

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// One block's keys (valid rows only) and values as fp32, read in place for fp32 caches.
template <typename T>
struct BlockView {
  std::vector<float> kbuf, vbuf;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t k_stride = 0, v_stride = 0;

  void load(const T* kp, const T* vp, int64_t ks, int64_t vs, int64_t n, int64_t d,
            int64_t dv) {
    kbuf.resize(n * d);
    vbuf.resize(n * dv);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t x = 0; x < d; ++x) kbuf[j * d + x] = to_f(kp[j * ks + x]);
      for (int64_t x = 0; x < dv; ++x) vbuf[j * dv + x] = to_f(vp[j * vs + x]);
    }
    k = kbuf.data();
    v = vbuf.data();
    k_stride = d;
    v_stride = dv;
  }
};

template <>
void BlockView<float>::load(const float* kp, const float* vp, int64_t ks, int64_t vs, int64_t,
                            int64_t, int64_t) {
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
    x[i] = p * std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
  }
}

template <typename Q, typename C>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
         const at::Tensor& value_cache, const at::Tensor& block_tables,
         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
         double scale_d, int64_t window, double softcap_d, const float* sinks) {
  const int64_t num_reqs = seq_lens.size(0);
  const int64_t hq = query.size(1), d = query.size(2);
  const int64_t hkv = key_cache.size(2), bs = key_cache.size(1), dv = value_cache.size(3);
  const int64_t group = hq / hkv;
  const float scale = static_cast<float>(scale_d), softcap = static_cast<float>(softcap_d);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const Q* q_ptr = query.data_ptr<Q>();
  Q* o_ptr = out.data_ptr<Q>();
  const C* k_ptr = key_cache.data_ptr<C>();
  const C* v_ptr = value_cache.data_ptr<C>();
  const int64_t qs_t = query.stride(0), qs_h = query.stride(1);
  const int64_t os_t = out.stride(0), os_h = out.stride(1);
  const int64_t kb = key_cache.stride(0), ks = key_cache.stride(1), kh = key_cache.stride(2);
  const int64_t vb = value_cache.stride(0), vs = value_cache.stride(1),
                vh = value_cache.stride(2);

  std::vector<Item> items;
  for (int64_t r = 0; r < num_reqs; ++r)
    for (int64_t q0 = qsl[r]; q0 < qsl[r + 1]; q0 += TILE_Q)
      for (int64_t h = 0; h < hkv; ++h)
        items.push_back({r, h, q0, std::min<int64_t>(q0 + TILE_Q, qsl[r + 1])});

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf, acc, m, l, s, kt;
    BlockView<C> blk;
    for (int64_t it = lo; it < hi; ++it) {
      const Item& w = items[it];
      const int64_t nq = w.q1 - w.q0, rows = nq * group;
      const int64_t seq_len = lens[w.req];
      const int64_t first_pos = seq_len - (qsl[w.req + 1] - qsl[w.req]) + (w.q0 - qsl[w.req]);
      qf.assign(rows * d, 0.f);
      acc.assign(rows * dv, 0.f);
      m.assign(rows, -std::numeric_limits<float>::infinity());
      l.assign(rows, 0.f);
      s.resize(rows * bs);
      // row = query t (0..nq) * group + g; query head = head * group + g
      for (int64_t t = 0; t < nq; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const Q* src = q_ptr + (w.q0 + t) * qs_t + (w.head * group + g) * qs_h;
          float* dst = qf.data() + (t * group + g) * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = to_f(src[x]);
        }
      const int64_t last_pos = first_pos + nq - 1;
      const int64_t k_lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      const int32_t* table = tables + w.req * table_stride;
      for (int64_t b = k_lo / bs; b * bs <= last_pos; ++b) {
        const int64_t base = b * bs, n = std::min(bs, last_pos + 1 - base);
        const int64_t phys = table[b];
        blk.load(k_ptr + phys * kb + w.head * kh, v_ptr + phys * vb + w.head * vh, ks, vs, n,
                 d, dv);
        // 1. Raw scores of every row against the block's n keys: with many rows against the
        // keys transposed, four rows at a time; with few (decode), dot products.
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
        // 2. Online softmax per row over its visible keys [lo, hi); the rest weigh 0.
        for (int64_t row = 0; row < rows; ++row) {
          const int64_t pos = first_pos + row / group;
          const int64_t hi = std::min(n, pos - base + 1);
          const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1 - base) : 0;
          float* sr = s.data() + row * bs;
          if (hi <= lo) {
            for (int64_t j = 0; j < n; ++j) sr[j] = 0.f;
            continue;
          }
          float mx = m[row];
          for (int64_t j = lo; j < hi; ++j) {
            float v = sr[j] * scale;
            if (softcap > 0.f) v = std::tanh(v / softcap) * softcap;
            sr[j] = v;
            mx = std::max(mx, v);
          }
          const float alpha = std::exp(m[row] - mx);
          for (int64_t j = lo; j < hi; ++j) sr[j] -= mx;
          exp_inplace(sr + lo, hi - lo);
          float sum = 0.f;
          for (int64_t j = lo; j < hi; ++j) sum += sr[j];
          for (int64_t j = 0; j < lo; ++j) sr[j] = 0.f;
          for (int64_t j = hi; j < n; ++j) sr[j] = 0.f;
          l[row] = l[row] * alpha + sum;
          m[row] = mx;
          if (alpha != 1.f) {
            float* ar = acc.data() + row * dv;
#pragma omp simd
            for (int64_t x = 0; x < dv; ++x) ar[x] *= alpha;
          }
        }
        // 3. Values, four rows at a time.
        int64_t row = 0;
        for (; row + 4 <= rows; row += 4)
          pv_rows<4>(s.data() + row * bs, bs, n, blk.v, blk.v_stride, dv, acc.data() + row * dv);
        for (; row < rows; ++row)
          pv_rows<1>(s.data() + row * bs, bs, n, blk.v, blk.v_stride, dv, acc.data() + row * dv);
      }
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t t = row / group, hd = w.head * group + row % group;
        float denom = l[row];
        float mult = 1.f;
        if (sinks != nullptr) {  // one more logit in the denominator, rescaled to the max
          const float mx = std::max(m[row], sinks[hd]);
          mult = std::exp(m[row] - mx);
          denom = l[row] * mult + std::exp(sinks[hd] - mx);
        }
        const float inv = mult / denom;
        const float* ar = acc.data() + row * dv;
        Q* dst = o_ptr + (w.q0 + t) * os_t + hd * os_h;
        for (int64_t x = 0; x < dv; ++x) dst[x] = static_cast<Q>(ar[x] * inv);
      }
    }
  });
}

template <typename Q>
void dispatch_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& kc,
                    const at::Tensor& vc, const at::Tensor& bt, const at::Tensor& sl,
                    const at::Tensor& qsl, double scale, int64_t window,
                    double softcap, const float* sinks) {
  switch (kc.scalar_type()) {
    case at::kFloat:
      return run<Q, float>(out, query, kc, vc, bt, sl, qsl, scale, window, softcap, sinks);
    case at::kBFloat16:
      return run<Q, c10::BFloat16>(out, query, kc, vc, bt, sl, qsl, scale, window,
                                   softcap, sinks);
    case at::kHalf:
      return run<Q, c10::Half>(out, query, kc, vc, bt, sl, qsl, scale, window, softcap,
                               sinks);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported cache dtype ", kc.scalar_type());
  }
}

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, int64_t window, double softcap,
                     const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query/out: [tokens, heads, dim]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4,
              "key/value cache: [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 &&
                  value_cache.stride(3) == 1,
              "paged_attention: the last dim must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query and key head dims differ");
  TORCH_CHECK(out.size(2) == value_cache.size(3) && out.size(1) == query.size(1),
              "out: [tokens, heads, value dim]");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out and query dtypes differ");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "K and V dtypes differ");
  for (const at::Tensor* t : {&seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "seq lens and query starts: contiguous int32");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1,
              "block tables: int32 [requests, blocks], rows contiguous");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1, "query_start_loc: num_reqs + 1");
  TORCH_CHECK(block_tables.size(0) >= seq_lens.size(0), "block_tables: a row per request");
  const float* sink_ptr = nullptr;
  at::Tensor sinks_f;
  if (sinks.has_value()) {
    sinks_f = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks_f.numel() == query.size(1), "sinks: one per query head");
    sink_ptr = sinks_f.data_ptr<float>();
  }
  switch (query.scalar_type()) {
    case at::kFloat:
      return dispatch_cache<float>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                   query_start_loc, scale, window, softcap, sink_ptr);
    case at::kBFloat16:
      return dispatch_cache<c10::BFloat16>(out, query, key_cache, value_cache, block_tables,
                                           seq_lens, query_start_loc, scale, window,
                                           softcap, sink_ptr);
    case at::kHalf:
      return dispatch_cache<c10::Half>(out, query, key_cache, value_cache, block_tables,
                                       seq_lens, query_start_loc, scale, window,
                                       softcap, sink_ptr);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported query dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pd_cluster_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "float scale, int window, float softcap, Tensor? sinks) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
