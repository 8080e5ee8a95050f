// GHASH (GCM's hash over associated data) fused with a block copy, for the shm pipe's
// written-check: the bytes are read once, stored to the destination and folded
// into the hash while in registers. Python (kernels/ghash_copy.py) derives H = AES_K(0) and
// E_K(J0) with OpenSSL and turns the hash into the AES-GMAC tag (GHASH ^ E_K(J0)), so tags
// are bit-identical to `cryptography`'s.
//
// The state is one uint8 tensor (layout below): the running hash X, a partial 16-byte block
// carried between calls (GCM's AAD is one stream, zero-padded only at its end), the length,
// and H^1..H^32 for aggregated reduction. Paths: VPCLMULQDQ on 512-bit registers (32 blocks
// per reduction) when the build has it, PCLMULQDQ on 128 bits (4 per reduction; runtime
// check, so the portable build has it too), and a bit-serial software multiply (no
// carry-less multiply: slow, the Python side prefers OpenSSL then).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GH_X86 1
#endif

namespace {

// State layout (bytes).
constexpr int64_t kX = 0;        // running hash, GCM byte order
constexpr int64_t kBuf = 16;     // partial block
constexpr int64_t kBufLen = 32;  // uint64
constexpr int64_t kTotal = 40;   // uint64: bytes hashed so far
constexpr int64_t kPow = 48;     // H^1..H^32, GCM byte order, 16 bytes each
constexpr int kPowers = 32;
constexpr int64_t kStateBytes = kPow + 16 * kPowers;
// Blocks up to this size prefetch the next one alongside (a block ahead); larger ones are
// long runs the hardware prefetcher follows, and a block ahead would be too far.
constexpr int64_t kPrefetchMax = 64 << 10;

struct Block { uint64_t hi, lo; };  // big-endian halves of a GCM field element

Block load_be(const uint8_t* p) {
  Block b{0, 0};
  for (int i = 0; i < 8; ++i) b.hi = (b.hi << 8) | p[i];
  for (int i = 8; i < 16; ++i) b.lo = (b.lo << 8) | p[i];
  return b;
}

void store_be(uint8_t* p, Block b) {
  for (int i = 7; i >= 0; --i) { p[i] = uint8_t(b.hi); b.hi >>= 8; }
  for (int i = 15; i >= 8; --i) { p[i] = uint8_t(b.lo); b.lo >>= 8; }
}

// The spec's multiply (NIST SP 800-38D, algorithm 1): bit-serial, for the powers of H and
// the path without a carry-less multiply.
Block gf_mul(Block x, Block y) {
  Block z{0, 0}, v = y;
  for (int i = 0; i < 128; ++i) {
    uint64_t bit = i < 64 ? (x.hi >> (63 - i)) & 1 : (x.lo >> (127 - i)) & 1;
    if (bit) { z.hi ^= v.hi; z.lo ^= v.lo; }
    uint64_t carry = v.lo & 1;
    v.lo = (v.lo >> 1) | (v.hi << 63);
    v.hi >>= 1;
    if (carry) v.hi ^= 0xe100000000000000ULL;
  }
  return z;
}

void soft_blocks(uint8_t* x, const uint8_t* h, const uint8_t* data, int64_t nblocks) {
  Block acc = load_be(x), hh = load_be(h);
  for (int64_t i = 0; i < nblocks; ++i) {
    Block d = load_be(data + 16 * i);
    acc.hi ^= d.hi; acc.lo ^= d.lo;
    acc = gf_mul(acc, hh);
  }
  store_be(x, acc);
}

#ifdef GH_X86
#define GH_TARGET128 __attribute__((target("pclmul,ssse3,sse4.1")))

// Byte order reversed: the field element as one little-endian 128-bit integer (reflected).
GH_TARGET128 inline __m128i bswap128(__m128i v) {
  return _mm_shuffle_epi8(v, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

// (lo, mid, hi): the unreduced 256-bit carry-less product a*b, mid not yet split.
GH_TARGET128 inline void clmul3(__m128i a, __m128i b, __m128i& lo, __m128i& mid, __m128i& hi) {
  lo = _mm_xor_si128(lo, _mm_clmulepi64_si128(a, b, 0x00));
  hi = _mm_xor_si128(hi, _mm_clmulepi64_si128(a, b, 0x11));
  mid = _mm_xor_si128(mid, _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x10),
                                         _mm_clmulepi64_si128(a, b, 0x01)));
}

// Reduces a product of byte-reversed operands (Intel's carry-less multiply white paper:
// shift left by one for the reflection, then reduce modulo x^128 + x^7 + x^2 + x + 1).
GH_TARGET128 inline __m128i reduce(__m128i lo, __m128i mid, __m128i hi) {
  lo = _mm_xor_si128(lo, _mm_slli_si128(mid, 8));
  hi = _mm_xor_si128(hi, _mm_srli_si128(mid, 8));
  __m128i c_lo = _mm_srli_epi32(lo, 31), c_hi = _mm_srli_epi32(hi, 31);
  lo = _mm_slli_epi32(lo, 1);
  hi = _mm_slli_epi32(hi, 1);
  __m128i top = _mm_srli_si128(c_lo, 12);
  hi = _mm_or_si128(_mm_or_si128(hi, _mm_slli_si128(c_hi, 4)), top);
  lo = _mm_or_si128(lo, _mm_slli_si128(c_lo, 4));
  __m128i a = _mm_xor_si128(_mm_xor_si128(_mm_slli_epi32(lo, 31), _mm_slli_epi32(lo, 30)),
                            _mm_slli_epi32(lo, 25));
  __m128i carry = _mm_srli_si128(a, 4);
  lo = _mm_xor_si128(lo, _mm_slli_si128(a, 12));
  __m128i b = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi32(lo, 1), _mm_srli_epi32(lo, 2)),
                            _mm_srli_epi32(lo, 7));
  b = _mm_xor_si128(b, carry);
  return _mm_xor_si128(hi, _mm_xor_si128(lo, b));
}

