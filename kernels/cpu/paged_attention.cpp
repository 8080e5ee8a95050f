// Paged attention on CPU: every request of a batch (decode tokens and prefill chunks with a
// cached prefix alike) attends over K/V read in place from the paged cache's blocks.
//
// One work item = (request, KV head, tile of query tokens); its rows are the tile's queries
// times the query heads sharing that KV head (GQA). Each item walks only the blocks its
// queries can see (causal, and the sliding window's lower edge), with an online softmax in fp32,
// so no request's context is ever copied out of the cache. Items run on ATen's thread pool (the
// engine's torch.set_num_threads), one OpenMP runtime for the whole process.
//
// Query i of a request with q_len new tokens and seq_len context sits at position
// seq_len - q_len + i and sees keys k with k <= pos and (window == 0 or k > pos - window).
// Scores: q.k * scale, then soft-cap cap * tanh(s / cap), then mask; sinks join the softmax
// denominator as one logit per head and carry no value (the order of the torch reference).
//
// Every input is checked first (attention_checks.h): bad metadata is a RuntimeError naming the
// problem, never a read or write out of bounds.
//
// Two implementations of one work item share this driver: the AVX-512 path
// (attention_avx512.h) where the CPU and the head dims allow it, else the portable one.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_avx512.h"
#include "attention_checks.h"
#include "attention_common.h"
#include "attention_portable.h"

