// The checks paged_attention runs on its inputs before any work item reads the cache: the
// kernel indexes the cache by the block tables and lengths it is given, so bad metadata would
// read (and write ``out``) out of bounds. Each failure is a TORCH_CHECK (a RuntimeError in
// Python) naming the problem. Cost: a few compares per request plus one per block in use,
// against the work of attending over those blocks.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pd_attn {

// Shapes, dtypes, devices and layouts of the tensors (independent of the metadata's values).
inline void check_tensors(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kc,
                          const at::Tensor& vc, const at::Tensor& bt, const at::Tensor& sl,
                          const at::Tensor& qsl) {
  for (const at::Tensor* t : {&out, &query, &kc, &vc, &bt, &sl, &qsl})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: every input must be on the CPU, got ",
                t->device());
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "paged_attention: query/out must be "
              "[tokens, heads, dim], got ", query.sizes(), " and ", out.sizes());
  TORCH_CHECK(kc.dim() == 4 && vc.dim() == 4,
              "paged_attention: key/value cache must be [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kc.stride(3) == 1 &&
                  vc.stride(3) == 1,
              "paged_attention: the last dim must be contiguous");
  TORCH_CHECK(kc.size(1) > 0 && kc.size(2) > 0, "paged_attention: key cache block size and "
              "kv heads must be positive, got ", kc.sizes());
  // The value cache is read at the key cache's block ids and heads: the same blocks, block
  // size and heads, laid out alike (latent attention's values are a view of the keys).
  for (int64_t i = 0; i < 3; ++i)
    TORCH_CHECK(vc.size(i) == kc.size(i), "paged_attention: value cache shape ", vc.sizes(),
                " does not match key cache ", kc.sizes(), " in dim ", i);
  for (int64_t i = 0; i < 3; ++i)
    TORCH_CHECK(vc.stride(i) == kc.stride(i), "paged_attention: value cache strides ",
                vc.strides(), " differ from the key cache's ", kc.strides());
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type(), "paged_attention: key cache dtype ",
              kc.scalar_type(), " and value cache dtype ", vc.scalar_type(), " differ");
  TORCH_CHECK(query.size(1) % kc.size(2) == 0, "paged_attention: query heads (",
              query.size(1), ") must be a multiple of kv heads (", kc.size(2), ")");
  TORCH_CHECK(query.size(2) == kc.size(3), "paged_attention: query head dim ", query.size(2),
              " and key head dim ", kc.size(3), " differ");
  TORCH_CHECK(out.size(0) == query.size(0) && out.size(1) == query.size(1) &&
                  out.size(2) == vc.size(3),
              "paged_attention: out must be [tokens, heads, value dim] = [", query.size(0),
              ", ", query.size(1), ", ", vc.size(3), "], got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "paged_attention: out dtype ",
              out.scalar_type(), " and query dtype ", query.scalar_type(), " differ");
  TORCH_CHECK(sl.scalar_type() == at::kInt && qsl.scalar_type() == at::kInt &&
                  sl.dim() == 1 && qsl.dim() == 1 && sl.is_contiguous() && qsl.is_contiguous(),
              "paged_attention: seq_lens and query_start_loc must be contiguous 1-d int32");
  TORCH_CHECK(bt.scalar_type() == at::kInt && bt.dim() == 2 && bt.stride(1) == 1,
              "paged_attention: block_tables must be int32 [requests, blocks], rows "
              "contiguous");
  TORCH_CHECK(qsl.size(0) == sl.size(0) + 1, "paged_attention: query_start_loc has ",
              qsl.size(0), " entries for ", sl.size(0), " requests (needs requests + 1)");
  TORCH_CHECK(bt.size(0) >= sl.size(0), "paged_attention: block_tables has ", bt.size(0),
              " rows for ", sl.size(0), " requests");
}

// An FP8 cache's scales: fp32 [blocks, kv heads] each, laid out alike, on the CPU.
inline void check_scales(const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& kc) {
  for (const at::Tensor* t : {&ks, &vs}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
                    t->size(0) == kc.size(0) && t->size(1) == kc.size(2),
                "paged_attention: scales must be fp32 [blocks, kv heads] = [", kc.size(0),
                ", ", kc.size(2), "] on the CPU, got ", t->sizes(), " ", t->scalar_type());
    TORCH_CHECK(t->strides() == ks.strides(), "paged_attention: key and value scales are "
                "laid out differently");
  }
}

// The metadata's values: query ranges within the query, lengths within the block tables,
// block ids within the cache.
inline void check_metadata(const at::Tensor& query, const at::Tensor& kc, const at::Tensor& bt,
                           const at::Tensor& sl, const at::Tensor& qsl, int64_t window) {
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0, got ", window);
  const int32_t* starts = qsl.data_ptr<int32_t>();
  const int32_t* lens = sl.data_ptr<int32_t>();
  const int32_t* tables = bt.data_ptr<int32_t>();
  const int64_t n_req = sl.size(0), rows = query.size(0), bs = kc.size(1);
  const int64_t num_blocks = kc.size(0), width = bt.size(1), stride = bt.stride(0);
  // (>= 0, not == 0: a slice of a batch's requests keeps its rows' places in the query)
  TORCH_CHECK(starts[0] >= 0, "paged_attention: query_start_loc must start at a row >= 0, "
              "got ", starts[0]);
  TORCH_CHECK(starts[n_req] <= rows, "paged_attention: query_start_loc ends at ",
              starts[n_req], ", past the query's ", rows, " rows");
  for (int64_t r = 0; r < n_req; ++r) {
    const int64_t q_len = static_cast<int64_t>(starts[r + 1]) - starts[r];
    TORCH_CHECK(q_len >= 0, "paged_attention: query_start_loc is not monotone at request ",
                r, " (", starts[r], " then ", starts[r + 1], ")");
    TORCH_CHECK(lens[r] >= q_len, "paged_attention: request ", r, " has seq_len ", lens[r],
                " < its ", q_len, " query tokens");
    const int64_t used = (static_cast<int64_t>(lens[r]) + bs - 1) / bs;
    TORCH_CHECK(used <= width, "paged_attention: request ", r, " has seq_len ", lens[r],
                " but its block table holds ", width, " blocks of ", bs, " tokens");
    const int32_t* row = tables + r * stride;
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, "paged_attention: request ", r,
                  " uses block id ", row[b], " (table entry ", b, "), outside the cache's ",
                  num_blocks, " blocks");
  }
}

}  // namespace pd_attn