// Hashes nblocks 16-byte blocks of src into x (reversed order), copying them to dst when
// dst is not null; pw[i] = H^(i+1) reversed. Four blocks per reduction.
GH_TARGET128 __m128i blocks128(__m128i x, const __m128i* pw, const uint8_t* src, uint8_t* dst,
                               int64_t nblocks) {
  int64_t i = 0;
  for (; i + 4 <= nblocks; i += 4) {
    __m128i d[4];
    for (int j = 0; j < 4; ++j) {
      d[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * (i + j)));
      if (dst) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * (i + j)), d[j]);
    }
    __m128i lo = _mm_setzero_si128(), mid = lo, hi = lo;
    clmul3(_mm_xor_si128(x, bswap128(d[0])), pw[3], lo, mid, hi);
    for (int j = 1; j < 4; ++j) clmul3(bswap128(d[j]), pw[3 - j], lo, mid, hi);
    x = reduce(lo, mid, hi);
  }
  for (; i < nblocks; ++i) {
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * i));
    if (dst) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * i), d);
    __m128i lo = _mm_setzero_si128(), mid = lo, hi = lo;
    clmul3(_mm_xor_si128(x, bswap128(d)), pw[0], lo, mid, hi);
    x = reduce(lo, mid, hi);
  }
  return x;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__VPCLMULQDQ__)
#define GH_HAVE_512 1