namespace {

using pd_attn::Ctx;
using pd_attn::Item;

constexpr int64_t TILE_Q = 16;     // portable path: query tokens per work item
constexpr int64_t TILE_ROWS = 64;  // AVX-512 path: rows (tokens x group) per prefill item

// The AVX-512 path takes head dims that are whole 16-lane vectors.
bool use_avx512(const Ctx& c) {
#if defined(__AVX512F__)
  return c.d % 16 == 0 && c.dv % 16 == 0;
#else
  (void)c;
  return false;
#endif
}

template <typename C>
constexpr bool kFp8 =
    std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;

// An FP8 cache's K and V scales [blocks, kv heads] (fp32, the same strides), checked.
struct Scales {
  const at::Tensor* k = nullptr;
  const at::Tensor* v = nullptr;
};

// Item indices by descending cost (rows times the keys they see), ties in list order.
std::vector<int64_t> costliest_first(const Ctx& c, const std::vector<Item>& items) {
  std::vector<int64_t> cost(items.size()), order(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& w = items[i];
    const int64_t last_pos = pd_attn::first_position(c, w) + (w.q1 - w.q0) - 1;
    const int64_t first_key = c.window > 0
        ? std::max<int64_t>(0, pd_attn::first_position(c, w) - c.window + 1) : 0;
    cost[i] = (w.q1 - w.q0) * (last_pos + 1 - first_key);
    order[i] = static_cast<int64_t>(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

template <typename Q, typename C>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
         const at::Tensor& value_cache, const at::Tensor& block_tables,
         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
         double scale, int64_t window, double softcap, const float* sinks, Scales sc) {
  const int64_t hkv = key_cache.size(2);
  Ctx c{query.size(1), hkv, query.size(1) / hkv, query.size(2), value_cache.size(3),
              key_cache.size(1), window, static_cast<float>(scale),
              static_cast<float>(softcap), sinks, seq_lens.data_ptr<int32_t>(),
              query_start_loc.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
              block_tables.stride(0), query.stride(0), query.stride(1), out.stride(0),
              out.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
              value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)};
  if constexpr (kFp8<C>) {
    c.kscale = sc.k->data_ptr<float>();
    c.vscale = sc.v->data_ptr<float>();
    c.sb = sc.k->stride(0);
    c.sh = sc.k->stride(1);
  }
  const pd_attn::Ptrs<Q, C> p{query.data_ptr<Q>(), out.data_ptr<Q>(), key_cache.data_ptr<C>(),
                              value_cache.data_ptr<C>()};
  // FP8 blocks take the portable path (converted, times their scale, block by block).
  const bool fast = !kFp8<C> && use_avx512(c);
  const int64_t tile = fast ? std::max<int64_t>(1, TILE_ROWS / c.group) : TILE_Q;
  std::vector<Item> items;
  for (int64_t r = 0; r < seq_lens.size(0); ++r)
    for (int64_t q0 = c.qsl[r]; q0 < c.qsl[r + 1]; q0 += tile)
      for (int64_t h = 0; h < hkv; ++h)
        items.push_back({r, h, q0, std::min<int64_t>(q0 + tile, c.qsl[r + 1])});

  // Items differ in cost (a causal chunk's last tile sees every key, its first few), so a
  // static split of the list would leave one thread with most of a prompt's work: each thread
  // takes the next item instead, costliest first. Each item writes rows of its own, so the
  // output does not depend on which thread ran it.
  const std::vector<int64_t> order = costliest_first(c, items);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t n_workers = std::min<int64_t>(at::get_num_threads(), n_items);
  at::parallel_for(0, n_workers, 1, [&](int64_t, int64_t) {
    auto drain = [&](auto& worker) {
      for (int64_t it = next.fetch_add(1); it < n_items; it = next.fetch_add(1))
        worker.run(c, p, items[order[it]]);
    };
#if defined(__AVX512F__)
    if constexpr (!kFp8<C>) {
      if (fast) {
        pd_attn::avx512::Worker<Q, C> worker;
        drain(worker);
        return;
      }
    }
#endif
    pd_attn::portable::Worker<Q, C> worker;
    drain(worker);
  });
}

template <typename Q>
void dispatch_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& kc,
                    const at::Tensor& vc, const at::Tensor& bt, const at::Tensor& sl,
                    const at::Tensor& qsl, double scale, int64_t window,
                    double softcap, const float* sinks, Scales sc) {
  switch (kc.scalar_type()) {
    case at::kFloat:
      return run<Q, float>(out, query, kc, vc, bt, sl, qsl, scale, window, softcap, sinks, sc);
    case at::kBFloat16:
      return run<Q, c10::BFloat16>(out, query, kc, vc, bt, sl, qsl, scale, window,
                                   softcap, sinks, sc);
    case at::kHalf:
      return run<Q, c10::Half>(out, query, kc, vc, bt, sl, qsl, scale, window, softcap,
                               sinks, sc);
    case at::kFloat8_e4m3fn:
      return run<Q, c10::Float8_e4m3fn>(out, query, kc, vc, bt, sl, qsl, scale, window,
                                        softcap, sinks, sc);
    case at::kFloat8_e5m2:
      return run<Q, c10::Float8_e5m2>(out, query, kc, vc, bt, sl, qsl, scale, window,
                                      softcap, sinks, sc);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported cache dtype ", kc.scalar_type());
  }
}

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, int64_t window, double softcap,
                     const std::optional<at::Tensor>& sinks,
                     const std::optional<at::Tensor>& key_scales,
                     const std::optional<at::Tensor>& value_scales) {
  pd_attn::check_tensors(out, query, key_cache, value_cache, block_tables, seq_lens,
                         query_start_loc);
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn ||
                   key_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(fp8 == (key_scales.has_value() && value_scales.has_value()),
              "paged_attention: an FP8 cache needs key and value scales, no other cache takes "
              "them");
  Scales sc;
  if (fp8) {
    pd_attn::check_scales(*key_scales, *value_scales, key_cache);
    sc = Scales{&*key_scales, &*value_scales};
  }
  pd_attn::check_metadata(query, key_cache, block_tables, seq_lens, query_start_loc, window);
  const float* sink_ptr = nullptr;
  at::Tensor sinks_f;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->device().is_cpu(), "paged_attention: sinks must be on the CPU");
    sinks_f = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks_f.numel() == query.size(1), "sinks: one per query head");
    sink_ptr = sinks_f.data_ptr<float>();
  }
  switch (query.scalar_type()) {
    case at::kFloat:
      return dispatch_cache<float>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                   query_start_loc, scale, window, softcap, sink_ptr, sc);
    case at::kBFloat16:
      return dispatch_cache<c10::BFloat16>(out, query, key_cache, value_cache, block_tables,
                                           seq_lens, query_start_loc, scale, window,
                                           softcap, sink_ptr, sc);
    case at::kHalf:
      return dispatch_cache<c10::Half>(out, query, key_cache, value_cache, block_tables,
                                       seq_lens, query_start_loc, scale, window,
                                       softcap, sink_ptr, sc);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported query dtype ", query.scalar_type());
  }
}

// The instruction-set paths this build was compiled with (PD_CLUSTER_CPU_ISA's effect), for
// tests and diagnostics.
std::string compiled_isa() {
  std::string isa;
#if defined(__AVX512F__)
  isa += "avx512f";
#endif
#if defined(__AVX512BF16__)
  isa += " avx512bf16";
#endif
  return isa.empty() ? "portable" : isa;
}

}  // namespace

TORCH_LIBRARY(pd_cluster_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "float scale, int window, float softcap, Tensor? sinks, Tensor? key_scales=None, "
      "Tensor? value_scales=None) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  m.def("compiled_isa() -> str", &compiled_isa);
}
