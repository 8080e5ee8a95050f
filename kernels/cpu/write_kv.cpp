// This step's keys and values into their slots of the paged cache, one op for both: the torch
// path (a mask, a check and two index_copy_ calls) costs several dispatches a layer, which a
// decode step of a few tokens pays in full on every layer.
//
// kv_cache [2, blocks, block_size, heads, dim] (K then V; each slot's heads x dim contiguous),
// key and value [tokens, heads, dim] (any strides with a contiguous last dim), slot_mapping
// [tokens] int64: the flat slot (block * block_size + offset) each token goes to, -1 for a
// padding token that is not written. A slot outside the cache is a RuntimeError, never a write
// out of bounds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>

namespace {

void write_kv(at::Tensor kv_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "write_kv: kv_cache must be [2, blocks, block_size, heads, dim]");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "write_kv: key and value must be [tokens, heads, dim] alike");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4),
              "write_kv: key/value heads x dim ", key.size(1), "x", key.size(2),
              " differ from the cache's ", kv_cache.size(3), "x", kv_cache.size(4));
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "write_kv: key/value dtype must be the cache's");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous(),
              "write_kv: slot_mapping must be int64 [tokens], contiguous");
  TORCH_CHECK(kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4) &&
                  key.stride(2) == 1 && value.stride(2) == 1,
              "write_kv: the head dim must be contiguous in the cache, key and value");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t block_size = kv_cache.size(2), slots = kv_cache.size(1) * block_size;
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] < slots, "write_kv: slot ", slot[t], " of token ", t,
                " is outside the cache (", slots, " slots)");
  const int64_t elt = kv_cache.element_size();
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t row = heads * dim * elt;
  const bool packed = key.stride(1) == dim && value.stride(1) == dim;
  auto copy = [&](char* dst, const char* src, int64_t head_stride) {
    if (packed) {
      std::memcpy(dst, src, row);
      return;
    }
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + h * dim * elt, src + h * head_stride * elt, dim * elt);
  };
  at::parallel_for(0, tokens, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t s = slot[t];
      if (s < 0) continue;
      const int64_t off = ((s / block_size) * kv_cache.stride(1) + (s % block_size) *
                           kv_cache.stride(2)) * elt;
      copy(base + off, k + t * key.stride(0) * elt, key.stride(1));
      copy(base + kv_cache.stride(0) * elt + off, v + t * value.stride(0) * elt,
           value.stride(1));
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pd_cluster_cpu, m) {
  m.def("write_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &write_kv);
}