// 4*G blocks (G 512-bit registers) per reduction; rev[k] holds H^(4G-4k) .. H^(4G-4k-3) in
// its lanes, first block first. The data's products do not depend on the running hash: only
// its own product (128-bit, beside them) and the reduction are on the serial path.
template <int G>
__m128i blocks512(__m128i x, const __m512i* rev, const uint8_t* src, uint8_t* dst,
                  int64_t groups, const uint8_t* pf, uint8_t* pfd) {
  const __m512i swap = _mm512_broadcast_i32x4(
      _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  auto fold = [](__m512i v) {
    __m256i y = _mm256_xor_si256(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    return _mm_xor_si128(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
  };
  const __m128i top = _mm512_castsi512_si128(rev[0]);  // H^(4G): the hash's multiplier
  // Streaming stores when the destination is line-aligned (a KV block is): the copy's
  // lines go to memory without first being read into the cache (one pass less of memory
  // traffic; measured 5.5 -> 8.7-9.3 GB/s for a 16k-token layer set into /dev/shm here).
  const bool stream = dst && (reinterpret_cast<uintptr_t>(dst) & 63) == 0;
  for (int64_t i = 0; i < groups; ++i) {
    const uint8_t* s = src + 64 * G * i;
    __m512i d[G];
    if (pf)  // the next block, as far into it as we are into this one
      for (int k = 0; k < G; ++k) {
        _mm_prefetch(reinterpret_cast<const char*>(pf + 64 * G * i + 64 * k), _MM_HINT_T0);
        if (pfd && !stream)
          _mm_prefetch(reinterpret_cast<const char*>(pfd + 64 * G * i + 64 * k), _MM_HINT_ET0);
      }
    for (int k = 0; k < G; ++k) d[k] = _mm512_loadu_si512(s + 64 * k);
    if (dst && stream)  // past the caches: no read of the destination's old lines
      for (int k = 0; k < G; ++k) _mm512_stream_si512(
          reinterpret_cast<__m512i*>(dst + 64 * G * i + 64 * k), d[k]);
    else if (dst)
      for (int k = 0; k < G; ++k) _mm512_storeu_si512(dst + 64 * G * i + 64 * k, d[k]);
    __m512i lo = _mm512_setzero_si512(), hi = lo, mid = lo;
    for (int k = 0; k < G; ++k) {
      __m512i v = _mm512_shuffle_epi8(d[k], swap);
      lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(v, rev[k], 0x00));
      hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(v, rev[k], 0x11));
      mid = _mm512_xor_si512(mid, _mm512_xor_si512(_mm512_clmulepi64_epi128(v, rev[k], 0x01),
                                                   _mm512_clmulepi64_epi128(v, rev[k], 0x10)));
    }
    __m128i l = fold(lo), m = fold(mid), h = fold(hi);
    clmul3(x, top, l, m, h);
    x = reduce(l, m, h);
  }
  return x;
}
#endif  // 512

bool cpu_has_pclmul() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("ssse3") &&
         __builtin_cpu_supports("sse4.1");
}
#endif  // x86

int64_t best_impl() {
#ifdef GH_HAVE_512
  return 2;
#elif defined(GH_X86)
  static const bool pclmul = cpu_has_pclmul();
  return pclmul ? 1 : 0;
#else
  return 0;
#endif
}

#ifdef GH_X86
GH_TARGET128 void simd_blocks(int64_t impl, uint8_t* state, const uint8_t* src, uint8_t* dst,
                              int64_t nblocks, const uint8_t* pf, uint8_t* pfd) {
  __m128i pw[kPowers];
  for (int i = 0; i < kPowers; ++i)
    pw[i] = bswap128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(state + kPow + 16 * i)));
  __m128i x = bswap128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(state + kX)));
#ifdef GH_HAVE_512
  if (impl == 2 && nblocks >= 16) {
    // rev[k]: lanes H^(32-4k) .. H^(29-4k); rev + 4 serves groups of 16 blocks.
    __m512i rev[8];
    for (int k = 0; k < 8; ++k)
      rev[k] = _mm512_inserti64x2(_mm512_inserti64x2(_mm512_inserti64x2(
          _mm512_castsi128_si512(pw[31 - 4 * k]), pw[30 - 4 * k], 1), pw[29 - 4 * k], 2),
          pw[28 - 4 * k], 3);
    int64_t n512 = nblocks / 32;
    x = blocks512<8>(x, rev, src, dst, n512, pf, pfd);
    src += 512 * n512;
    if (dst) dst += 512 * n512;
    nblocks -= 32 * n512;
    if (nblocks >= 16) {
      x = blocks512<4>(x, rev + 4, src, dst, 1, nullptr, nullptr);
      src += 256;
      if (dst) dst += 256;
      nblocks -= 16;
    }
  }
#endif
  x = blocks128(x, pw, src, dst, nblocks);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state + kX), bswap128(x));
}
#endif

// Hashes (and copies, when dst) whole blocks with the chosen path; pf / pfd: where to
// prefetch alongside (the next KV block's source and destination; may be null). Scattered
// blocks defeat the hardware prefetcher: it stops at page boundaries.
void hash_blocks(int64_t impl, uint8_t* state, const uint8_t* src, uint8_t* dst,
                 int64_t nblocks, const uint8_t* pf = nullptr, uint8_t* pfd = nullptr) {
  if (nblocks <= 0) return;
#ifdef GH_X86
  if (impl >= 1) {
    simd_blocks(impl, state, src, dst, nblocks, pf, pfd);
    return;
  }
#endif
  if (dst) std::memcpy(dst, src, size_t(16 * nblocks));
  soft_blocks(state + kX, state + kPow, src, nblocks);
}

// One stretch of the stream: completes a carried partial block, hashes whole blocks, keeps
// the tail for the next call.
void absorb(int64_t impl, uint8_t* state, const uint8_t* src, uint8_t* dst, int64_t n,
            const uint8_t* pf = nullptr, uint8_t* pfd = nullptr) {
  uint64_t buflen, total;
  std::memcpy(&buflen, state + kBufLen, 8);
  std::memcpy(&total, state + kTotal, 8);
  total += uint64_t(n);
  if (buflen) {
    int64_t take = std::min<int64_t>(16 - int64_t(buflen), n);
    std::memcpy(state + kBuf + buflen, src, size_t(take));
    if (dst) std::memcpy(dst, src, size_t(take));
    buflen += uint64_t(take);
    src += take;
    if (dst) dst += take;
    n -= take;
    if (buflen == 16) {
      hash_blocks(impl, state, state + kBuf, nullptr, 1);
      buflen = 0;
    }
  }
  int64_t whole = n / 16;
  hash_blocks(impl, state, src, dst, whole, pf, pfd);
  int64_t rest = n - 16 * whole;
  if (rest) {
    std::memcpy(state + kBuf + buflen, src + 16 * whole, size_t(rest));
    if (dst) std::memcpy(dst + 16 * whole, src + 16 * whole, size_t(rest));
    buflen += uint64_t(rest);
  }
  std::memcpy(state + kBufLen, &buflen, 8);
  std::memcpy(state + kTotal, &total, 8);
}

uint8_t* checked_state(const at::Tensor& state) {
  TORCH_CHECK(state.device().is_cpu() && state.scalar_type() == at::kByte &&
              state.is_contiguous() && state.numel() == kStateBytes,
              "ghash: state must be a contiguous CPU uint8 tensor of ", kStateBytes, " bytes");
  return state.data_ptr<uint8_t>();
}

int64_t pick(int64_t impl) {
  int64_t best = best_impl();
  TORCH_CHECK(impl >= -1 && impl <= 2, "ghash: impl must be -1 (best), 0, 1 or 2");
  TORCH_CHECK(impl <= best, "ghash: path ", impl, " is not available here (best ", best, ")");
  return impl < 0 ? best : impl;
}

// ---- ops --------------------------------------------------------------------------------

int64_t ghash_impl() { return best_impl(); }

// A fresh state for hash key H (16 bytes, GCM byte order).
void ghash_init(const at::Tensor& state, const at::Tensor& h) {
  uint8_t* st = checked_state(state);
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kByte && h.is_contiguous() &&
              h.numel() == 16, "ghash_init: h must be 16 contiguous CPU bytes");
  std::memset(st, 0, size_t(kStateBytes));
  Block hh = load_be(h.data_ptr<uint8_t>()), p = hh;
  for (int i = 0; i < kPowers; ++i) {
    store_be(st + kPow + 16 * i, p);
    p = gf_mul(p, hh);
  }
}

// Hashes the bytes of data (any contiguous CPU tensor).
void ghash_update(const at::Tensor& state, const at::Tensor& data, int64_t impl) {
  uint8_t* st = checked_state(state);
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous(), "ghash_update: data must be "
              "a contiguous CPU tensor");
  absorb(pick(impl), st, static_cast<const uint8_t*>(data.data_ptr()), nullptr,
         data.numel() * int64_t(data.element_size()));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.dim() == 3 &&
              t.stride(2) == 1 && t.stride(1) == t.size(2),
              "ghash: ", name, " must be a CPU uint8 [parts, blocks, bytes] tensor with "
              "contiguous blocks");
}

const int64_t* checked_ids(const at::Tensor& ids, int64_t limit, const char* name) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 &&
              ids.is_contiguous(), "ghash: ", name, " must be a contiguous int64 vector");
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < limit, "ghash: ", name, "[", i, "] = ", p[i],
                " is out of range 0..", limit - 1);
  return p;
}

// Copies src[part, src_ids[i]] to dst[part, dst_ids[i]] for every part, then i, hashing the
// source bytes in that order (one pass: read once, stored and hashed from registers).
void ghash_copy_blocks(const at::Tensor& state, const at::Tensor& src, const at::Tensor& dst,
                       const at::Tensor& src_ids, const at::Tensor& dst_ids, int64_t impl) {
  uint8_t* st = checked_state(state);
  check_rows(src, "src");
  check_rows(dst, "dst");
  TORCH_CHECK(src.size(0) == dst.size(0) && src.size(2) == dst.size(2),
              "ghash_copy_blocks: src and dst differ in parts or block bytes");
  TORCH_CHECK(src_ids.numel() == dst_ids.numel(), "ghash_copy_blocks: ids differ in number");
  const int64_t* s = checked_ids(src_ids, src.size(1), "src_ids");
  const int64_t* d = checked_ids(dst_ids, dst.size(1), "dst_ids");
  int64_t use = pick(impl), bytes = src.size(2);
  const uint8_t* sb = src.data_ptr<uint8_t>();
  uint8_t* db = dst.data_ptr<uint8_t>();
  int64_t n = src_ids.numel(), parts = src.size(0);
  for (int64_t part = 0; part < parts; ++part)
    for (int64_t i = 0, k; i < n; i += k) {
      // blocks consecutive on both sides go as one stretch (the same bytes in the same order)
      for (k = 1; i + k < n && s[i + k] == s[i] + k && d[i + k] == d[i] + k; ++k) {}
      int64_t np = i + k < n ? part : part + 1, ni = i + k < n ? i + k : 0;
      bool more = np < parts && k * bytes <= kPrefetchMax;
      absorb(use, st, sb + part * src.stride(0) + s[i] * bytes,
             db + part * dst.stride(0) + d[i] * bytes, k * bytes,
             more ? sb + np * src.stride(0) + s[ni] * bytes : nullptr,
             more ? db + np * dst.stride(0) + d[ni] * bytes : nullptr);
    }
#ifdef GH_X86
  _mm_sfence();  // streaming stores are weakly ordered: visible before the notification
#endif
}

// Hashes src[part, ids[i]] for every part, then i (the consumer's check of a write).
void ghash_blocks(const at::Tensor& state, const at::Tensor& src, const at::Tensor& ids,
                  int64_t impl) {
  uint8_t* st = checked_state(state);
  check_rows(src, "src");
  const int64_t* s = checked_ids(ids, src.size(1), "ids");
  int64_t use = pick(impl), bytes = src.size(2);
  const uint8_t* sb = src.data_ptr<uint8_t>();
  int64_t n = ids.numel(), parts = src.size(0);
  for (int64_t part = 0; part < parts; ++part)
    for (int64_t i = 0, k; i < n; i += k) {
      for (k = 1; i + k < n && s[i + k] == s[i] + k; ++k) {}  // a run: one stretch
      int64_t np = i + k < n ? part : part + 1, ni = i + k < n ? i + k : 0;
      absorb(use, st, sb + part * src.stride(0) + s[i] * bytes, nullptr, k * bytes,
             np < parts && k * bytes <= kPrefetchMax ? sb + np * src.stride(0) + s[ni] * bytes
                                                     : nullptr);
    }
}

// Pads the carried partial block, hashes the length block (AAD bits || 0) and writes
// GHASH (16 bytes, GCM byte order) to out. The state is spent.
void ghash_final(const at::Tensor& state, const at::Tensor& out, int64_t impl) {
  uint8_t* st = checked_state(state);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kByte && out.is_contiguous() &&
              out.numel() == 16, "ghash_final: out must be 16 contiguous CPU bytes");
  int64_t use = pick(impl);
  uint64_t buflen, total;
  std::memcpy(&buflen, st + kBufLen, 8);
  std::memcpy(&total, st + kTotal, 8);
  if (buflen) {
    std::memset(st + kBuf + buflen, 0, size_t(16 - buflen));
    hash_blocks(use, st, st + kBuf, nullptr, 1);
  }
  uint8_t len_block[16] = {0};
  uint64_t bits = total * 8;
  for (int i = 7; i >= 0; --i) { len_block[i] = uint8_t(bits); bits >>= 8; }
  hash_blocks(use, st, len_block, nullptr, 1);
  std::memcpy(out.data_ptr<uint8_t>(), st + kX, 16);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pd_cluster_cpu, m) {
  m.def("ghash_impl() -> int", &ghash_impl);
  m.def("ghash_init(Tensor(a!) state, Tensor h) -> ()", &ghash_init);
  m.def("ghash_update(Tensor(a!) state, Tensor data, int impl) -> ()", &ghash_update);
  m.def("ghash_copy_blocks(Tensor(a!) state, Tensor src, Tensor(b!) dst, Tensor src_ids, "
        "Tensor dst_ids, int impl) -> ()", &ghash_copy_blocks);
  m.def("ghash_blocks(Tensor(a!) state, Tensor src, Tensor ids, int impl) -> ()",
        &ghash_blocks);
  m.def("ghash_final(Tensor(a!) state, Tensor(b!) out, int impl) -> ()", &ghash_final);
}
