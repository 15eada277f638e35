// The CPU path's C++ ops (float32, AVX2 + FMA), registered as torch.ops.brigade.* and built
// on first use by kernels/cpu_ops.py:
//
// - paged_decode: one query token per sequence against its context, read in place from the paged
//   KV cache. The torch path gathers every sequence's pages into a dense copy first and then runs
//   SDPA; this reads each page once, where it lies.
// - few_rows_linear: x @ W^T (+ bias) for a step of 1-4 rows, which is bound by reading the
//   weights: each [out, in] weight row is read once for all the step's rows, the output rows split
//   over the threads.
// - add_rms_norm: the residual add and RMSNorm of a decoder layer in one pass over each row (torch
//   runs them as about ten small ops, which is most of their cost at a few rows).
// - few_rows_linear_quantized: the same from weights kept in a GGUF block format (Q4_1, Q8_0, the
//   K-quants Q4_K, Q5_K, Q6_K, and MXFP4, as gpt-oss's experts ship),
//   read as they are: a quarter (Q8_0) or a sixth (Q4_1, MXFP4) of the float32 bytes. It computes with the
//   exact values the float32 copy holds (that copy is their dequantization), so a step gives the
//   same logits whichever path its size takes, up to float32 summation order.
// - linear_quantized_int8: the same blocks against activations quantized to 8 bits, with integer
//   dot products, as llama.cpp computes them, for any number of rows (opt-in: it changes the
//   numbers).
// - lora_add: LoRA adapters' deltas for the rows of a step that use one, grouped by adapter slot
//   (SGMV: decode rows and prefill runs alike), each present adapter's A and B read once per step.
// - moe_experts: a mixture of experts' selected experts for a step of few rows, each expert's
//   gate, up and down read once for all the rows that chose it, from its own GGUF blocks or its
//   float32 rows (with gpt-oss's expert biases and clamped SwiGLU where given);
//   dequantize_blocks: the float32 values of such blocks, for a wide step's GEMM.
// - few_rows_decode_layers: every decoder layer of an all-decode step of 1-4 sequences in one call
//   and one parallel region (the kernels above, rotary, the KV store and attention chained, the
//   threads meeting at barriers between them), with LoRA deltas where the step has adapters.
// - logsumexp_argmax: what sampling needs of the logits (each row's log-sum-exp and largest
//   entry), in two reads of each row.
// - moe_route: a mixture of experts' router (logits, softmax, top k, weights) for few rows, in one call;
//   moe_layer: moe_route, then moe_experts on its choice, in one call.
//
// kernels/cpu_ops.py builds this file once per instruction set: for AVX2 + FMA + F16C (ops
// torch.ops.brigade), and, on a CPU that has them, for AVX-512 F/BW/VL/DQ with VNNI (ops
// torch.ops.brigade_avx512). Where a kernel has a 512-bit form (BRIGADE_AVX512 below) that build
// uses it; the rest compiles the same 256-bit code in both.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define BRIGADE_AVX512 1
#endif
#ifndef BRIGADE_OPS_NAMESPACE
#define BRIGADE_OPS_NAMESPACE brigade
#endif

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline float horizontal_max(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// The float vector the few-rows kernels below compute in: 16 lanes in the AVX-512 build, 8 in the
// AVX2 one, so that one kernel serves both.
#ifdef BRIGADE_AVX512
using Floats = __m512;
constexpr int kLanes = 16;
inline Floats load_floats(const float* p) { return _mm512_loadu_ps(p); }
// bfloat16 is float32's high half: widen each to 32 bits and shift it up, exactly.
inline Floats load_floats(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline Floats broadcast_float(float v) { return _mm512_set1_ps(v); }
inline Floats zero_floats() { return _mm512_setzero_ps(); }
inline Floats add_floats(Floats a, Floats b) { return _mm512_add_ps(a, b); }
inline Floats mul_floats(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline Floats fma_floats(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline void store_floats(float* p, Floats v) { _mm512_storeu_ps(p, v); }
inline float sum_floats(Floats v) { return _mm512_reduce_add_ps(v); }
// The first n (< kLanes) floats at p, the other lanes zero; nothing past them is read.
inline Floats load_first_floats(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
#else
using Floats = __m256;
constexpr int kLanes = 8;
inline Floats load_floats(const float* p) { return _mm256_loadu_ps(p); }
inline Floats load_floats(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline Floats broadcast_float(float v) { return _mm256_set1_ps(v); }
inline Floats zero_floats() { return _mm256_setzero_ps(); }
inline Floats add_floats(Floats a, Floats b) { return _mm256_add_ps(a, b); }
inline Floats mul_floats(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline Floats fma_floats(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline void store_floats(float* p, Floats v) { _mm256_storeu_ps(p, v); }
inline float sum_floats(Floats v) { return horizontal_sum(v); }
inline Floats load_first_floats(const float* p, int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
}
#endif
// Lane t: the sum of v[t]'s eight lanes (a transpose and add in one: seven horizontal adds
// for eight sums, where a horizontal sum each costs six dependent ops).
inline __m256 sums_of_eight(const __m256 v[8]) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// e^x for x <= 0 (a score minus the maximum), Cephes' expf: x = n ln 2 + r with ln 2 in two
// parts, e^r by its degree-5 polynomial (relative error about 1e-7, as std::exp's float), times 2^n.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // below, e^x is under float's smallest normal: 0
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

// Asks for the rows of a page ahead of their use (`width` values a token, `token_stride` apart):
// pages lie anywhere in the cache, and a head's rows are a strided part of each, where the
// hardware's prefetchers, which follow a stream within a 4 KB page, miss most of them.
template <typename KV>
inline void prefetch_rows(const KV* rows, int64_t begin, int64_t end, int64_t token_stride, int64_t width) {
  constexpr int64_t kPerLine = 64 / sizeof(KV);
  for (int64_t t = begin; t < end; ++t)
    for (int64_t i = 0; i < width; i += kPerLine)
      _mm_prefetch(reinterpret_cast<const char*>(rows + t * token_stride + i), _MM_HINT_T0);
}

// Eight of a KV cache's values as floats: float32 as they are, bfloat16 widened exactly
// (engine.kv_cache_dtype), so the attention's arithmetic is float32 either way.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i widened = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(widened, 16));
}

// The floats attend_kv_heads needs as `scratch` for `heads` query heads over up to `max_len` tokens.
inline int64_t attend_scratch_size(int64_t heads, int64_t max_len) { return heads * (max_len + 2); }

// The query heads of `kv_heads` KV heads from `kv_head` on (`group` query heads each, in order,
// as q, sinks and out hold them) attend over one sequence's `len` tokens: scores for the whole
// context, softmax, then the weighted sum of values. Each page's keys, then each page's values,
// are read once for all these heads, the next page asked for while one is used. Scores come eight
// tokens of a page at a time (eight dot products side by side, summed by sums_of_eight), the
// softmax's exponentials eight at a time. With the head size a compile-time constant, a head's
// output accumulator stays in registers while it takes a page. `sinks` (nullptr for none) holds
// the heads' sink logits: each joins its head's softmax denominator as a score without a value
// (gpt-oss).
template <int D, typename KV>
void attend_kv_heads(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* table,
                     int64_t len, int64_t block_size, int64_t token_stride, int64_t kv_head, int64_t kv_heads,
                     int64_t group, float scale, const float* sinks, float* scratch, float* out) {
  constexpr int kVectors = D / 8;
  const int64_t heads = kv_heads * group, width = kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  const __m256 scales = _mm256_set1_ps(scale);
  float* max_scores = scratch + heads * len;
  float* sums = max_scores + heads;
  const KV* k_heads = k_cache + kv_head * D;
  const KV* v_heads = v_cache + kv_head * D;
  for (int64_t h = 0; h < heads; ++h)
    max_scores[h] = sinks != nullptr ? sinks[h] : -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * block_size, n = std::min(block_size, len - first);
    for (int64_t h = 0; h < heads; ++h) {
      if (b + 1 < num_blocks)  // the next page's rows, a share with each head
        prefetch_rows(k_heads + table[b + 1] * block_stride, h * block_size / heads, (h + 1) * block_size / heads,
                      token_stride, width);
      const KV* keys = k_heads + table[b] * block_stride + (h / group) * D;
      const float* query = q + h * D;
      float* scores = scratch + h * len + first;
      __m256 maxima = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      float max_score = max_scores[h];
      int64_t t = 0;
      for (; t + 8 <= n; t += 8) {
        __m256 dots[8];
        for (int j = 0; j < 8; ++j) dots[j] = _mm256_setzero_ps();
        for (int i = 0; i < kVectors; ++i) {
          const __m256 qi = _mm256_loadu_ps(query + 8 * i);
          for (int j = 0; j < 8; ++j)
            dots[j] = _mm256_fmadd_ps(qi, load8(keys + (t + j) * token_stride + 8 * i), dots[j]);
        }
        const __m256 eight = _mm256_mul_ps(sums_of_eight(dots), scales);
        _mm256_storeu_ps(scores + t, eight);
        maxima = _mm256_max_ps(maxima, eight);
      }
      for (; t < n; ++t) {
        const KV* key = keys + t * token_stride;
        __m256 dot = _mm256_setzero_ps();
        for (int i = 0; i < kVectors; ++i) dot = _mm256_fmadd_ps(_mm256_loadu_ps(query + 8 * i), load8(key + 8 * i), dot);
        const float score = horizontal_sum(dot) * scale;
        scores[t] = score;
        max_score = std::max(max_score, score);
      }
      max_scores[h] = std::max(max_score, horizontal_max(maxima));
    }
  }
  prefetch_rows(v_heads + table[0] * block_stride, 0, std::min(block_size, len), token_stride, width);
  for (int64_t h = 0; h < heads; ++h) {
    float* scores = scratch + h * len;
    const float max_score = max_scores[h];
    float sum = sinks != nullptr ? std::exp(sinks[h] - max_score) : 0.f;
    const __m256 shift = _mm256_set1_ps(max_score);
    __m256 exps = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
      _mm256_storeu_ps(scores + t, e);
      exps = _mm256_add_ps(exps, e);
    }
    for (; t < len; ++t) {
      scores[t] = std::exp(scores[t] - max_score);
      sum += scores[t];
    }
    sums[h] = sum + horizontal_sum(exps);
    std::fill(out + h * D, out + (h + 1) * D, 0.f);
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * block_size, n = std::min(block_size, len - first);
    for (int64_t h = 0; h < heads; ++h) {
      if (b + 1 < num_blocks)
        prefetch_rows(v_heads + table[b + 1] * block_stride, h * block_size / heads, (h + 1) * block_size / heads,
                      token_stride, width);
      const KV* values = v_heads + table[b] * block_stride + (h / group) * D;
      const float* weights = scratch + h * len + first;
      __m256 acc[kVectors];
      for (int i = 0; i < kVectors; ++i) acc[i] = _mm256_loadu_ps(out + h * D + 8 * i);
      for (int64_t t = 0; t < n; ++t) {
        const KV* value = values + t * token_stride;
        const __m256 p = _mm256_set1_ps(weights[t]);
        for (int i = 0; i < kVectors; ++i) acc[i] = _mm256_fmadd_ps(p, load8(value + 8 * i), acc[i]);
      }
      for (int i = 0; i < kVectors; ++i) _mm256_storeu_ps(out + h * D + 8 * i, acc[i]);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const __m256 inv = _mm256_set1_ps(1.f / sums[h]);
    for (int i = 0; i < kVectors; ++i)
      _mm256_storeu_ps(out + h * D + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(out + h * D + 8 * i), inv));
  }
}

template <typename KV>
using AttendFn = decltype(&attend_kv_heads<64, KV>);

template <typename KV>
AttendFn<KV> attend_for(int64_t head_dim) {
  switch (head_dim) {
    case 16: return &attend_kv_heads<16, KV>;
    case 32: return &attend_kv_heads<32, KV>;
    case 64: return &attend_kv_heads<64, KV>;
    case 96: return &attend_kv_heads<96, KV>;
    case 128: return &attend_kv_heads<128, KV>;
    case 256: return &attend_kv_heads<256, KV>;
    default: TORCH_CHECK(false, "paged_decode: head_dim ", head_dim, " is not one of 16, 32, 64, 96, 128, 256");
  }
}

// Calls f with a null pointer of the caches' element type: float32, or bfloat16 (engine.kv_cache_dtype).
template <typename F>
void with_kv_type(at::ScalarType type, const char* op, F&& f) {
  if (type == at::kFloat) return f(static_cast<const float*>(nullptr));
  TORCH_CHECK(type == at::kBFloat16, op, ": caches must be float32 or bfloat16, got ", type);
  f(static_cast<const at::BFloat16*>(nullptr));
}

// q [S, Hq, D] float32; k_cache, v_cache [num_blocks, block_size, Hk, D], float32 or bfloat16; block_tables [S, max_blocks];
// seq_lens [S] (the context, the new token included, whose K/V are already in the cache);
// sinks [Hq] float32, each query head's sink logit, or none.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode: q [S, Hq, D] and two caches [N, block_size, Hk, D] of one shape");
  TORCH_CHECK(q.scalar_type() == at::kFloat && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode: q float32 and two caches of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: caches must be contiguous");
  const auto queries = q.contiguous();
  const auto tables = block_tables.to(at::kLong).contiguous();
  const auto lens = seq_lens.to(at::kLong).contiguous();
  const int64_t num_seqs = queries.size(0), num_heads = queries.size(1), head_dim = queries.size(2);
  const int64_t num_cache_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "paged_decode: query and cache heads do not match");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && lens.numel() == num_seqs,
              "paged_decode: one block table row and one length per sequence");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->numel() == num_heads),
              "paged_decode: sinks must be float32 [Hq]");
  const auto sink_values = sinks.has_value() ? sinks->contiguous() : at::Tensor();
  const float* sink_data = sinks.has_value() ? sink_values.data_ptr<float>() : nullptr;
  const int64_t max_blocks = tables.size(1), group = num_heads / num_kv_heads;
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  // Checked here, once, so that the kernel below never reads outside the cache.
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = len_data[s];
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "paged_decode: sequence ", s, " has length ", len,
                " outside 1..", max_blocks * block_size);
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t block = table_data[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_cache_blocks, "paged_decode: block id ", block, " out of range");
    }
  }
  auto out = at::empty_like(queries);
  const float* q_data = queries.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const float scale_f = static_cast<float>(scale);
  // All of a sequence's heads in one item read its pages' rows whole, the prefetchers' best case;
  // items of one KV head where there are too few sequences to keep every thread busy.
  const int64_t kv_heads_per_item = num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / kv_heads_per_item;
  with_kv_type(k_cache.scalar_type(), "paged_decode", [&](auto type) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
    const AttendFn<KV> attend = attend_for<KV>(head_dim);
    const KV* k_data = static_cast<const KV*>(k_cache.data_ptr());
    const KV* v_data = static_cast<const KV*>(v_cache.data_ptr());
    at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(attend_scratch_size(kv_heads_per_item * group, max_blocks * block_size));
      for (int64_t item = begin; item < end; ++item) {
        const int64_t s = item / items_per_seq, h = (item % items_per_seq) * kv_heads_per_item;
        const int64_t offset = (s * num_heads + h * group) * head_dim;
        attend(q_data + offset, k_data, v_data, table_data + s * max_blocks, len_data[s], block_size,
               num_kv_heads * head_dim, h, kv_heads_per_item, group, scale_f,
               sink_data != nullptr ? sink_data + h * group : nullptr, scratch.data(), out_data + offset);
      }
    });
  });
  return out;
}

// Memory a thread will read soon, fetched into its L2 cache a few lines with each output column of
// the product it is computing: add the byte ranges, spread_over(the product's column count), then
// the column loops below call fetch_for_column once a column (they take a LinesAhead, or none).
// A decode step of one to four rows over GGUF blocks is bound more by the core's arithmetic than by
// memory, so a LoRA adapter's A and B rows fetched meanwhile mostly arrive while it computes, where
// read after the product their whole time from memory adds to the step. Spread over the columns, a
// few lines at a time, the requests do not fill the core's queue of misses (a burst of them stalls
// it). Addresses are kept as integers: a range's first line may start before its data.
class LinesAhead {
 public:
  static constexpr uintptr_t kLine = 64;

  void clear() {
    ranges_.clear();
    range_ = 0;
    next_ = 0;
    left_ = per_column_ = 0;
  }
  void add(const void* data, int64_t bytes) {
    if (bytes <= 0) return;
    const auto first = reinterpret_cast<uintptr_t>(data) & ~(kLine - 1);
    const auto last = reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes);  // one past the end
    ranges_.push_back({first, last});
    left_ += static_cast<int64_t>((last - first + kLine - 1) / kLine);
  }
  bool empty() const { return left_ == 0; }
  void spread_over(int64_t columns) { per_column_ = (left_ + columns - 1) / std::max<int64_t>(columns, 1); }
  void fetch_for_column() {
    for (int64_t count = per_column_; count > 0 && left_ > 0; --count, --left_) {
      if (next_ == 0) next_ = ranges_[range_].first;
      // Into L2 on Intel's cores (prefetcht1; AMD's take every hint to all levels): read once, soon.
      __builtin_prefetch(reinterpret_cast<const void*>(next_), 0, 2);
      next_ += kLine;
      if (next_ >= ranges_[range_].second) ++range_, next_ = 0;
    }
  }

 private:
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges_;  // [first line, one past the last byte)
  size_t range_ = 0;
  uintptr_t next_ = 0;  // the next line of ranges_[range_], 0 before its first
  int64_t left_ = 0, per_column_ = 0;
};

// Calls f with the row count 1..4 as a compile-time constant (std::integral_constant), so the
// few-rows loops keep one accumulator set per row in registers.
template <typename F>
void with_row_count(int64_t num_rows, F&& f) {
  switch (num_rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// W: float, or bfloat16 (a LoRA adapter's A kept in half the bytes).
template <int R, typename W = float>
void few_rows_times_weight(const float* x, const W* w, const float* bias, float* out, int64_t in_features,
                           int64_t out_features, int64_t begin, int64_t end, LinesAhead* ahead = nullptr) {
  for (int64_t n = begin; n < end; ++n) {
    if (ahead != nullptr) ahead->fetch_for_column();
    const W* row = w + n * in_features;
    // Four partial sums per input row: enough independent FMAs to keep up with the weight stream.
    Floats acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = zero_floats();
    int64_t k = 0;
    for (; k + 4 * kLanes <= in_features; k += 4 * kLanes) {
      for (int j = 0; j < 4; ++j) {
        const Floats wv = load_floats(row + k + kLanes * j);
        for (int r = 0; r < R; ++r)
          acc[r][j] = fma_floats(load_floats(x + r * in_features + k + kLanes * j), wv, acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float sum = sum_floats(add_floats(add_floats(acc[r][0], acc[r][1]), add_floats(acc[r][2], acc[r][3])));
      // An explicit fma: the compiler may not vectorize it one way for float rows and another
      // for bfloat16 ones, so both give the same bits for the same values.
      for (int64_t t = k; t < in_features; ++t) sum = std::fma(x[r * in_features + t], static_cast<float>(row[t]), sum);
      out[r * out_features + n] = bias ? sum + bias[n] : sum;
    }
  }
}

// x [R, in] with R in 0..4, weight [out, in], bias [out] or none -> [R, out].
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "few_rows_linear: x [R, in] and weight [out, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "few_rows_linear: float32 only");
  TORCH_CHECK(x.size(0) <= 4, "few_rows_linear: at most 4 rows, got ", x.size(0));
  TORCH_CHECK(weight.is_contiguous(), "few_rows_linear: the weight must be contiguous");
  const auto rows = x.contiguous();
  const int64_t num_rows = rows.size(0), in_features = rows.size(1), out_features = weight.size(0);
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out_features, "few_rows_linear: bias [out]");
    bias_c = bias->contiguous();
  }
  auto out = at::empty({num_rows, out_features}, rows.options());
  if (num_rows == 0) return out;
  const float* x_data = rows.data_ptr<float>();
  const float* w_data = weight.data_ptr<float>();
  const float* b_data = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  constexpr int64_t kGrain = 64;  // output rows per task: enough weight bytes to amortize the hand-off
  at::parallel_for(0, out_features, kGrain, [&](int64_t begin, int64_t end) {
    with_row_count(num_rows, [&](auto rows) {
      few_rows_times_weight<decltype(rows)::value>(x_data, w_data, b_data, out_data, in_features, out_features, begin, end);
    });
  });
  return out;
}

// GGUF blocks of 32 weights along a row (ggml's block_q4_1 and block_q8_0), packed once at load
// (kernels/cpu_ops.py, `to_lanes`):
// - the quants reordered so that 8 consecutive weights come out of one 16-byte broadcast with
//   per-lane shifts, no byte shuffles: weight k = 8 v + i (vector v, lane i) sits in 32-bit word
//   i % 4 of its 16 bytes, at nibble (Q4_1) or byte (Q8_0) position 2 v + i / 4, counted within
//   its 16-byte half for Q8_0;
// - the float16 scale widened to float32 in front of its quants, so that an FMA takes it straight
//   from memory instead of converting it in every block;
// - Q4_1's minimums moved out of the blocks to the end of their row, float32 [blocks]: their term,
//   sum over blocks of m_b * sum(x_b), is one short dot product per row instead of work per block.
struct BlockQ4_1 {
  float d;  // w = d * q + m, q in 0..15, m in the row's minimums
  uint8_t qs[16];
};
struct BlockQ8_0 {
  float d;  // w = d * q, q in -128..127
  int8_t qs[32];
};
// MXFP4 (OCP microscaling FP4, ggml's block_mxfp4): 32 E2M1 codes (1 sign, 2 exponent, 1
// mantissa bit) sharing one E8M0 exponent e, packed like Q4_1's nibbles, the exponent widened to
// float32. As ggml does, the codes stand for the E2M1 values doubled, the integers
// 0, 1, 2, 3, 4, 6, 8, 12 (and their negatives), and d for half the block's scale, 2^(e - 128):
// every product d * q is then exact, and finite where the value is (e = 255 stays 2^127, not inf).
struct BlockMXFP4 {
  float d;  // w = d * value(q), q a 4-bit code
  uint8_t qs[16];
};
static_assert(sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 36 && sizeof(BlockMXFP4) == 20,
              "packed block layouts");
constexpr int64_t kBlockWeights = 32;

// A row of packed blocks: its blocks, then (Q4_1) its minimums.
template <typename Block>
constexpr bool kHasMinimums = std::is_same_v<Block, BlockQ4_1>;
template <typename Block>
constexpr int64_t row_bytes(int64_t num_blocks) {
  return num_blocks * (int64_t(sizeof(Block)) + (kHasMinimums<Block> ? int64_t(sizeof(float)) : 0));
}
template <typename Block>
struct PackedRow {
  const Block* blocks;
  const float* minimums;  // [blocks], Q4_1 only
};
template <typename Block>
inline PackedRow<Block> packed_row(const uint8_t* base, int64_t n, int64_t num_blocks) {
  const uint8_t* row = base + n * row_bytes<Block>(num_blocks);
  return {reinterpret_cast<const Block*>(row), reinterpret_cast<const float*>(row + num_blocks * sizeof(Block))};
}

// a[i] * b[i] over n floats, summed into the lanes of a vector: the caller adds it to its own
// lanes and sums them once. The tail is one masked vector, not a chain of dependent scalar adds
// (Q4_1's minimums' term has one float a block: 8 for a row of 256 inputs, all tail at 16 lanes).
inline Floats dot_product_lanes(const float* a, const float* b, int64_t n) {
  Floats sum = zero_floats();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) sum = fma_floats(load_floats(a + i), load_floats(b + i), sum);
  if (i < n) sum = fma_floats(load_first_floats(a + i, n - i), load_first_floats(b + i, n - i), sum);
  return sum;
}

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

inline __m256i broadcast16(const void* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

constexpr int kBlockVectors = kBlockWeights / kLanes;  // vectors of weights in a block: 4, or 2

// One block's weights as the integers q (the scale and minimum apply outside), in vectors of
// kLanes consecutive weights. In the `to_lanes` order, lane j of a vector of the AVX-512 build
// (weights 0-15, or 16-31) is 32-bit word j % 4 of its 16 bytes, as the broadcast puts it there,
// at nibble or byte position j / 4 (4 + j / 4 for Q4_1's weights 16-31).
#ifdef BRIGADE_AVX512
inline __m512i broadcast16x4(const void* p) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Each nibble of a block as the value it stands for in `values` (16 floats): a 16-entry permute
// reads only the low 4 bits of each lane, so the nibble shifted down is its own index, with no
// mask and no int-to-float conversion (both port-0 ops on Intel's 512-bit units).
inline void nibble_values(const uint8_t* qs, const __m512 values, Floats q[kBlockVectors]) {
  const __m512i words = broadcast16x4(qs);
  const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
  q[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(words, shifts), values);
  q[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(words, _mm512_add_epi32(shifts, _mm512_set1_epi32(16))), values);
}
inline void unpack(const BlockQ4_1& block, Floats q[kBlockVectors]) {
  const __m512 values = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f,  //
                                       8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  nibble_values(block.qs, values, q);
}
constexpr bool kScalesQ4_1 = false;  // the 512-bit unpack has no shift to save
inline void unpack_scaled(const BlockQ4_1& block, Floats q[kBlockVectors]) { unpack(block, q); }
inline std::vector<float> scaled_activations(const float*, int64_t) { return {}; }
inline void unpack(const BlockQ8_0& block, Floats q[kBlockVectors]) {
  // Lane j's byte is byte 4 * (j % 4) + j / 4 of its 16: one byte shuffle puts them in lane order,
  // then a sign extension (neither a port-0 op on Intel, as the shifts it replaces were).
  const __m128i order = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int v = 0; v < 2; ++v) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.qs + 16 * v));
    q[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(bytes, order)));
  }
}
// The nibbles as Q4_1's, each the code of an E2M1 value (doubled).
inline void unpack(const BlockMXFP4& block, Floats q[kBlockVectors]) {
  const __m512 values = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 6.f, 8.f, 12.f,  //
                                       -0.f, -1.f, -2.f, -3.f, -4.f, -6.f, -8.f, -12.f);
  nibble_values(block.qs, values, q);
}
#else
inline void unpack(const BlockQ4_1& block, Floats q[kBlockVectors]) {
  const __m256i words = broadcast16(block.qs);
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int v = 0; v < 4; ++v) {
    const __m256i shifts = _mm256_setr_epi32(8 * v, 8 * v, 8 * v, 8 * v, 8 * v + 4, 8 * v + 4, 8 * v + 4, 8 * v + 4);
    q[v] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(words, shifts), mask));
  }
}
// Q4_1 with one op fewer for most vectors of weights: a nibble is masked where it lies instead of
// shifted down first, so a lane converts q * 2^s, s the nibble's bit position; the activations it
// meets were scaled by 2^-s once (scaled_activations). A power of two scales exactly, so every
// product, and every sum, is the one q * x gives. Vector 3 is shifted down by 24 first: its upper
// lanes' nibble (bits 28-31) would convert as a negative number.
constexpr bool kScalesQ4_1 = true;
constexpr int q4_1_shift(int v, int lane) { return (v < 3 ? 8 * v : 0) + (lane >= 4 ? 4 : 0); }
inline void unpack_scaled(const BlockQ4_1& block, Floats q[kBlockVectors]) {
  const __m256i words = broadcast16(block.qs);
  for (int v = 0; v < 3; ++v) {
    const int low = 0xF << q4_1_shift(v, 0), high = 0xF << q4_1_shift(v, 4);
    q[v] = _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_setr_epi32(low, low, low, low, high, high, high, high)));
  }
  q[3] = _mm256_cvtepi32_ps(
      _mm256_and_si256(_mm256_srli_epi32(words, 24), _mm256_setr_epi32(0xF, 0xF, 0xF, 0xF, 0xF0, 0xF0, 0xF0, 0xF0)));
}
// x [count] (whole blocks) times 2^-s of the weight each value meets in unpack_scaled.
std::vector<float> scaled_activations(const float* x, int64_t count) {
  std::array<float, kBlockWeights> scales{};
  for (int k = 0; k < kBlockWeights; ++k) scales[k] = std::ldexp(1.f, -q4_1_shift(k / kLanes, k % kLanes));
  std::vector<float> scaled(count);
  for (int64_t i = 0; i < count; ++i) scaled[i] = x[i] * scales[i % kBlockWeights];
  return scaled;
}
inline void unpack(const BlockQ8_0& block, Floats q[kBlockVectors]) {
  const __m256i halves[2] = {broadcast16(block.qs), broadcast16(block.qs + 16)};
  for (int v = 0; v < 4; ++v) {
    // Byte position b moves to the top of its word, then an arithmetic shift sign-extends it.
    const int low = 24 - 16 * (v % 2), high = low - 8;
    const __m256i shifts = _mm256_setr_epi32(low, low, low, low, high, high, high, high);
    q[v] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sllv_epi32(halves[v / 2], shifts), 24));
  }
}
// The nibbles as Q4_1's; an 8-entry permute (it reads the low 3 bits of each lane) gives the
// magnitude, and the code's top bit, shifted to bit 31, its sign.
inline void unpack(const BlockMXFP4& block, Floats q[kBlockVectors]) {
  const __m256 magnitudes = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 6.f, 8.f, 12.f);
  const __m256i words = broadcast16(block.qs), sign = _mm256_set1_epi32(std::numeric_limits<int32_t>::min());
  for (int v = 0; v < 4; ++v) {
    const __m256i shifts = _mm256_setr_epi32(8 * v, 8 * v, 8 * v, 8 * v, 8 * v + 4, 8 * v + 4, 8 * v + 4, 8 * v + 4);
    const __m256i codes = _mm256_srlv_epi32(words, shifts);
    const __m256 magnitude = _mm256_permutevar8x32_ps(magnitudes, codes);
    q[v] = _mm256_xor_ps(magnitude, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(codes, 28), sign)));
  }
}
#endif
// out[r, n] = sum over blocks b of d_b * (x_b . q_b), plus for Q4_1 the minimums' term
// sum over b of m_b * sum(x_b) (block_sums, made once per call). Even and odd blocks add into
// separate sums, so that the loop is bound by its work, not by FMA latency.
template <typename Block, int R, bool Scaled>
inline void add_block(const float* x, const Block& block, int64_t b, int64_t num_blocks, Floats acc[R]) {
  Floats q[kBlockVectors];
  if constexpr (Scaled) {
    unpack_scaled(block, q);
  } else {
    unpack(block, q);
  }
  const Floats d = broadcast_float(block.d);
  for (int r = 0; r < R; ++r) {
    const float* xb = x + (r * num_blocks + b) * kBlockWeights;
    Floats dot = fma_floats(load_floats(xb + kLanes), q[1], mul_floats(load_floats(xb), q[0]));
    if constexpr (kBlockVectors == 4)
      dot = add_floats(dot, fma_floats(load_floats(xb + 3 * kLanes), q[3], mul_floats(load_floats(xb + 2 * kLanes), q[2])));
    acc[r] = fma_floats(d, dot, acc[r]);
  }
}

template <typename Block, int R>
void few_rows_times_blocks(const float* x, const float* block_sums, const uint8_t* w, float* out,
                           int64_t num_blocks, int64_t out_features, int64_t begin, int64_t end,
                           LinesAhead* ahead = nullptr) {
  constexpr bool kScaled = kScalesQ4_1 && std::is_same_v<Block, BlockQ4_1>;
  const std::vector<float> scaled = kScaled ? scaled_activations(x, R * num_blocks * kBlockWeights) : std::vector<float>();
  const float* xs = kScaled ? scaled.data() : x;
  for (int64_t n = begin; n < end; ++n) {
    if (ahead != nullptr) ahead->fetch_for_column();
    const PackedRow<Block> row = packed_row<Block>(w, n, num_blocks);
    Floats even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = zero_floats();
    int64_t b = 0;
    for (; b + 2 <= num_blocks; b += 2) {
      add_block<Block, R, kScaled>(xs, row.blocks[b], b, num_blocks, even);
      add_block<Block, R, kScaled>(xs, row.blocks[b + 1], b + 1, num_blocks, odd);
    }
    if (b < num_blocks) add_block<Block, R, kScaled>(xs, row.blocks[b], b, num_blocks, even);
    for (int r = 0; r < R; ++r) {
      Floats sum = add_floats(even[r], odd[r]);
      if constexpr (kHasMinimums<Block>)
        sum = add_floats(sum, dot_product_lanes(row.minimums, block_sums + r * num_blocks, num_blocks));
      out[r * out_features + n] = sum_floats(sum);
    }
  }
}

// Each block of 32 values' sum (x[32 i .. 32 i + 31] for i < count), for Q4_1's minimums' term.
std::vector<float> sums_of_blocks(const float* x, int64_t count) {
  std::vector<float> sums(count);
  for (int64_t i = 0; i < count; ++i) {
    const float* xb = x + i * kBlockWeights;
    Floats sum = add_floats(load_floats(xb), load_floats(xb + kLanes));
    if constexpr (kBlockVectors == 4)
      sum = add_floats(sum, add_floats(load_floats(xb + 2 * kLanes), load_floats(xb + 3 * kLanes)));
    sums[i] = sum_floats(sum);
  }
  return sums;
}

template <typename Block>
at::Tensor few_rows_blocks_linear(const at::Tensor& x, const at::Tensor& blocks) {
  const int64_t num_rows = x.size(0), in_features = x.size(1), out_features = blocks.size(0);
  const int64_t num_blocks = in_features / kBlockWeights;
  TORCH_CHECK(in_features % kBlockWeights == 0 && blocks.size(1) == row_bytes<Block>(num_blocks),
              "few_rows_linear_quantized: ", in_features, " inputs need ", row_bytes<Block>(num_blocks),
              " bytes of packed blocks a row, the weight has ", blocks.size(1));
  const auto rows = x.contiguous();
  auto out = at::empty({num_rows, out_features}, rows.options());
  if (num_rows == 0) return out;
  const float* x_data = rows.data_ptr<float>();
  const std::vector<float> block_sums = kHasMinimums<Block> ? sums_of_blocks(x_data, num_rows * num_blocks)
                                                            : std::vector<float>();
  const float* s_data = block_sums.data();
  const uint8_t* w_data = blocks.data_ptr<uint8_t>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
    with_row_count(num_rows, [&](auto rows) {
      few_rows_times_blocks<Block, decltype(rows)::value>(x_data, s_data, w_data, out_data, num_blocks, out_features,
                                                          begin, end);
    });
  });
  return out;
}

// GGUF K-quant super-blocks of 256 weights (ggml's block_q4_K, block_q5_K, block_q6_K), read as
// the file stores them.
struct BlockQ4_K {
  uint16_t d, dmin;  // float16 super-scales of the 6-bit sub-block scales and minimums
  uint8_t scales[12];
  uint8_t qs[128];
};
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[32];  // the fifth bit of each weight
  uint8_t qs[128];
};
struct BlockQ6_K {
  uint8_t ql[128];  // low 4 bits
  uint8_t qh[64];   // high 2 bits
  int8_t scales[16];
  uint16_t d;
};
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "K-quant layouts");

template <typename Block>
constexpr bool kIsKQuant =
    std::is_same_v<Block, BlockQ4_K> || std::is_same_v<Block, BlockQ5_K> || std::is_same_v<Block, BlockQ6_K>;

// Calls `f(Block{})` with the block type that `format` names: the one place where a format's name
// becomes its type (the ops take the name, as the GGUF reader and the model code spell it).
template <typename F>
void for_block_type(c10::string_view format, const char* op, F&& f) {
  if (format == "Q4_1") return f(BlockQ4_1{});
  if (format == "Q8_0") return f(BlockQ8_0{});
  if (format == "Q4_K") return f(BlockQ4_K{});
  if (format == "Q5_K") return f(BlockQ5_K{});
  if (format == "Q6_K") return f(BlockQ6_K{});
  if (format == "MXFP4") return f(BlockMXFP4{});
  TORCH_CHECK(false, op, ": unknown format ", format, " (Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4)");
}
template <typename Linear>
at::Tensor with_block_type(c10::string_view format, const char* op, Linear&& linear) {
  at::Tensor out;
  for_block_type(format, op, [&](auto block) { out = linear(block); });
  return out;
}
constexpr int64_t kSuperWeights = 256;

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Eight bytes from p, each widened to a 32-bit lane.
inline __m256i widen8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Q4_K / Q5_K's eight 6-bit sub-block scales and minimums (ggml's get_scale_min_k4 for j = 0..7)
// as float32 times the super-scales, all eight at once: the 12 bytes regrouped with ggml's 32-bit masks into
// eight scale bytes then eight minimum bytes.
inline void scales_mins_k4(const uint8_t* packed, float d, float dmin, float scales[8], float mins[8]) {
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  constexpr uint32_t kLow6 = 0x3F3F3F3F, kLow4 = 0x0F0F0F0F, kLow2 = 0x03030303;
  u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);  // minimums 4-7
  const uint32_t mins_low = u[1] & kLow6;                       // minimums 0-3
  u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);         // scales 4-7
  u[2] = mins_low;
  u[0] &= kLow6;  // scales 0-3
  const auto to_float = [&](const uint32_t* bytes, float factor, float* into) {
    const __m256 v = _mm256_cvtepi32_ps(widen8(reinterpret_cast<const uint8_t*>(bytes)));
    _mm256_storeu_ps(into, _mm256_mul_ps(v, _mm256_set1_ps(factor)));
  };
  to_float(u, d, scales);
  to_float(u + 2, dmin, mins);
}

// A sub-block's 32 quant bytes as four vectors of 8 weights in 32-bit lanes (Signed: int8).
template <bool Signed>
inline void widen32(__m256i bytes, __m256i out[4]) {
  const __m128i halves[2] = {_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)};
  for (int i = 0; i < 4; ++i) {
    const __m128i eight = i % 2 ? _mm_unpackhi_epi64(halves[i / 2], halves[i / 2]) : halves[i / 2];
    out[i] = Signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
  }
}

// Q6_K, half `half` (128 weights) of a super-block: the signed quants q - 32 of its sub-blocks
// 4 half + t (t = 0..3), 32 bytes each. ql byte l holds weights l (low nibble) and l + 64 (high),
// byte l + 32 weights l + 32 and l + 96; qh byte l the high bits of l, l + 32, l + 64, l + 96
// (bits 0-1, 2-3, 4-5, 6-7). Both bit fields combine on 32 bytes at a time.
inline void q6_k_quants(const BlockQ6_K& block, int half, __m256i quants[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03), offset = _mm256_set1_epi8(32);
  const uint8_t* ql = block.ql + 64 * half;
  const __m256i l0 = load32(ql), l1 = load32(ql + 32), h = load32(block.qh + 32 * half);
  // Bits shift and shift + 1 of each qh byte moved to bits 4-5 (epi16 shifts, then masked).
  const auto high = [&](int shift) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, shift), low2), 4);
  };
  quants[0] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l0, low4), high(0)), offset);
  quants[1] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l1, low4), high(2)), offset);
  quants[2] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), high(4)), offset);
  quants[3] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), high(6)), offset);
}

// Q5_K's sub-block j (0..7): its 32 five-bit quants as bytes. qs[32 c .. 32 c + 31] hold
// sub-block 2 c in their low nibbles and 2 c + 1 in their high ones; qh byte l has weight l of
// sub-block j in bit j.
inline __m256i q5_k_quants(const BlockQ5_K& block, int j) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), h = load32(block.qh);
  const __m256i raw = load32(block.qs + 32 * (j / 2));
  const __m256i nibble = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, low4);
  // Bit j of each qh byte moved to bit 4 (epi16 shifts: what crosses a byte is masked off).
  const __m256i moved = j <= 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4);
  return _mm256_or_si256(nibble, _mm256_and_si256(moved, bit4));
}

// The 256 weights of a super-block, as ggml's dequantize_row_q4_K / q5_K / q6_K compute them, in
// vectors of 8: emit(w, k) for weights k .. k + 7, with one broadcast scale (and minimum) each.
// Q4_K widens 8 quant bytes to 32-bit lanes and takes a nibble with a per-lane shift and mask;
// Q5_K and Q6_K, which combine two bit fields a weight, combine them on 32 bytes at a time first.
template <typename Block, typename Emit>
inline void for_each_weight_vector(const Block& block, Emit&& emit) {
  if constexpr (std::is_same_v<Block, BlockQ6_K>) {
    // Per 128 weights (one half, q6_k_quants): eight scales of 16 weights.
    alignas(32) float scales[16];
    const float d = half_to_float(block.d);
    for (int half = 0; half < 2; ++half) {
      const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block.scales + 8 * half));
      const __m256 scale = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
      _mm256_store_ps(scales + 8 * half, _mm256_mul_ps(scale, _mm256_set1_ps(d)));
    }
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m256i quants[4];
      q6_k_quants(block, half, quants);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {  // weights 32 t .. 32 t + 31 of the half, w = scale (q - 32)
        __m256i q[4];
        widen32<true>(quants[t], q);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v)
          emit(_mm256_mul_ps(_mm256_broadcast_ss(scales + 8 * half + 2 * t + v / 2), _mm256_cvtepi32_ps(q[v])),
               128 * half + 32 * t + 8 * v);
      }
    }
  } else {
    // Per 64 weights (c): qs[32 c .. 32 c + 31] hold sub-block 2 c in their low nibbles and 2 c + 1
    // in their high ones; Q5_K's qh byte l has weight l of sub-block j in bit j.
    alignas(32) float scales[8], mins[8];
    scales_mins_k4(block.scales, half_to_float(block.d), half_to_float(block.dmin), scales, mins);
    const auto emit_vector = [&](__m256i q, int j, int k) {  // w = scale_j q - min_j
      emit(_mm256_fmsub_ps(_mm256_broadcast_ss(scales + j), _mm256_cvtepi32_ps(q), _mm256_broadcast_ss(mins + j)),
           k);
    };
    if constexpr (std::is_same_v<Block, BlockQ5_K>) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m256i q[4];
        widen32<false>(q5_k_quants(block, j), q);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) emit_vector(q[v], j, 32 * j + 8 * v);
      }
    } else {
      const __m256i low4 = _mm256_set1_epi32(0x0F);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const __m256i raw = widen8(block.qs + 32 * c + 8 * v);
          const __m256i q[2] = {_mm256_and_si256(raw, low4), _mm256_srli_epi32(raw, 4)};
#pragma GCC unroll 2
          for (int t = 0; t < 2; ++t) emit_vector(q[t], 2 * c + t, 64 * c + 32 * t + 8 * v);
        }
      }
    }
  }
}

// Each super-block's weights are made once (for_each_weight_vector) and multiply every row of x,
// so the blocks are read once for all the rows. Enough separate sums per row (8 at one row) that
// the loop is bound by its work, not by the latency of the FMAs.
template <typename Block, int R>
void few_rows_times_super_blocks(const float* x, const Block* w, float* out, int64_t num_blocks,
                                 int64_t out_features, int64_t begin, int64_t end, LinesAhead* ahead = nullptr) {
  constexpr int kChains = R == 1 ? 8 : R == 2 ? 4 : 2;
  const int64_t in_features = num_blocks * kSuperWeights;
  for (int64_t n = begin; n < end; ++n) {
    if (ahead != nullptr) ahead->fetch_for_column();
    const Block* row = w + n * num_blocks;
    __m256 acc[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* xb = x + b * kSuperWeights;
      for_each_weight_vector(row[b], [&](__m256 weights, int k) {
        const int chain = (k / 8) % kChains;
        for (int r = 0; r < R; ++r)
          acc[r][chain] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(xb + r * in_features + k), acc[r][chain]);
      });
    }
    for (int r = 0; r < R; ++r) {
      __m256 sum = acc[r][0];
      for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[r][c]);
      out[r * out_features + n] = horizontal_sum(sum);
    }
  }
}

template <typename Block>
at::Tensor few_rows_super_blocks_linear(const at::Tensor& x, const at::Tensor& blocks) {
  const int64_t num_rows = x.size(0), in_features = x.size(1), out_features = blocks.size(0);
  const int64_t num_blocks = in_features / kSuperWeights;
  TORCH_CHECK(in_features % kSuperWeights == 0 && blocks.size(1) == num_blocks * int64_t(sizeof(Block)),
              "few_rows_linear_quantized: ", in_features, " inputs need ", num_blocks, " super-blocks of ",
              sizeof(Block), " bytes a row, the weight has ", blocks.size(1), " bytes");
  const auto rows = x.contiguous();
  auto out = at::empty({num_rows, out_features}, rows.options());
  if (num_rows == 0) return out;
  const float* x_data = rows.data_ptr<float>();
  const Block* w_data = reinterpret_cast<const Block*>(blocks.data_ptr<uint8_t>());
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
    with_row_count(num_rows, [&](auto rows) {
      few_rows_times_super_blocks<Block, decltype(rows)::value>(x_data, w_data, out_data, num_blocks, out_features,
                                                                begin, end);
    });
  });
  return out;
}

// x [R, in] with R in 0..4, blocks [out, in / block weights * block bytes] uint8 in `format`
// (Q4_1, Q8_0 and MXFP4 reordered by `to_lanes`, the K-quants as the file has them) -> [R, out].
at::Tensor few_rows_linear_quantized(const at::Tensor& x, const at::Tensor& blocks, c10::string_view format) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "few_rows_linear_quantized: x [R, in] float32");
  TORCH_CHECK(x.size(0) <= 4, "few_rows_linear_quantized: at most 4 rows, got ", x.size(0));
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "few_rows_linear_quantized: blocks [out, bytes] uint8, contiguous");
  return with_block_type(format, "few_rows_linear_quantized", [&](auto block) {
    using Block = decltype(block);
    if constexpr (kIsKQuant<Block>) {
      return few_rows_super_blocks_linear<Block>(x, blocks);
    } else {
      return few_rows_blocks_linear<Block>(x, blocks);
    }
  });
}

// ---- A mixture of experts from GGUF blocks or float32 rows, for steps of few rows ----
//
// The selected experts of a step's rows, each expert's gate, up and down read from its own blocks
// (few_rows_linear_quantized's formats and layouts) or float32 rows once for all of the rows that
// chose it: the step's (row, expert) pairs are grouped by expert and each group's rows gathered;
// gate and up multiply them a tile of weight rows at a time, SiLU(gate) * up, then down, into one
// output row per pair; each row sums its pairs' outputs times their routing weights, in the order
// of its k choices. gpt-oss's experts add each expert's gate/up and down biases and take its
// clamped SwiGLU instead (GptOssExperts: gate clamped above at the limit, up to [-limit, limit],
// then gate * sigmoid(alpha * gate) * (up + 1)); its down bias is part of the output each routing
// weight scales. The blocks' float32 values are their dequantization (dequantize_blocks below), so
// this computes what the torch path computes from those, up to float32 summation order.

// The bytes of a weight row of `in_features` inputs in Block's layout; -1 where they are not whole blocks.
template <typename Block>
int64_t blocks_row_bytes(int64_t in_features) {
  if constexpr (kIsKQuant<Block>) {
    return in_features % kSuperWeights ? -1 : in_features / kSuperWeights * int64_t(sizeof(Block));
  } else {
    return in_features % kBlockWeights ? -1 : row_bytes<Block>(in_features / kBlockWeights);
  }
}

// out[r * out_features + n] = x[r] . w[n] for r < num_rows, n in [begin, end): chunks of up to four
// rows over the same weight rows, so that a tile is read from memory once and from cache after.
// block_sums (sums_of_blocks of x): Q4_1's, else unused.
template <typename Block>
void rows_times_blocks(const float* x, const float* block_sums, const uint8_t* w, float* out, int64_t in_features,
                       int64_t out_features, int64_t num_rows, int64_t begin, int64_t end) {
  for (int64_t first = 0; first < num_rows; first += 4) {
    with_row_count(std::min<int64_t>(4, num_rows - first), [&](auto count) {
      constexpr int R = decltype(count)::value;
      float* chunk_out = out + first * out_features;
      if constexpr (kIsKQuant<Block>) {
        few_rows_times_super_blocks<Block, R>(x + first * in_features, reinterpret_cast<const Block*>(w), chunk_out,
                                              in_features / kSuperWeights, out_features, begin, end);
      } else {
        const int64_t num_blocks = in_features / kBlockWeights;
        few_rows_times_blocks<Block, R>(x + first * in_features,
                                        block_sums != nullptr ? block_sums + first * num_blocks : nullptr, w,
                                        chunk_out, num_blocks, out_features, begin, end);
      }
    });
  }
}

// rows_times_blocks for a float32 weight [out, in] (format ""): few_rows_linear's kernel.
void rows_times_floats(const float* x, const float* /*block_sums*/, const uint8_t* w, float* out, int64_t in_features,
                       int64_t out_features, int64_t num_rows, int64_t begin, int64_t end) {
  const float* weight = reinterpret_cast<const float*>(w);
  for (int64_t first = 0; first < num_rows; first += 4)
    with_row_count(std::min<int64_t>(4, num_rows - first), [&](auto count) {
      few_rows_times_weight<decltype(count)::value>(x + first * in_features, weight, nullptr,
                                                    out + first * out_features, in_features, out_features, begin, end);
    });
}

// One projection of every expert: blocks [experts, out, bytes] in one format, as rows_times_blocks
// multiplies them, or float32 [experts, out, in] (format ""), each expert's rows contiguous and
// the experts `expert_bytes` apart (a float32 gate and up may be views of one gate_up weight).
struct ExpertBlocks {
  const uint8_t* data;
  int64_t expert_bytes;
  int64_t in_features, out_features;
  bool has_minimums;
  void (*multiply)(const float*, const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);

  const uint8_t* of(int64_t expert) const { return data + expert * expert_bytes; }
};

ExpertBlocks expert_blocks(const at::Tensor& w, c10::string_view format, int64_t num_experts, int64_t out_features,
                           int64_t in_features, const char* name) {
  if (format.empty()) {
    TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kFloat && w.size(0) == num_experts &&
                    w.size(1) == out_features && w.size(2) == in_features && w.stride(2) == 1 &&
                    w.stride(1) == in_features,
                "moe_experts: ", name, " (float32) must be [", num_experts, ", ", out_features, ", ", in_features,
                "] with each expert's rows contiguous, got ", w.sizes(), " ", w.scalar_type());
    return {reinterpret_cast<const uint8_t*>(w.data_ptr<float>()), w.stride(0) * static_cast<int64_t>(sizeof(float)),
            in_features, out_features, false, &rows_times_floats};
  }
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(0) == num_experts &&
                  w.size(1) == out_features,
              "moe_experts: ", name, " must be contiguous uint8 [", num_experts, ", ", out_features,
              ", bytes], got ", w.sizes(), " ", w.scalar_type());
  ExpertBlocks blocks{w.data_ptr<uint8_t>(), 0, in_features, out_features, false, nullptr};
  int64_t row = -1;
  with_block_type(format, "moe_experts", [&](auto block) {
    using Block = decltype(block);
    blocks.has_minimums = kHasMinimums<Block>;
    blocks.multiply = &rows_times_blocks<Block>;
    row = blocks_row_bytes<Block>(in_features);
    return at::Tensor();
  });
  TORCH_CHECK(row > 0 && w.size(2) == row, "moe_experts: ", name, " (", format, ") of ", in_features,
              " inputs needs ", row, " bytes of blocks a row, it has ", w.size(2));
  blocks.expert_bytes = out_features * row;
  return blocks;
}

// gpt-oss's gate * sigmoid(alpha * gate), the gate already clamped.
inline float clamped_glu(float gate, float alpha) { return gate / (1.f + std::exp(-alpha * gate)); }

// A float32 bias [E, width] of the MoE op, contiguous; undefined where none is given.
at::Tensor expert_bias(const c10::optional<at::Tensor>& bias, int64_t num_experts, int64_t width, const char* name) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 2 && bias->size(0) == num_experts &&
                  bias->size(1) == width,
              "moe_experts: ", name, " must be float32 [", num_experts, ", ", width, "], got ",
              bias->sizes(), " ", bias->scalar_type());
  return bias->contiguous();
}

// x [T, H]; weights [T, k] float32 and experts [T, k] int64 (the routing); gate and up
// [E, I, bytes], down [E, H, bytes], each in its format (or float32 [E, I, H] and [E, H, I], format
// ""); gpt-oss's gate_up_bias [E, 2I] (each expert's gate columns, then its up columns) and
// down_bias [E, H], float32 or none; swiglu_limit > 0: gpt-oss's clamped SwiGLU with
// swiglu_alpha, else SiLU(gate) * up -> [T, H].
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& experts,
                       const at::Tensor& gate, c10::string_view gate_format, const at::Tensor& up,
                       c10::string_view up_format, const at::Tensor& down, c10::string_view down_format,
                       const c10::optional<at::Tensor>& gate_up_bias, const c10::optional<at::Tensor>& down_bias,
                       double swiglu_alpha, double swiglu_limit) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "moe_experts: x [T, H] float32");
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == num_tokens && weights.scalar_type() == at::kFloat &&
                  experts.sizes() == weights.sizes() && experts.scalar_type() == at::kLong,
              "moe_experts: weights [T, k] float32 and experts [T, k] int64, one row per row of x");
  TORCH_CHECK(gate.dim() == 3, "moe_experts: gate [experts, intermediate, bytes or in]");
  const int64_t num_experts = gate.size(0), inter = gate.size(1), top_k = experts.size(1);
  const ExpertBlocks gate_w = expert_blocks(gate, gate_format, num_experts, inter, hidden, "gate");
  const ExpertBlocks up_w = expert_blocks(up, up_format, num_experts, inter, hidden, "up");
  const ExpertBlocks down_w = expert_blocks(down, down_format, num_experts, hidden, inter, "down");
  const at::Tensor gate_up_b = expert_bias(gate_up_bias, num_experts, 2 * inter, "gate_up_bias");
  const at::Tensor down_b = expert_bias(down_bias, num_experts, hidden, "down_bias");
  const float* gate_up_b_data = gate_up_b.defined() ? gate_up_b.data_ptr<float>() : nullptr;
  const float* down_b_data = down_b.defined() ? down_b.data_ptr<float>() : nullptr;
  TORCH_CHECK(swiglu_limit >= 0, "moe_experts: swiglu_limit must be >= 0 (0: SiLU), got ", swiglu_limit);
  const float alpha = static_cast<float>(swiglu_alpha), limit = static_cast<float>(swiglu_limit);
  const auto ids = experts.contiguous();
  const auto pair_weights = weights.contiguous();
  const int64_t* id_data = ids.data_ptr<int64_t>();
  const int64_t num_pairs = num_tokens * top_k;
  // The pairs grouped by expert (a counting sort, stable: each group's rows in token order).
  std::vector<int64_t> starts(num_experts + 1, 0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    TORCH_CHECK(id_data[p] >= 0 && id_data[p] < num_experts, "moe_experts: expert id ", id_data[p],
                " outside 0..", num_experts - 1);
    ++starts[id_data[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> position(num_pairs), next(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < num_pairs; ++p) position[p] = next[id_data[p]]++;
  auto out = at::zeros({num_tokens, hidden}, x.options());
  if (num_pairs == 0) return out;
  const auto rows = x.contiguous();
  const float* x_data = rows.data_ptr<float>();
  std::vector<float> gathered(num_pairs * hidden);  // the pairs' rows of x, in group order
  for (int64_t p = 0; p < num_pairs; ++p)
    std::copy(x_data + (p / top_k) * hidden, x_data + (p / top_k + 1) * hidden, gathered.data() + position[p] * hidden);
  const std::vector<float> x_sums = gate_w.has_minimums || up_w.has_minimums
                                        ? sums_of_blocks(gathered.data(), num_pairs * hidden / kBlockWeights)
                                        : std::vector<float>();
  // Tasks of weight rows of one expert: the selected experts' tiles over the threads, a few tasks
  // a thread, each as long a run of rows as that allows (a short run pays the hardware
  // prefetcher's ramp again on every tile of a weight read from memory), in multiples of 32.
  int64_t num_selected = 0;
  for (int64_t e = 0; e < num_experts; ++e) num_selected += starts[e + 1] > starts[e];
  struct Task {
    int64_t expert, begin, end;
  };
  const auto tasks_over = [&](int64_t out_features) {
    const int64_t wanted = std::max<int64_t>(1, 4 * at::get_num_threads());
    const int64_t tile = std::max<int64_t>(32, (num_selected * out_features / wanted + 31) / 32 * 32);
    std::vector<Task> tasks;
    for (int64_t e = 0; e < num_experts; ++e)
      for (int64_t n = 0; starts[e + 1] > starts[e] && n < out_features; n += tile)
        tasks.push_back({e, n, std::min(n + tile, out_features)});
    return tasks;
  };
  // A decode step of a small model is microseconds of work: inline, as lora_add does.
  constexpr int64_t kInlineMultiplyAdds = 1 << 18;
  const bool is_inline = num_pairs * 3 * inter * hidden < kInlineMultiplyAdds;
  const auto run = [&](const std::vector<Task>& tasks, auto&& body) {
    const int64_t count = static_cast<int64_t>(tasks.size());
    at::parallel_for(0, count, is_inline ? count : 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) body(tasks[i]);
    });
  };
  std::vector<float> gate_out(num_pairs * inter), up_out(num_pairs * inter), act(num_pairs * inter);
  run(tasks_over(inter), [&](const Task& task) {
    const int64_t first = starts[task.expert], count = starts[task.expert + 1] - first;
    const float* sums = x_sums.empty() ? nullptr : x_sums.data() + first * (hidden / kBlockWeights);
    const float* xs = gathered.data() + first * hidden;
    gate_w.multiply(xs, sums, gate_w.of(task.expert), gate_out.data() + first * inter, hidden, inter, count,
                    task.begin, task.end);
    up_w.multiply(xs, sums, up_w.of(task.expert), up_out.data() + first * inter, hidden, inter, count, task.begin,
                  task.end);
    const float* bias = gate_up_b_data != nullptr ? gate_up_b_data + task.expert * 2 * inter : nullptr;
    for (int64_t r = first; r < first + count; ++r)
      for (int64_t n = task.begin; n < task.end; ++n) {
        float g = gate_out[r * inter + n], u = up_out[r * inter + n];
        if (bias != nullptr) g += bias[n], u += bias[inter + n];
        // std::min / std::clamp keep a NaN, as torch.clamp does.
        act[r * inter + n] = limit > 0.f
                                 ? clamped_glu(std::min(g, limit), alpha) * (std::clamp(u, -limit, limit) + 1.f)
                                 : g / (1.f + std::exp(-g)) * u;
      }
  });
  const std::vector<float> act_sums =
      down_w.has_minimums ? sums_of_blocks(act.data(), num_pairs * inter / kBlockWeights) : std::vector<float>();
  std::vector<float> down_out(num_pairs * hidden);
  run(tasks_over(hidden), [&](const Task& task) {
    const int64_t first = starts[task.expert], count = starts[task.expert + 1] - first;
    const float* sums = act_sums.empty() ? nullptr : act_sums.data() + first * (inter / kBlockWeights);
    down_w.multiply(act.data() + first * inter, sums, down_w.of(task.expert), down_out.data() + first * hidden,
                    inter, hidden, count, task.begin, task.end);
  });
  const float* w_data = pair_weights.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  for (int64_t p = 0; p < num_pairs; ++p) {
    const float* expert_row = down_out.data() + position[p] * hidden;
    float* row = out_data + (p / top_k) * hidden;
    if (down_b_data != nullptr) {
      const float* bias = down_b_data + id_data[p] * hidden;
      for (int64_t h = 0; h < hidden; ++h) row[h] += w_data[p] * (expert_row[h] + bias[h]);
    } else {
      for (int64_t h = 0; h < hidden; ++h) row[h] += w_data[p] * expert_row[h];
    }
  }
  return out;
}

// The float32 weight [rows, in] of GGUF blocks [rows, bytes] (as few_rows_linear_quantized reads
// them): the values its kernels multiply by, as gguf's dequantizer computes them. A wide step's
// selected experts, one at a time, for the GEMM.
template <typename Block>
void dequantize_rows(const uint8_t* w, float* out, int64_t in_features, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    float* row_out = out + n * in_features;
    if constexpr (kIsKQuant<Block>) {
      const int64_t num_blocks = in_features / kSuperWeights;
      const Block* row = reinterpret_cast<const Block*>(w) + n * num_blocks;
      for (int64_t b = 0; b < num_blocks; ++b)
        for_each_weight_vector(row[b], [&](__m256 weights, int k) {
          _mm256_storeu_ps(row_out + b * kSuperWeights + k, weights);
        });
    } else {
      const int64_t num_blocks = in_features / kBlockWeights;
      const PackedRow<Block> row = packed_row<Block>(w, n, num_blocks);
      for (int64_t b = 0; b < num_blocks; ++b) {
        Floats q[kBlockVectors];
        unpack(row.blocks[b], q);
        const Floats d = broadcast_float(row.blocks[b].d);
        const Floats m = kHasMinimums<Block> ? broadcast_float(row.minimums[b]) : zero_floats();
        // d * q, then + m: two roundings, as gguf's numpy computes them.
        for (int v = 0; v < kBlockVectors; ++v)
          store_floats(row_out + b * kBlockWeights + v * kLanes, add_floats(mul_floats(d, q[v]), m));
      }
    }
  }
}

at::Tensor dequantize_blocks(const at::Tensor& blocks, c10::string_view format) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "dequantize_blocks: blocks [rows, bytes] uint8, contiguous");
  return with_block_type(format, "dequantize_blocks", [&](auto block) {
    using Block = decltype(block);
    const int64_t block_weights = kIsKQuant<Block> ? kSuperWeights : kBlockWeights;
    const int64_t block_bytes = blocks_row_bytes<Block>(block_weights);
    TORCH_CHECK(blocks.size(1) % block_bytes == 0, "dequantize_blocks: ", blocks.size(1),
                " bytes a row are not whole ", format, " blocks of ", block_bytes);
    const int64_t in_features = blocks.size(1) / block_bytes * block_weights;
    auto out = at::empty({blocks.size(0), in_features}, blocks.options().dtype(at::kFloat));
    const uint8_t* w = blocks.data_ptr<uint8_t>();
    float* out_data = out.data_ptr<float>();
    at::parallel_for(0, blocks.size(0), 64, [&](int64_t begin, int64_t end) {
      dequantize_rows<Block>(w, out_data, in_features, begin, end);
    });
    return out;
  });
}

// ---- 8-bit activations (opt-in: engine.cpu_int8_activations) ----
//
// As llama.cpp does: each row of x is quantized into blocks of 32 int8 values q = round(x / d),
// d = max |x| / 127 (kept float32, where ggml rounds it to float16), with d * sum(q) for the
// formats whose blocks carry a minimum (ggml's block_q8_1). A block's dot product with the weight
// quants is then exact in int32 (_mm256_maddubs_epi16 on unsigned x signed bytes, pairs summed by
// _mm256_madd_epi16), and only the scales are float. It changes the numbers (the activations'
// rounding), which is why it is opt-in.
struct ActivationBlocks {
  std::vector<int8_t> q;  // [R, blocks, 32], each block's values in the byte order its weights unpack to
  std::vector<float> d;   // [R, blocks] scale
  std::vector<float> s;   // [R, blocks] d * sum(q)
};

// Rows of ActivationBlocks from one row on, as the kernels read them: block b of row r at r * blocks + b.
struct ActivationRows {
  const int8_t* q;
  const float* d;
  const float* s;
};
inline ActivationRows rows_from(const ActivationBlocks& a, int64_t first_row, int64_t num_blocks) {
  const int64_t i = first_row * num_blocks;
  return {a.q.data() + i * kBlockWeights, a.d.data() + i, a.s.data() + i};
}

// Where weight k of a block lands in the 32 bytes its format unpacks to (unpack_bytes below): the
// activations are stored in that order, so the weights need no byte shuffle.
using BytePositions = std::array<uint8_t, kBlockWeights>;
constexpr BytePositions natural_positions() {
  BytePositions p{};
  for (int k = 0; k < kBlockWeights; ++k) p[k] = k;
  return p;
}
// The `to_lanes` order (see BlockQ4_1): weight k = 8 v + i is nibble (2 v + i / 4) % 2 of byte
// 4 (i % 4) + (2 v + i / 4) / 2; low nibbles unpack to bytes 0-15, high nibbles to 16-31.
constexpr BytePositions q4_1_positions() {
  BytePositions p{};
  for (int k = 0; k < kBlockWeights; ++k) {
    const int v = k / 8, i = k % 8, position = 2 * v + i / 4;
    p[k] = 4 * (i % 4) + position / 2 + 16 * (position % 2);
  }
  return p;
}
// Q8_0 in `to_lanes` order: byte 16 (position / 4) + 4 (i % 4) + position % 4.
constexpr BytePositions q8_0_positions() {
  BytePositions p{};
  for (int k = 0; k < kBlockWeights; ++k) {
    const int v = k / 8, i = k % 8, position = 2 * v + i / 4;
    p[k] = 16 * (position / 4) + 4 * (i % 4) + position % 4;
  }
  return p;
}

// Packing a block's four int32 vectors to bytes (packs_epi32, then packs_epi16) leaves value
// k = 8 v + i (vector v, lane i) at byte 16 (i / 4) + 4 v + i % 4. One dword permute and one
// in-lane byte shuffle move them on to their BytePositions: each 16-byte half of every order
// here draws on at most four of the packed dwords, which the permute gathers into that half.
struct BytePermutation {
  __m256i dwords;
  __m256i bytes;
};
BytePermutation permutation_to(const BytePositions& positions) {
  std::array<int, kBlockWeights> source{};  // target byte -> packed byte
  for (int k = 0; k < kBlockWeights; ++k) source[positions[k]] = 16 * (k % 8 / 4) + 4 * (k / 8) + k % 4;
  alignas(32) int32_t dwords[8] = {};
  alignas(32) int8_t bytes[32] = {};
  for (int half = 0; half < 2; ++half) {
    std::vector<int> used;  // the packed dwords this half draws on, in permute order
    for (int t = 16 * half; t < 16 * half + 16; ++t) {
      const int dword = source[t] / 4;
      auto it = std::find(used.begin(), used.end(), dword);
      if (it == used.end()) {
        TORCH_CHECK(used.size() < 4, "int8 activations: a byte order this permutation cannot make");
        used.push_back(dword);
        it = used.end() - 1;
      }
      bytes[t] = static_cast<int8_t>(4 * (it - used.begin()) + source[t] % 4);
    }
    for (size_t j = 0; j < used.size(); ++j) dwords[4 * half + j] = used[j];
  }
  return {_mm256_load_si256(reinterpret_cast<const __m256i*>(dwords)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes))};
}

// The byte order of a format's unpacked weights, as a permutation made once per format.
template <typename Block>
const BytePermutation& activation_order() {
  static const BytePermutation order = permutation_to(std::is_same_v<Block, BlockQ4_1>   ? q4_1_positions()
                                                      : std::is_same_v<Block, BlockQ8_0> ? q8_0_positions()
                                                                                         : natural_positions());
  return order;
}

inline int horizontal_sum_epi32(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(x);
}

ActivationBlocks quantize_activations(const float* x, int64_t num_rows, int64_t num_blocks,
                                      const BytePermutation& order) {
  ActivationBlocks a{std::vector<int8_t>(num_rows * num_blocks * kBlockWeights),
                     std::vector<float>(num_rows * num_blocks), std::vector<float>(num_rows * num_blocks)};
  const __m256 sign = _mm256_set1_ps(-0.f), largest = _mm256_set1_ps(std::numeric_limits<float>::max());
  for (int64_t i = 0; i < num_rows * num_blocks; ++i) {
    const float* xb = x + i * kBlockWeights;
    __m256 v[4], amax = _mm256_setzero_ps();
    int finite = 0xFF;
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      const __m256 magnitude = _mm256_andnot_ps(sign, v[j]);
      finite &= _mm256_movemask_ps(_mm256_cmp_ps(magnitude, largest, _CMP_LE_OQ));  // false for NaN
      amax = _mm256_max_ps(amax, magnitude);
    }
    if (finite != 0xFF) {  // as in float32: the block's outputs become NaN (its quants stay 0)
      a.d[i] = a.s[i] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    // A block below the smallest normal scale counts as zeros: 1 / d would overflow to inf.
    float d = horizontal_max(amax) / 127.f;
    if (!(d >= std::numeric_limits<float>::min())) d = 0.f;
    const float inverse = d > 0.f ? 1.f / d : 0.f;
    __m256i q[4];
    // cvtps rounds as MXCSR says: to nearest, ties to even (np.rint).
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inverse)));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + i * kBlockWeights),
                        _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(packed, order.dwords), order.bytes));
    a.d[i] = d;
    a.s[i] = d * static_cast<float>(horizontal_sum_epi32(
                     _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]))));
  }
  return a;
}

// The 8 int32 lane sums of unsigned bytes u times signed bytes s (lane j: bytes 4 j .. 4 j + 3).
// AVX2's maddubs saturates pairs at int16: u <= 63 (or the sign trick's |w| <= 128) times
// |s| <= 127 fits, so both forms give the same exact sums.
#ifdef BRIGADE_AVX512
inline __m256i dot_u8_i8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#else
inline __m256i dot_u8_i8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif
// The same for signed bytes w: |w| against s with w's sign moved onto s.
inline __m256i dot_i8_i8(__m256i w, __m256i s) { return dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w)); }

inline __m256i unpack_bytes(const BlockQ4_1& block) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// Block b of weight row `block` against block b of every row of x: acc[r] += d_w d_x (q_w . q_x),
// and minimums[r] += m_w s_x for Q4_1.
template <typename Block, int R>
inline void add_int8_block(ActivationRows a, PackedRow<Block> row, int64_t b, int64_t num_blocks, __m256 acc[R],
                           float minimums[R]) {
  const Block& block = row.blocks[b];
  const float dw = block.d;
  for (int r = 0; r < R; ++r) {
    const int64_t i = r * num_blocks + b;
    const __m256i xq = load32(a.q + i * kBlockWeights);
    __m256i dot;
    if constexpr (kHasMinimums<Block>) {
      dot = dot_u8_i8(unpack_bytes(block), xq);
      minimums[r] += row.minimums[b] * a.s[i];
    } else {
      dot = dot_i8_i8(load32(block.qs), xq);
    }
    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d[i]), _mm256_cvtepi32_ps(dot), acc[r]);
  }
}

// Even and odd blocks add into separate sums, so that the loop is bound by its work, not by the
// latency of the additions.
template <typename Block, int R>
void int8_times_blocks(ActivationRows a, const uint8_t* w, float* out, int64_t num_blocks, int64_t out_features,
                       int64_t begin, int64_t end, LinesAhead* ahead = nullptr) {
  for (int64_t n = begin; n < end; ++n) {
    if (ahead != nullptr) ahead->fetch_for_column();
    const PackedRow<Block> row = packed_row<Block>(w, n, num_blocks);
    __m256 even[R], odd[R];
    float even_min[R], odd_min[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps(), even_min[r] = odd_min[r] = 0.f;
    int64_t b = 0;
    for (; b + 2 <= num_blocks; b += 2) {
      add_int8_block<Block, R>(a, row, b, num_blocks, even, even_min);
      add_int8_block<Block, R>(a, row, b + 1, num_blocks, odd, odd_min);
    }
    if (b < num_blocks) add_int8_block<Block, R>(a, row, b, num_blocks, even, even_min);
    for (int r = 0; r < R; ++r)
      out[r * out_features + n] = horizontal_sum(_mm256_add_ps(even[r], odd[r])) + (even_min[r] + odd_min[r]);
  }
}

// The K-quants against 32-value activation blocks (finer than ggml's one scale per 256, Q8_K):
// each 32-weight sub-block of a super-block meets activation block 8 b + j.
inline __m256 scale_pair(float low, float high) { return _mm256_set_m128(_mm_set1_ps(high), _mm_set1_ps(low)); }

template <typename Block, int R>
void int8_times_super_blocks(ActivationRows a, const Block* w, float* out, int64_t num_blocks,
                             int64_t out_features, int64_t begin, int64_t end, LinesAhead* ahead = nullptr) {
  constexpr int kSub = kSuperWeights / kBlockWeights;
  const int64_t num_act_blocks = num_blocks * kSub;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = begin; n < end; ++n) {
    if (ahead != nullptr) ahead->fetch_for_column();
    const Block* row = w + n * num_blocks;
    // Even and odd sub-blocks add into separate sums (FMA latency); the minimums' terms of a
    // super-block's 8 sub-blocks go in one vector FMA.
    __m256 acc[2][R], minimums[R];
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = minimums[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
      const Block& block = row[b];
      __m256i quants[kSub];  // sub-block j's 32 weights as bytes, natural order
      if constexpr (std::is_same_v<Block, BlockQ6_K>) {
        // Signed 6-bit quants (q - 32); each sub-block of 32 has two scales, one per 16 weights.
        for (int half = 0; half < 2; ++half) q6_k_quants(block, half, quants + 4 * half);
        const float d = half_to_float(block.d);
        for (int j = 0; j < kSub; ++j) {
          // Sub-block j = 4 half + t holds scales 8 half + 2 t and 8 half + 2 t + 1.
          const int first = 8 * (j / 4) + 2 * (j % 4);
          const __m256 scales = _mm256_set_m128(_mm_set1_ps(d * block.scales[first + 1]),
                                                _mm_set1_ps(d * block.scales[first]));
          for (int r = 0; r < R; ++r) {
            const int64_t i = r * num_act_blocks + b * kSub + j;
            const __m256i dot = dot_i8_i8(quants[j], load32(a.q + i * kBlockWeights));
            const __m256 scale = _mm256_mul_ps(scales, _mm256_set1_ps(a.d[i]));
            acc[j & 1][r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc[j & 1][r]);
          }
        }
      } else {
        // Unsigned 4-bit (Q4_K) or 5-bit (Q5_K) quants, a 6-bit scale and minimum per sub-block.
        if constexpr (std::is_same_v<Block, BlockQ5_K>) {
          for (int j = 0; j < kSub; ++j) quants[j] = q5_k_quants(block, j);
        } else {
          for (int c = 0; c < kSub / 2; ++c) {
            const __m256i q = load32(block.qs + 32 * c);
            quants[2 * c] = _mm256_and_si256(q, low4);
            quants[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
          }
        }
        alignas(32) float scales[kSub], mins[kSub];
        scales_mins_k4(block.scales, half_to_float(block.d), half_to_float(block.dmin), scales, mins);
        const __m256 min_vector = _mm256_load_ps(mins);
        for (int r = 0; r < R; ++r) {
          const int64_t first = r * num_act_blocks + b * kSub;
          for (int j = 0; j < kSub; ++j) {
            const __m256i dot = dot_u8_i8(quants[j], load32(a.q + (first + j) * kBlockWeights));
            acc[j & 1][r] = _mm256_fmadd_ps(_mm256_set1_ps(scales[j] * a.d[first + j]), _mm256_cvtepi32_ps(dot),
                                            acc[j & 1][r]);
          }
          minimums[r] = _mm256_fmadd_ps(min_vector, _mm256_loadu_ps(a.s + first), minimums[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      out[r * out_features + n] = horizontal_sum(_mm256_sub_ps(_mm256_add_ps(acc[0][r], acc[1][r]), minimums[r]));
  }
}

template <typename Block>
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& blocks) {
  constexpr bool is_k_quant = kIsKQuant<Block>;
  constexpr int64_t block_weights = is_k_quant ? kSuperWeights : kBlockWeights;
  const int64_t num_rows = x.size(0), in_features = x.size(1), out_features = blocks.size(0);
  const int64_t num_blocks = in_features / block_weights;
  TORCH_CHECK(in_features % block_weights == 0 && blocks.size(1) == row_bytes<Block>(num_blocks),
              "linear_quantized_int8: ", in_features, " inputs need ", row_bytes<Block>(num_blocks),
              " bytes of blocks a row, the weight has ", blocks.size(1));
  const auto rows = x.contiguous();
  auto out = at::empty({num_rows, out_features}, rows.options());
  if (num_rows == 0) return out;
  const int64_t num_act_blocks = in_features / kBlockWeights;
  const ActivationBlocks a =
      quantize_activations(rows.data_ptr<float>(), num_rows, num_act_blocks, activation_order<Block>());
  const uint8_t* w_data = blocks.data_ptr<uint8_t>();
  float* out_data = out.data_ptr<float>();
  // Output features split over the threads; each task takes its weight rows in tiles small enough
  // for L1 and passes every chunk of up to four rows of x over a tile before the next.
  constexpr int64_t kTileRows = 16;
  at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; tile += kTileRows) {
      const int64_t tile_end = std::min(end, tile + kTileRows);
      for (int64_t first = 0; first < num_rows; first += 4) {
        with_row_count(std::min<int64_t>(4, num_rows - first), [&](auto chunk) {
          constexpr int R = decltype(chunk)::value;
          const ActivationRows rows_of_chunk = rows_from(a, first, num_act_blocks);
          float* chunk_out = out_data + first * out_features;
          if constexpr (is_k_quant)
            int8_times_super_blocks<Block, R>(rows_of_chunk, reinterpret_cast<const Block*>(w_data), chunk_out,
                                              num_blocks, out_features, tile, tile_end);
          else
            int8_times_blocks<Block, R>(rows_of_chunk, w_data, chunk_out, num_blocks, out_features, tile, tile_end);
        });
      }
    }
  });
  return out;
}

// x [R, in] (any R) times GGUF blocks with x quantized to 8 bits (see ActivationBlocks).
at::Tensor linear_quantized_int8(const at::Tensor& x, const at::Tensor& blocks, c10::string_view format) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_quantized_int8: x [R, in] float32");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "linear_quantized_int8: blocks [out, bytes] uint8, contiguous");
  return with_block_type(format, "linear_quantized_int8", [&](auto block) {
    using Block = decltype(block);
    // Only experts are MXFP4 (gpt-oss's, llama.cpp's MXFP4_MOE files'), and the MoE op multiplies them in float32.
    if constexpr (std::is_same_v<Block, BlockMXFP4>) {
      TORCH_CHECK(false, "linear_quantized_int8: MXFP4 blocks have no 8-bit activation kernel");
      return at::Tensor();
    } else {
      return int8_linear<Block>(x, blocks);
    }
  });
}

// summed = x + residual (x alone without one), normed = summed / sqrt(mean(summed^2) + eps) * weight.
// out = RMSNorm(row) * weight over one row of `hidden` values.
inline void rms_norm_row(const float* row, const float* weight, float* out, int64_t hidden, float eps) {
  float squares = 0.f;
  for (int64_t h = 0; h < hidden; ++h) squares += row[h] * row[h];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
  for (int64_t h = 0; h < hidden; ++h) out[h] = row[h] * inv * weight[h];
}

// One row's largest value's index (the first, as torch.argmax; the first NaN if any) and
// log(sum(exp(row))), the shift log_softmax subtracts (NaN with a NaN, -inf for a row of -inf).
// One pass for the maximum and its index, eight lanes each keeping its first largest, one for
// the exponentials.
void row_logsumexp_argmax(const float* row, int64_t n, float* log_norm, int64_t* argmax) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i best_at = _mm256_setzero_si256(), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, greater);
    best_at = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), greater));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
  }
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_at[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), best_at);
  float max_value = -std::numeric_limits<float>::infinity();
  int64_t max_at = 0;
  bool has_nan = _mm256_movemask_ps(unordered) != 0;
  for (int lane = 0; lane < 8 && i >= 8; ++lane)
    if (lane_best[lane] > max_value || (lane_best[lane] == max_value && lane_at[lane] < max_at)) {
      max_value = lane_best[lane];
      max_at = lane_at[lane];
    }
  for (int64_t j = i; j < n; ++j) {
    has_nan = has_nan || std::isnan(row[j]);
    if (row[j] > max_value) {
      max_value = row[j];
      max_at = j;
    }
  }
  if (has_nan) {
    *argmax = std::find_if(row, row + n, [](float v) { return std::isnan(v); }) - row;
    *log_norm = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  *argmax = max_at;
  if (std::isinf(max_value)) {  // a row of -inf, or an inf in it
    *log_norm = max_value;
    return;
  }
  const __m256 shift = _mm256_set1_ps(max_value);
  __m256 sums = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8)
    sums = _mm256_add_ps(sums, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + i), shift)));
  float sum = horizontal_sum(sums);
  for (; i < n; ++i) sum += std::exp(row[i] - max_value);
  *log_norm = max_value + std::log(sum);
}

// x [S, V] float32 -> (log_norms [S] float32, argmax [S] int64): each row's log-sum-exp (a
// token's logprob is its logit less it) and largest entry's index. What a sampling step needs of
// the raw logits without writing a [S, V] log_softmax and reading it twice more for argmax.
std::tuple<at::Tensor, at::Tensor> logsumexp_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) >= 1,
              "logsumexp_argmax: x must be float32 [S, V] with V >= 1");
  const auto rows = x.contiguous();
  const int64_t num_rows = rows.size(0), n = rows.size(1);
  auto log_norms = at::empty({num_rows}, x.options());
  auto argmax = at::empty({num_rows}, x.options().dtype(at::kLong));
  const float* data = rows.data_ptr<float>();
  float* norm_data = log_norms.data_ptr<float>();
  int64_t* argmax_data = argmax.data_ptr<int64_t>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_logsumexp_argmax(data + r * n, n, norm_data + r, argmax_data + r);
  });
  return {log_norms, argmax};
}

// A mixture of experts' router for a step of few rows, what model.moe_route computes in five torch
// ops (each a dispatch that costs more than its work at one row): logits = x @ router^T (+ bias);
// then either softmax over all experts, the top k (ties to the lower id), renormalized to sum to 1
// where `normalize`; or, with `softmax_after_topk` (gpt-oss), the top k logits and a softmax over
// those (unscaled, as gpt-oss's router); otherwise the weights times `scaling`. Returns (weights [T, k] float32, experts [T, k] int64, tied),
// each row's experts in descending order of score; `tied`: some row's k-th score equals an expert's
// it left out, where torch.topk (HF's choice) picks among equals in an order of its own, so the
// caller routes that step with torch instead.
std::tuple<at::Tensor, at::Tensor, bool> moe_route(const at::Tensor& x, const at::Tensor& router,
                                             const c10::optional<at::Tensor>& bias, int64_t top_k, bool normalize,
                                             bool softmax_after_topk, double scaling) {
  TORCH_CHECK(x.dim() == 2 && router.dim() == 2 && x.size(1) == router.size(1) && x.scalar_type() == at::kFloat &&
                  router.scalar_type() == at::kFloat && router.is_contiguous(),
              "moe_route: x [T, H] and a contiguous router [E, H], float32");
  const int64_t num_rows = x.size(0), hidden = x.size(1), num_experts = router.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "moe_route: top_k ", top_k, " outside 1..", num_experts);
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == num_experts, "moe_route: bias [E] float32");
    bias_c = bias->contiguous();
  }
  const auto rows = x.contiguous();
  auto weights = at::empty({num_rows, top_k}, rows.options());
  auto experts = at::empty({num_rows, top_k}, rows.options().dtype(at::kLong));
  std::vector<float> logits(4 * num_experts);
  std::vector<char> is_taken(num_experts);
  bool tied = false;
  const float* b_data = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  for (int64_t first = 0; first < num_rows; first += 4) {
    const int64_t count = std::min<int64_t>(4, num_rows - first);
    with_row_count(count, [&](auto rows_now) {
      few_rows_times_weight<decltype(rows_now)::value>(rows.data_ptr<float>() + first * hidden,
                                                       router.data_ptr<float>(), b_data, logits.data(), hidden,
                                                       num_experts, 0, num_experts);
    });
    for (int64_t r = 0; r < count; ++r) {
      float* scores = logits.data() + r * num_experts;
      float* w = weights.data_ptr<float>() + (first + r) * top_k;
      int64_t* e = experts.data_ptr<int64_t>() + (first + r) * top_k;
      // NaN scores: torch.topk counts NaN as the largest, so such a row is routed as torch routes it.
      tied = tied || std::any_of(scores, scores + num_experts, [](float v) { return std::isnan(v); });
      const float largest = *std::max_element(scores, scores + num_experts);
      if (!softmax_after_topk) {  // softmax over every expert first
        float sum = 0.f;
        for (int64_t i = 0; i < num_experts; ++i) sum += scores[i] = std::exp(scores[i] - largest);
        for (int64_t i = 0; i < num_experts; ++i) scores[i] /= sum;
      }
      std::fill(is_taken.begin(), is_taken.end(), 0);
      for (int64_t j = 0; j < top_k; ++j) {  // k passes: k and E are small
        int64_t best = -1;
        for (int64_t i = 0; i < num_experts; ++i)
          if (!is_taken[i] && (best < 0 || scores[i] > scores[best])) best = i;
        is_taken[best] = 1;
        e[j] = best;
        w[j] = scores[best];
      }
      for (int64_t i = 0; i < num_experts; ++i) tied = tied || (!is_taken[i] && scores[i] == w[top_k - 1]);
      if (softmax_after_topk) {  // e[0] holds the largest logit; gpt-oss scales nothing
        float total = 0.f;
        for (int64_t j = 0; j < top_k; ++j) total += w[j] = std::exp(w[j] - scores[e[0]]);
        for (int64_t j = 0; j < top_k; ++j) w[j] /= total;
        continue;
      }
      float total = 0.f;
      if (normalize)
        for (int64_t j = 0; j < top_k; ++j) total += w[j];
      for (int64_t j = 0; j < top_k; ++j) w[j] = (total > 0.f ? w[j] / total : w[j]) * static_cast<float>(scaling);
    }
  }
  return {weights, experts, tied};
}

// A mixture of experts' layer for a step of few rows in one call: moe_route's choice, then
// moe_experts on it. Between the two there is no Python, which cost a sparse layer of a decode
// step more than the router's multiply-adds. `tied`: moe_route's; the output is then empty, and
// the caller routes the step with torch.
std::tuple<at::Tensor, bool> moe_layer(const at::Tensor& x, const at::Tensor& router,
                                       const c10::optional<at::Tensor>& router_bias, int64_t top_k, bool normalize,
                                       bool softmax_after_topk, double scaling, const at::Tensor& gate,
                                       c10::string_view gate_format, const at::Tensor& up, c10::string_view up_format,
                                       const at::Tensor& down, c10::string_view down_format,
                                       const c10::optional<at::Tensor>& gate_up_bias,
                                       const c10::optional<at::Tensor>& down_bias, double swiglu_alpha,
                                       double swiglu_limit) {
  const auto [weights, experts, tied] =
      moe_route(x, router, router_bias, top_k, normalize, softmax_after_topk, scaling);
  if (tied) return {at::empty({0}, x.options()), true};
  return {moe_experts(x, weights, experts, gate, gate_format, up, up_format, down, down_format, gate_up_bias,
                      down_bias, swiglu_alpha, swiglu_limit),
          false};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  weight.numel() == x.size(1),
              "add_rms_norm: x [T, H] and weight [H], float32");
  const bool has_residual = residual.has_value() && residual->defined();
  TORCH_CHECK(!has_residual || residual->sizes() == x.sizes(), "add_rms_norm: residual must be shaped like x");
  const auto rows = x.contiguous();
  const auto w = weight.contiguous();
  at::Tensor summed = has_residual ? rows + *residual : rows;
  summed = summed.contiguous();
  auto normed = at::empty_like(summed);
  const int64_t num_rows = summed.size(0), hidden = summed.size(1);
  const float* s_data = summed.data_ptr<float>();
  const float* w_data = w.data_ptr<float>();
  float* out = normed.data_ptr<float>();
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(s_data + t * hidden, w_data, out + t * hidden, hidden, eps_f);
  });
  return {normed, summed};
}

// [begin, end) of n items for thread t of `threads`.
inline std::pair<int64_t, int64_t> share(int64_t n, int64_t t, int64_t threads) {
  return {n * t / threads, n * (t + 1) / threads};
}

// ---- LoRA deltas (kernels/lora.py has the contract and its torch reference) ----
//
// out[row, module's columns] += B[slot] @ (A[slot] @ x[row]) for every row of a step that has an
// adapter slot, each module of one merged projection in turn (their columns follow one another
// from 0). `rows` holds those rows grouped by slot and `segments` each slot's (slot, start, end)
// run of them, so a slot's A and B are read once per step, from memory, for all of its rows. Two
// passes, each split over threads: the shrink h = A @ x by A's rank rows, then the expand
// out += B @ h by output columns, which few_rows_decode_layers runs with the base weight's
// columns of the same thread.

// out_rows[r][n] += sum over k < rank of h[r][k] * b[k][n], n in [begin, end): b holds B's rank
// rows (stride b_stride), so kLanes columns take one FMA a rank row for each of the R rows of h,
// each b row read once for all of them. A column's sum is the same chain of fmas from zero, in
// the vectors and in the scalar tail alike, so a column gives the same bits whoever takes it.
template <int R, typename W>
void expand_rows(const float* h, int64_t h_stride, const W* b, int64_t b_stride, int64_t rank,
                 float* const* out_rows, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + kLanes <= end; n += kLanes) {
    Floats acc[R];
    for (int r = 0; r < R; ++r) acc[r] = zero_floats();
    for (int64_t k = 0; k < rank; ++k) {
      const Floats bv = load_floats(b + k * b_stride + n);
      for (int r = 0; r < R; ++r) acc[r] = fma_floats(broadcast_float(h[r * h_stride + k]), bv, acc[r]);
    }
    for (int r = 0; r < R; ++r) store_floats(out_rows[r] + n, add_floats(load_floats(out_rows[r] + n), acc[r]));
  }
  for (; n < end; ++n)
    for (int r = 0; r < R; ++r) {
      float sum = 0.0f;
      for (int64_t k = 0; k < rank; ++k)
        sum = std::fma(h[r * h_stride + k], static_cast<float>(b[k * b_stride + n]), sum);
      out_rows[r][n] += sum;
    }
}

// A step's rows that use an adapter, checked once: each row in range and listed once, each
// position in one segment, so that the passes write their rows' outputs and h without locks.
struct LoraRows {
  std::vector<int64_t> rows;                     // the token of each position
  std::vector<std::array<int64_t, 3>> segments;  // (slot, start, stop) over positions
};

LoraRows check_lora_rows(const at::Tensor& rows, const at::Tensor& segments, int64_t num_tokens, int64_t num_slots) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && segments.scalar_type() == at::kLong &&
                  segments.dim() == 2 && segments.size(1) == 3,
              "lora_add: rows [N] and segments [G, 3] int64");
  const auto row_list = rows.contiguous();
  const auto segment_list = segments.contiguous();
  const int64_t* row_data = row_list.data_ptr<int64_t>();
  const int64_t* segment_data = segment_list.data_ptr<int64_t>();
  LoraRows checked{{row_data, row_data + row_list.numel()}, {}};
  const int64_t num_rows = row_list.numel();
  std::vector<char> is_listed(num_tokens, 0), is_covered(num_rows, 0);
  for (const int64_t row : checked.rows) {
    TORCH_CHECK(row >= 0 && row < num_tokens, "lora_add: row ", row, " out of range");
    TORCH_CHECK(!is_listed[row], "lora_add: row ", row, " listed twice");
    is_listed[row] = 1;
  }
  for (int64_t g = 0; g < segment_list.size(0); ++g) {
    const int64_t slot = segment_data[3 * g], start = segment_data[3 * g + 1], stop = segment_data[3 * g + 2];
    TORCH_CHECK(slot >= 0 && slot < num_slots && 0 <= start && start <= stop && stop <= num_rows,
                "lora_add: segment ", g, " (", slot, ", ", start, ", ", stop, ") out of range");
    for (int64_t p = start; p < stop; ++p) {
      TORCH_CHECK(!is_covered[p], "lora_add: segments overlap at position ", p);
      is_covered[p] = 1;
    }
    if (start < stop) checked.segments.push_back({slot, start, stop});
  }
  return checked;
}

// One module's A [slots, max_rank, in] or B [slots, max_rank, width] of every slot, float32 or
// bfloat16 and contiguous; the one-op decode step takes one tensor per module for all layers,
// [layers, slots, max_rank, features], and this is then every layer's, each `layer_elements` on.
struct LoraMatrices {
  const void* data = nullptr;
  bool bfloat16 = false;
  int64_t slots = 0, max_rank = 0, features = 0, layer_elements = 0;

  const void* layer(int64_t l) const {
    const int64_t offset = l * layer_elements;
    return bfloat16 ? static_cast<const void*>(static_cast<const at::BFloat16*>(data) + offset)
                    : static_cast<const void*>(static_cast<const float*>(data) + offset);
  }
};

// `t` checked as one module's A or B (`kind`, "A" or "B"; `features`: "in" or "width"), with
// `layers` layers stacked ahead of its slots, or none (0).
LoraMatrices check_lora_matrices(const at::Tensor& t, int64_t layers, const char* kind, const char* features,
                                 int64_t module) {
  const int64_t dim = layers > 0 ? 4 : 3;
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "lora_add: A and B must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous() && (layers == 0 || t.size(0) == layers), "lora_add: ", kind,
              " of module ", module, " must be contiguous ",
              layers > 0 ? "[layers, slots, max_rank, " : "[slots, max_rank, ", features, "]");
  LoraMatrices matrices;
  matrices.data = t.data_ptr();
  matrices.bfloat16 = t.scalar_type() == at::kBFloat16;
  matrices.slots = t.size(dim - 3);
  matrices.max_rank = t.size(dim - 2);
  matrices.features = t.size(dim - 1);
  matrices.layer_elements = matrices.slots * matrices.max_rank * matrices.features;
  return matrices;
}

// One merged projection's adapters in one layer (its modules' A [slots, max_rank, in] and B [slots,
// max_rank, width], all float32 or all bfloat16; their ranks [modules, slots], which the caller
// keeps), checked against the input and output widths.
struct LoraProjection {
  std::vector<const void*> a, b;
  bool bfloat16 = false;
  std::vector<int64_t> columns;  // where each module's columns start; the last is the total width
  const int64_t* rank_data = nullptr;
  int64_t num_slots = 0, max_rank = 0, in_features = 0;

  int64_t num_modules() const { return static_cast<int64_t>(a.size()); }
  int64_t rank(int64_t module, int64_t slot) const { return rank_data[module * num_slots + slot]; }
  // Calls f with a null pointer of the adapters' element type (float or at::BFloat16).
  template <typename F>
  void with_type(F&& f) const {
    if (bfloat16) return f(static_cast<const at::BFloat16*>(nullptr));
    return f(static_cast<const float*>(nullptr));
  }
};

// The `count` modules of a and b (already checked each as matrices) in layer `layer`. rank_data:
// [count, slots] int64, the caller's checked and kept contiguous. No tensor is made here: a decode
// step checks a hundred projections, and each view costs a dispatch.
LoraProjection check_lora_projection(const LoraMatrices* a, const LoraMatrices* b, int64_t count, int64_t layer,
                                     const int64_t* rank_data, int64_t in_features, int64_t width) {
  TORCH_CHECK(count > 0, "lora_add: one A and one B per module");
  LoraProjection projection;
  projection.num_slots = a[0].slots;
  projection.max_rank = a[0].max_rank;
  projection.in_features = in_features;
  projection.rank_data = rank_data;
  projection.bfloat16 = a[0].bfloat16;
  const char* dtype = a[0].bfloat16 ? "BFloat16" : "Float";
  projection.columns.push_back(0);
  for (int64_t m = 0; m < count; ++m) {
    TORCH_CHECK(a[m].bfloat16 == projection.bfloat16 && a[m].slots == projection.num_slots &&
                    a[m].max_rank == projection.max_rank && a[m].features == in_features,
                "lora_add: A of module ", m, " must be [slots, max_rank, in] of ", dtype);
    TORCH_CHECK(b[m].bfloat16 == projection.bfloat16 && b[m].slots == projection.num_slots &&
                    b[m].max_rank == projection.max_rank,
                "lora_add: B of module ", m, " must be contiguous [slots, max_rank, width] of ", dtype);
    for (int64_t slot = 0; slot < projection.num_slots; ++slot) {
      const int64_t rank = projection.rank(m, slot);
      TORCH_CHECK(rank >= 0 && rank <= projection.max_rank, "lora_add: rank ", rank, " outside 0..",
                  projection.max_rank);
    }
    projection.a.push_back(a[m].layer(layer));
    projection.b.push_back(b[m].layer(layer));
    projection.columns.push_back(projection.columns.back() + b[m].features);
  }
  TORCH_CHECK(projection.columns.back() == width, "lora_add: the modules' widths add up to ",
              projection.columns.back(), ", out has ", width, " columns");
  return projection;
}

// Multiply-adds of a step's deltas on one projection, to decide whether threads pay.
int64_t lora_work(const LoraProjection& projection, const LoraRows& rows) {
  int64_t total = 0;
  for (const auto& [slot, start, stop] : rows.segments)
    for (int64_t m = 0; m < projection.num_modules(); ++m)
      total += (stop - start) * projection.rank(m, slot) *
               (projection.in_features + projection.columns[m + 1] - projection.columns[m]);
  return total;
}

// Rows of a segment that one shrink work item takes: a prefill's long run of one slot spreads
// over the threads by rows as well as by A's rank rows.
constexpr int64_t kLoraChunkRows = 16;

// Thread t's share of a projection's shrink: the (segment, module, chunk of kLoraChunkRows rows,
// rank row) items, numbered in that order and split evenly over `threads`. Calls
// f(segment, module, chunk, rank_begin, rank_end) for each (segment, module, chunk) it has rank rows
// of, so that the shrink and the prefetch of its A rows take the same share.
template <typename F>
void for_shrink_share(const LoraProjection& projection, const LoraRows& rows, int64_t t, int64_t threads, F&& f) {
  int64_t total = 0;
  for (const auto& [slot, start, stop] : rows.segments)
    for (int64_t m = 0; m < projection.num_modules(); ++m)
      total += projection.rank(m, slot) * ((stop - start + kLoraChunkRows - 1) / kLoraChunkRows);
  const auto [first, last] = share(total, t, threads);
  int64_t offset = 0;
  for (const auto& segment : rows.segments) {
    const auto& [slot, start, stop] = segment;
    for (int64_t m = 0; m < projection.num_modules(); ++m) {
      const int64_t rank = projection.rank(m, slot);
      for (int64_t chunk = start; chunk < stop; chunk += kLoraChunkRows, offset += rank) {
        const int64_t begin = std::max<int64_t>(first - offset, 0), end = std::min(last - offset, rank);
        if (begin < end) f(segment, m, chunk, begin, end);
      }
    }
  }
}

// h[m, p, :rank] = A[m][slot] @ x[rows[p]], thread t of `threads` taking its share of the items
// (for_shrink_share). x: [tokens, in] rows of stride x_stride; h: [modules, N, max_rank].
void lora_shrink(const LoraProjection& projection, const LoraRows& rows, const float* x, int64_t x_stride, float* h,
                 int64_t t, int64_t threads) {
  const int64_t in_features = projection.in_features, max_rank = projection.max_rank;
  const int64_t num_rows = static_cast<int64_t>(rows.rows.size());
  projection.with_type([&](auto type) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
    std::vector<float> gathered;  // x's rows of four, where they are not one block of x already
    for_shrink_share(projection, rows, t, threads, [&](const auto& segment, int64_t m, int64_t chunk, int64_t begin,
                                                       int64_t end) {
      const int64_t slot = segment[0], stop = segment[2];
      const W* a_slot = static_cast<const W*>(projection.a[m]) + slot * max_rank * in_features;
      for (int64_t p = chunk; p < std::min(chunk + kLoraChunkRows, stop); p += 4) {
        const int64_t count = std::min<int64_t>(4, stop - p);
        const float* x_rows = x + rows.rows[p] * x_stride;
        bool in_place = x_stride == in_features;
        for (int64_t r = 1; r < count; ++r) in_place = in_place && rows.rows[p + r] == rows.rows[p] + r;
        if (!in_place) {
          gathered.resize(count * in_features);
          for (int64_t r = 0; r < count; ++r)
            std::copy_n(x + rows.rows[p + r] * x_stride, in_features, gathered.data() + r * in_features);
          x_rows = gathered.data();
        }
        with_row_count(count, [&](auto rows_now) {
          few_rows_times_weight<decltype(rows_now)::value>(x_rows, a_slot, nullptr, h + (m * num_rows + p) * max_rank,
                                                           in_features, max_rank, begin, end);
        });
      }
    });
  });
}

// Calls f(segment, module, begin, end) for each module of each segment whose adapter has a rank
// there and whose columns [begin, end) (from the module's first) meet [column_begin, column_end).
template <typename F>
void for_expand_part(const LoraProjection& projection, const LoraRows& rows, int64_t column_begin, int64_t column_end,
                     F&& f) {
  for (const auto& segment : rows.segments)
    for (int64_t m = 0; m < projection.num_modules(); ++m) {
      const int64_t column = projection.columns[m], width = projection.columns[m + 1] - column;
      const int64_t begin = std::max<int64_t>(column_begin - column, 0), end = std::min(column_end - column, width);
      if (projection.rank(m, segment[0]) > 0 && begin < end) f(segment, m, begin, end);
    }
}

// out[rows[p], c] += B[m][slot][c] . h[m, p] for the projection's columns c in [column_begin, column_end).
void lora_expand(const LoraProjection& projection, const LoraRows& rows, const float* h, float* out, int64_t out_stride,
                 int64_t column_begin, int64_t column_end) {
  const int64_t max_rank = projection.max_rank, num_rows = static_cast<int64_t>(rows.rows.size());
  projection.with_type([&](auto type) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
    for_expand_part(projection, rows, column_begin, column_end, [&](const auto& segment, int64_t m, int64_t begin,
                                                                    int64_t end) {
      const auto& [slot, start, stop] = segment;
      const int64_t rank = projection.rank(m, slot), column = projection.columns[m];
      const int64_t width = projection.columns[m + 1] - column;
      const W* b_slot = static_cast<const W*>(projection.b[m]) + slot * max_rank * width;
      for (int64_t p = start; p < stop; p += 4) {
        const int64_t count = std::min<int64_t>(4, stop - p);
        float* out_rows[4];
        for (int64_t r = 0; r < count; ++r) out_rows[r] = out + rows.rows[p + r] * out_stride + column;
        with_row_count(count, [&](auto rows_now) {
          expand_rows<decltype(rows_now)::value>(h + (m * num_rows + p) * max_rank, max_rank, b_slot, width, rank,
                                                 out_rows, begin, end);
        });
      }
    });
  });
}

// The B rows lora_expand reads for columns [column_begin, column_end).
void expand_lines(const LoraProjection& projection, const LoraRows& rows, int64_t column_begin, int64_t column_end,
                  LinesAhead& ahead) {
  const int64_t element = projection.bfloat16 ? 2 : 4;
  for_expand_part(projection, rows, column_begin, column_end, [&](const auto& segment, int64_t m, int64_t begin,
                                                                  int64_t end) {
    const int64_t slot = segment[0], width = projection.columns[m + 1] - projection.columns[m];
    const char* b_slot = static_cast<const char*>(projection.b[m]) + slot * projection.max_rank * width * element;
    for (int64_t k = 0; k < projection.rank(m, slot); ++k)
      ahead.add(b_slot + (k * width + begin) * element, (end - begin) * element);
  });
}

// The A rows thread t's lora_shrink reads (a decode step's few rows are one chunk a segment, so
// each row is added once).
void shrink_lines(const LoraProjection& projection, const LoraRows& rows, int64_t t, int64_t threads,
                  LinesAhead& ahead) {
  const int64_t element = projection.bfloat16 ? 2 : 4, in_features = projection.in_features;
  for_shrink_share(projection, rows, t, threads, [&](const auto& segment, int64_t m, int64_t, int64_t begin,
                                                     int64_t end) {
    const int64_t row_bytes = in_features * element;
    const char* a_slot = static_cast<const char*>(projection.a[m]) + segment[0] * projection.max_rank * row_bytes;
    ahead.add(a_slot + begin * row_bytes, (end - begin) * row_bytes);
  });
}

// The op: out is updated in place (the schema marks it written).
void lora_add(at::Tensor out, const at::Tensor& x, at::TensorList a, at::TensorList b, const at::Tensor& ranks,
              const at::Tensor& rows, const at::Tensor& segments) {
  TORCH_CHECK(!a.empty(), "lora_add: one A and one B per module");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 &&
                  out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat,
              "lora_add: out [T, W] (rows contiguous) and x [T, in], float32");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.dim() == 2 && ranks.size(0) == static_cast<int64_t>(a.size()) &&
                  ranks.size(1) == a[0].size(0),
              "lora_add: ranks [modules, slots] int64");
  TORCH_CHECK(b.size() == a.size(), "lora_add: one A and one B per module");
  const auto ranks_c = ranks.contiguous();
  std::vector<LoraMatrices> a_matrices, b_matrices;
  for (size_t m = 0; m < a.size(); ++m) {
    a_matrices.push_back(check_lora_matrices(a[m], 0, "A", "in", m));
    b_matrices.push_back(check_lora_matrices(b[m], 0, "B", "width", m));
  }
  const LoraProjection projection = check_lora_projection(a_matrices.data(), b_matrices.data(), a.size(), 0,
                                                          ranks_c.data_ptr<int64_t>(), x.size(1), out.size(1));
  const LoraRows checked = check_lora_rows(rows, segments, out.size(0), projection.num_slots);
  const int64_t work = lora_work(projection, checked);
  if (work == 0) return;
  const auto input = x.contiguous();
  auto h = at::empty({projection.num_modules(), static_cast<int64_t>(checked.rows.size()), projection.max_rank},
                     input.options());
  const float* x_data = input.data_ptr<float>();
  float *h_data = h.data_ptr<float>(), *out_data = out.data_ptr<float>();
  // A decode step's few rows are tens of microseconds of work: run inline, where waking the other
  // threads would cost more than it saves, most of all on a loaded host.
  constexpr int64_t kInlineMultiplyAdds = 1 << 18;
  const int64_t threads = work < kInlineMultiplyAdds ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
    lora_shrink(projection, checked, x_data, projection.in_features, h_data, t, team);
#pragma omp barrier
    const auto [begin, end] = share(out.size(1), t, team);
    lora_expand(projection, checked, h_data, out_data, out.stride(0), begin, end);
  }
}

// ---- The decode step of a few sequences: every layer in one parallel region ----

// A token's n keys or values into a float32 cache as they are, or into a bfloat16 one rounded to
// nearest even, as torch's conversion rounds (the torch path stores with it).
inline void store_kv_row(const float* values, int64_t n, const at::Tensor& cache, int64_t offset) {
  if (cache.scalar_type() == at::kFloat) {
    std::copy(values, values + n, cache.data_ptr<float>() + offset);
  } else {
    at::BFloat16* out = cache.data_ptr<at::BFloat16>() + offset;
    for (int64_t i = 0; i < n; ++i) out[i] = at::BFloat16(values[i]);
  }
}
//
// A decode step of one to four tokens is a chain of small pieces of work: a layer's four
// matrix-vector products, two norms, rotary, attention and SiLU. Handing each piece to the
// threads in a region of its own (an at::parallel_for each) costs about as much as a product at
// one row, and Python between the layers more. So the whole step runs here in one OpenMP region,
// as llama.cpp's thread pool runs a graph: every thread takes its share of each product's output
// columns and of the attention heads, the short serial pieces (the norms, rotary and the KV
// store, LoRA) run on thread 0, and the threads meet at a barrier between pieces.

// Output columns [begin, end) of one part of a weight, for the step's rows x [R, in] (R <= 4),
// into out (row stride `stride`, column 0 the part's first).
using PartColumns = void (*)(const float* x, int64_t num_rows, int64_t in_features, const uint8_t* w, float* out,
                             int64_t stride, int64_t begin, int64_t end, bool int8_activations, LinesAhead* ahead);

void float_columns(const float* x, int64_t num_rows, int64_t in_features, const uint8_t* w, float* out,
                   int64_t stride, int64_t begin, int64_t end, bool, LinesAhead* ahead) {
  with_row_count(num_rows, [&](auto rows) {
    few_rows_times_weight<decltype(rows)::value>(x, reinterpret_cast<const float*>(w), nullptr, out, in_features,
                                                 stride, begin, end, ahead);
  });
}

template <typename Block>
void blocks_columns(const float* x, int64_t num_rows, int64_t in_features, const uint8_t* w, float* out,
                    int64_t stride, int64_t begin, int64_t end, bool int8_activations, LinesAhead* ahead) {
  const int64_t num_act_blocks = in_features / kBlockWeights;
  with_row_count(num_rows, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    if constexpr (kIsKQuant<Block>) {
      const Block* blocks = reinterpret_cast<const Block*>(w);
      const int64_t num_blocks = in_features / kSuperWeights;
      if (int8_activations) {
        const ActivationBlocks a = quantize_activations(x, R, num_act_blocks, activation_order<Block>());
        int8_times_super_blocks<Block, R>(rows_from(a, 0, num_act_blocks), blocks, out, num_blocks, stride, begin, end,
                                          ahead);
      } else {
        few_rows_times_super_blocks<Block, R>(x, blocks, out, num_blocks, stride, begin, end, ahead);
      }
    } else if (int8_activations) {
      if constexpr (!std::is_same_v<Block, BlockMXFP4>) {  // refused by decode_weight
        const ActivationBlocks a = quantize_activations(x, R, num_act_blocks, activation_order<Block>());
        int8_times_blocks<Block, R>(rows_from(a, 0, num_act_blocks), w, out, num_act_blocks, stride, begin, end,
                                    ahead);
      }
    } else {
      const std::vector<float> sums = kHasMinimums<Block> ? sums_of_blocks(x, R * num_act_blocks) : std::vector<float>();
      few_rows_times_blocks<Block, R>(x, sums.data(), w, out, num_act_blocks, stride, begin, end, ahead);
    }
  });
}

// One of a layer's weights: its parts stacked by output columns, each in its own format.
struct DecodeWeight {
  struct Part {
    const uint8_t* data;
    PartColumns columns;
    int64_t first, rows;  // its output columns [first, first + rows)
  };
  std::vector<Part> parts;
  int64_t in_features = 0, width = 0;
  const float* bias = nullptr;  // [width] or none

  // out[:, begin:end) = x @ W[begin:end)^T (+ bias) for the step's rows.
  // ahead: lines to fetch while doing it (or none).
  void columns(const float* x, int64_t num_rows, float* out, int64_t begin, int64_t end, bool int8,
               LinesAhead* ahead = nullptr) const {
    for (const Part& part : parts) {
      const int64_t lo = std::max(begin, part.first), hi = std::min(end, part.first + part.rows);
      if (lo < hi)
        part.columns(x, num_rows, in_features, part.data, out + part.first, width, lo - part.first, hi - part.first,
                     int8, ahead);
    }
    if (bias != nullptr)
      for (int64_t r = 0; r < num_rows; ++r)
        for (int64_t n = begin; n < end; ++n) out[r * width + n] += bias[n];
  }
};

// A weight's parts checked against the shape the layer needs (the whole check happens before the
// parallel region, where nothing may throw).
DecodeWeight decode_weight(at::TensorList parts, c10::ArrayRef<std::string> formats, int64_t in_features,
                           int64_t width, const c10::optional<at::Tensor>& bias, bool int8_activations,
                           const char* name) {
  DecodeWeight weight;
  weight.in_features = in_features;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& part = parts[i];
    const std::string& format = formats[i];
    TORCH_CHECK(part.dim() == 2 && part.is_contiguous(), "few_rows_decode_layers: ", name, " part ", i,
                " must be a contiguous 2-D tensor");
    PartColumns columns = &float_columns;
    int64_t row_bytes = in_features * int64_t(sizeof(float));
    if (format.empty()) {
      TORCH_CHECK(part.scalar_type() == at::kFloat, "few_rows_decode_layers: ", name, " part ", i,
                  " has no format, so must be float32");
    } else {
      TORCH_CHECK(part.scalar_type() == at::kByte, "few_rows_decode_layers: ", name, " part ", i, " (", format,
                  ") must be uint8 blocks");
      for_block_type(format, "few_rows_decode_layers", [&](auto block) {
        using Block = decltype(block);
        TORCH_CHECK(!(int8_activations && std::is_same_v<Block, BlockMXFP4>),
                    "few_rows_decode_layers: MXFP4 blocks have no 8-bit activation kernel");
        columns = &blocks_columns<Block>;
        row_bytes = blocks_row_bytes<Block>(in_features);
      });
    }
    const int64_t part_bytes = part.size(1) * int64_t(part.element_size());
    TORCH_CHECK(row_bytes > 0 && part_bytes == row_bytes, "few_rows_decode_layers: ", name, " part ", i, " (",
                format.empty() ? "float32" : format, ") has ", part_bytes, " bytes a row where ", in_features,
                " inputs need ", row_bytes);
    weight.parts.push_back({reinterpret_cast<const uint8_t*>(part.data_ptr()), columns, weight.width, part.size(0)});
    weight.width += part.size(0);
  }
  TORCH_CHECK(!weight.parts.empty() && weight.width == width, "few_rows_decode_layers: ", name, " has ", weight.width,
              " output columns in ", parts.size(), " parts, the layer needs ", width);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == width,
                "few_rows_decode_layers: ", name, " bias must be float32 [", width, "]");
    weight.bias = bias->data_ptr<float>();
  }
  return weight;
}

// Every decoder layer of an all-decode step of at most four tokens (one per sequence), in one
// call: a step then crosses from Python once, and its threads start once. The per-layer
// arguments come flattened in layer order: two norms (input, post-attention) a layer; each layer's
// four weights (QKV, O, gate_up, down) as parts_per_weight[4 l + w] parts, each float32 [out, in]
// (format "") or GGUF blocks (few_rows_linear_quantized's, or linear_quantized_int8's with
// int8_activations), stacked by output columns; a QKV bias or None a layer; one K and one V cache a
// layer. qkv is rotated (NeoX halves, the signed full-width cos / sin rows of each token), its k
// and v stored at `slots`, and each query head attends over its sequence's pages (paged_decode's
// kernel). With lora_a non-empty, each projection's output takes its rows' LoRA deltas (lora_add):
// seven A and seven B, in lora_add's module order, each holding its module of every layer
// ([layers, slots, max_rank, features]: one tensor each, as a tensor per layer and module made
// 420 arguments a step for a 30-layer model, each boxed by the dispatcher), and lora_ranks
// [layers, 7, slots].
// Returns (the last layer's output, the residual stream), whose sum the final norm takes.
std::tuple<at::Tensor, at::Tensor> few_rows_decode_layers(
    const at::Tensor& hidden, at::TensorList norms, at::TensorList weights, c10::ArrayRef<std::string> formats,
    c10::IntArrayRef parts_per_weight, const c10::List<c10::optional<at::Tensor>>& qkv_biases, double eps,
    const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
    double scale, bool int8_activations, at::TensorList lora_a, at::TensorList lora_b,
    const c10::optional<at::Tensor>& lora_ranks, const c10::optional<at::Tensor>& lora_rows,
    const c10::optional<at::Tensor>& lora_segments) {
  constexpr int64_t kModules = 7;  // q, k, v, o, gate, up, down
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(num_layers > 0 && static_cast<int64_t>(v_caches.size()) == num_layers &&
                  static_cast<int64_t>(norms.size()) == 2 * num_layers &&
                  static_cast<int64_t>(parts_per_weight.size()) == 4 * num_layers &&
                  static_cast<int64_t>(qkv_biases.size()) == num_layers && formats.size() == weights.size(),
              "few_rows_decode_layers: per layer two norms, four part counts, a QKV bias or None and two caches; "
              "a format per weight part");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.size(0) >= 1 && hidden.size(0) <= 4,
              "few_rows_decode_layers: hidden [T, H] float32 with 1 to 4 tokens");
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const at::Tensor& k0 = k_caches[0];
  TORCH_CHECK(k0.dim() == 4, "few_rows_decode_layers: caches [blocks, block_size, Hk, D]");
  const int64_t num_cache_blocks = k0.size(0), block_size = k0.size(1), num_kv_heads = k0.size(2),
                head_dim = k0.size(3);
  const bool is_bf16_cache = k0.scalar_type() == at::kBFloat16;
  for (int64_t l = 0; l < num_layers; ++l)
    for (const at::Tensor& cache : {k_caches[l], v_caches[l]})
      TORCH_CHECK(cache.sizes() == k0.sizes() && (is_bf16_cache || cache.scalar_type() == at::kFloat) &&
                      cache.scalar_type() == k0.scalar_type() && cache.is_contiguous(),
                  "few_rows_decode_layers: contiguous float32 or bfloat16 caches, all of one shape and dtype");
  TORCH_CHECK(num_heads > 0 && num_heads % num_kv_heads == 0, "few_rows_decode_layers: ", num_heads,
              " query heads for ", num_kv_heads, " KV heads");
  const AttendFn<float> attend_float = attend_for<float>(head_dim);
  const AttendFn<at::BFloat16> attend_bf16 = attend_for<at::BFloat16>(head_dim);
  const int64_t group = num_heads / num_kv_heads, kv_row = num_kv_heads * head_dim, half = head_dim / 2;
  const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * head_dim, attn_width = num_heads * head_dim;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == num_tokens * head_dim && slots.numel() == num_tokens &&
                  slots.scalar_type() == at::kLong,
              "few_rows_decode_layers: cos / sin [T, D] and slots [T] long, one per token");
  const auto cos_c = cos.to(at::kFloat).contiguous(), sin_c = sin.to(at::kFloat).contiguous();
  const auto slots_c = slots.contiguous();
  const auto tables = block_tables.to(at::kLong).contiguous();
  const auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_tokens && lens.numel() == num_tokens,
              "few_rows_decode_layers: one block table row and one length per sequence");
  const int64_t max_blocks = tables.size(1);
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  const int64_t* slot_data = slots_c.data_ptr<int64_t>();
  // Checked here, once, so that nothing below reads or writes outside the caches.
  for (int64_t s = 0; s < num_tokens; ++s) {
    TORCH_CHECK(slot_data[s] >= 0 && slot_data[s] < num_cache_blocks * block_size, "few_rows_decode_layers: slot ",
                slot_data[s], " out of range");
    const int64_t len = len_data[s];
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "few_rows_decode_layers: sequence ", s, " has length ",
                len, " outside 1..", max_blocks * block_size);
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t block = table_data[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_cache_blocks, "few_rows_decode_layers: block id ", block,
                  " out of range");
    }
  }
  // The layers' weights, each checked against its shape; the MLP width from the first gate_up.
  int64_t total_parts = 0;
  for (const int64_t count : parts_per_weight) {
    TORCH_CHECK(count > 0, "few_rows_decode_layers: a weight needs at least one part");
    total_parts += count;
  }
  TORCH_CHECK(total_parts == static_cast<int64_t>(weights.size()), "few_rows_decode_layers: the part counts add up to ",
              total_parts, ", not the ", weights.size(), " parts");
  std::vector<std::array<DecodeWeight, 4>> layers(num_layers);
  int64_t intermediate = 0;
  for (int64_t l = 0, part = 0; l < num_layers; ++l) {
    std::array<at::TensorList, 4> w;
    std::array<c10::ArrayRef<std::string>, 4> f;
    for (int i = 0; i < 4; ++i) {
      const int64_t count = parts_per_weight[4 * l + i];
      w[i] = weights.slice(part, count);
      f[i] = formats.slice(part, count);
      part += count;
    }
    if (l == 0) intermediate = std::accumulate(w[2].begin(), w[2].end(), int64_t(0), [](int64_t n, const at::Tensor& t) {
                   return n + t.size(0);
                 }) / 2;
    layers[l] = {decode_weight(w[0], f[0], hidden_size, qkv_width, qkv_biases.get(l), int8_activations, "QKV"),
                 decode_weight(w[1], f[1], attn_width, hidden_size, c10::nullopt, int8_activations, "O"),
                 decode_weight(w[2], f[2], hidden_size, 2 * intermediate, c10::nullopt, int8_activations, "gate_up"),
                 decode_weight(w[3], f[3], intermediate, hidden_size, c10::nullopt, int8_activations, "down")};
    for (int i = 0; i < 2; ++i)
      TORCH_CHECK(norms[2 * l + i].scalar_type() == at::kFloat && norms[2 * l + i].is_contiguous() &&
                      norms[2 * l + i].numel() == hidden_size,
                  "few_rows_decode_layers: norm weights float32 [", hidden_size, "]");
  }
  const bool has_lora = !lora_a.empty();
  TORCH_CHECK(!has_lora || (static_cast<int64_t>(lora_a.size()) == kModules && lora_b.size() == lora_a.size() &&
                            lora_ranks.has_value() && lora_rows.has_value() && lora_segments.has_value() &&
                            lora_ranks->scalar_type() == at::kLong && lora_ranks->dim() == 3 &&
                            lora_ranks->size(0) == num_layers && lora_ranks->size(1) == kModules),
              "few_rows_decode_layers: LoRA needs A and B of seven modules (each every layer's), ranks "
              "[layers, 7, slots] int64, rows and segments");
  const at::Tensor lora_ranks_c = has_lora ? lora_ranks->contiguous() : at::Tensor();
  // Every layer's adapters checked here, as the weights are: nothing may throw inside the region.
  // The projections' modules in lora_add's order: q, k, v | o | gate, up | down.
  constexpr std::array<std::pair<int64_t, int64_t>, 4> kProjectionModules{{{0, 3}, {3, 1}, {4, 2}, {6, 1}}};
  LoraRows lora_step;
  std::vector<std::array<LoraProjection, 4>> adapters(has_lora ? num_layers : 0);
  int64_t lora_h_size = 0;
  if (has_lora) {
    std::array<LoraMatrices, kModules> a_stacks, b_stacks;
    for (int64_t m = 0; m < kModules; ++m) {
      a_stacks[m] = check_lora_matrices(lora_a[m], num_layers, "A", "in", m);
      b_stacks[m] = check_lora_matrices(lora_b[m], num_layers, "B", "width", m);
    }
    const int64_t num_slots = a_stacks[0].slots, max_rank = a_stacks[0].max_rank;
    for (const auto& stacks : {a_stacks, b_stacks})
      for (const LoraMatrices& matrices : stacks)  // one h buffer serves every projection
        TORCH_CHECK(matrices.slots == num_slots && matrices.max_rank == max_rank,
                    "few_rows_decode_layers: every LoRA A and B needs the first A's ", num_slots, " slots and max_rank ",
                    max_rank);
    TORCH_CHECK(lora_ranks->size(2) == num_slots, "few_rows_decode_layers: LoRA ranks for ", lora_ranks->size(2),
                " slots, A has ", num_slots);
    lora_step = check_lora_rows(*lora_rows, *lora_segments, num_tokens, num_slots);
    const std::array<std::pair<int64_t, int64_t>, 4> widths{{{hidden_size, qkv_width},  // (in, out)
                                                             {attn_width, hidden_size},
                                                             {hidden_size, 2 * intermediate},
                                                             {intermediate, hidden_size}}};
    for (int64_t l = 0; l < num_layers; ++l)
      for (int i = 0; i < 4; ++i) {
        const auto [first, count] = kProjectionModules[i];
        adapters[l][i] = check_lora_projection(&a_stacks[first], &b_stacks[first], count, l,
                                               lora_ranks_c.data_ptr<int64_t>() + (kModules * l + first) * num_slots,
                                               widths[i].first, widths[i].second);
      }
    lora_h_size = 3 * static_cast<int64_t>(lora_step.rows.size()) * max_rank;  // every projection's max_rank
  }
  const bool any_lora = has_lora && !lora_step.segments.empty();
  std::vector<float> lora_h(lora_h_size);  // a projection's shrink: [modules, rows, max_rank]

  const auto options = hidden.options();
  const auto input = hidden.contiguous();
  auto stream = at::empty({num_tokens, hidden_size}, options);  // the residual stream
  auto x = at::empty({num_tokens, hidden_size}, options);       // a norm's output
  auto qkv = at::empty({num_tokens, qkv_width}, options);
  auto attn = at::empty({num_tokens, attn_width}, options);
  auto o = at::empty({num_tokens, hidden_size}, options);
  auto gate_up = at::empty({num_tokens, 2 * intermediate}, options);
  auto act = at::empty({num_tokens, intermediate}, options);
  auto out = at::empty({num_tokens, hidden_size}, options);  // a layer's output
  float *stream_d = stream.data_ptr<float>(), *x_d = x.data_ptr<float>(), *qkv_d = qkv.data_ptr<float>(),
        *attn_d = attn.data_ptr<float>(), *o_d = o.data_ptr<float>(), *gate_up_d = gate_up.data_ptr<float>(),
        *act_d = act.data_ptr<float>(), *out_d = out.data_ptr<float>();
  const float* input_d = input.data_ptr<float>();
  const float *cos_d = cos_c.data_ptr<float>(), *sin_d = sin_c.data_ptr<float>();
  const float eps_f = static_cast<float>(eps), scale_f = static_cast<float>(scale);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const bool lead = t == 0;
    std::vector<float> scratch(attend_scratch_size(1, max_blocks * block_size));
    LinesAhead ahead;
    // result = in @ w, this thread's share of the columns, plus its rows' adapter deltas on the
    // same columns: the shrink first, for all threads' columns, then a barrier. While it multiplies
    // the base weight, the thread fetches the B rows of its expand and the A rows of its share of
    // the next projection's shrink (`next`).
    const auto product = [&](const DecodeWeight& w, const float* in, int64_t in_features, float* result,
                             const LoraProjection* lora, const LoraProjection* next) {
      if (lora != nullptr) {
        lora_shrink(*lora, lora_step, in, in_features, lora_h.data(), t, threads);
#pragma omp barrier
      }
      const auto [begin, end] = share(w.width, t, threads);
      ahead.clear();
      if (lora != nullptr) expand_lines(*lora, lora_step, begin, end, ahead);
      if (next != nullptr) shrink_lines(*next, lora_step, t, threads, ahead);
      ahead.spread_over(end - begin);
      w.columns(in, num_tokens, result, begin, end, int8_activations, ahead.empty() ? nullptr : &ahead);
      if (lora != nullptr) lora_expand(*lora, lora_step, lora_h.data(), result, w.width, begin, end);
    };
    for (int64_t l = 0; l < num_layers; ++l) {
      const auto& [qkv_w, o_w, gate_up_w, down_w] = layers[l];
      // Projection i of this layer's adapters, counting on into the next layer's (4 = its first);
      // none without adapters in the step, or past the last layer.
      const auto lora = [&](int i) -> const LoraProjection* {
        if (!any_lora || (i == 4 && l + 1 == num_layers)) return nullptr;
        return i < 4 ? &adapters[l][i] : &adapters[l + 1][0];
      };
      if (lead) {  // stream += the last layer's output (the input, first); x = RMSNorm(stream)
        const float* add = l == 0 ? input_d : out_d;
        for (int64_t i = 0; i < num_tokens * hidden_size; ++i) stream_d[i] = l == 0 ? add[i] : stream_d[i] + add[i];
        for (int64_t s = 0; s < num_tokens; ++s)
          rms_norm_row(stream_d + s * hidden_size, norms[2 * l].data_ptr<float>(), x_d + s * hidden_size, hidden_size,
                       eps_f);
      }
#pragma omp barrier
      product(qkv_w, x_d, hidden_size, qkv_d, lora(0), lora(1));
#pragma omp barrier
      if (lead) {
        // Rotate each token's q and k heads, then store its k and v at its slot.
        for (int64_t s = 0; s < num_tokens; ++s) {
          const float *c = cos_d + s * head_dim, *sn = sin_d + s * head_dim;
          float* row = qkv_d + s * qkv_width;
          for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
            float* v = row + h * head_dim;
            for (int64_t i = 0; i < half; ++i) {
              const float first = v[i], second = v[i + half];
              v[i] = first * c[i] + second * sn[i];
              v[i + half] = second * c[i + half] + first * sn[i + half];
            }
          }
          const float* k = row + num_heads * head_dim;
          store_kv_row(k, kv_row, k_caches[l], slot_data[s] * kv_row);
          store_kv_row(k + kv_row, kv_row, v_caches[l], slot_data[s] * kv_row);
        }
      }
#pragma omp barrier
      {  // each query head of each token over its sequence's pages
        const auto [begin, end] = share(num_tokens * num_heads, t, threads);
        for (int64_t item = begin; item < end; ++item) {
          const int64_t s = item / num_heads, head = item % num_heads;
          const float* query = qkv_d + s * qkv_width + head * head_dim;
          float* result = attn_d + s * attn_width + head * head_dim;
          if (is_bf16_cache)
            attend_bf16(query, k_caches[l].data_ptr<at::BFloat16>(), v_caches[l].data_ptr<at::BFloat16>(),
                        table_data + s * max_blocks, len_data[s], block_size, kv_row, head / group, 1, 1, scale_f,
                        nullptr, scratch.data(), result);
          else
            attend_float(query, k_caches[l].data_ptr<float>(), v_caches[l].data_ptr<float>(),
                         table_data + s * max_blocks, len_data[s], block_size, kv_row, head / group, 1, 1, scale_f,
                         nullptr, scratch.data(), result);
        }
      }
#pragma omp barrier
      product(o_w, attn_d, attn_width, o_d, lora(1), lora(2));
#pragma omp barrier
      if (lead) {
        for (int64_t i = 0; i < num_tokens * hidden_size; ++i) stream_d[i] += o_d[i];
        for (int64_t s = 0; s < num_tokens; ++s)
          rms_norm_row(stream_d + s * hidden_size, norms[2 * l + 1].data_ptr<float>(), x_d + s * hidden_size,
                       hidden_size, eps_f);
      }
#pragma omp barrier
      product(gate_up_w, x_d, hidden_size, gate_up_d, lora(2), lora(3));
#pragma omp barrier
      {  // act = SiLU(gate) * up
        const auto [begin, end] = share(intermediate, t, threads);
        for (int64_t s = 0; s < num_tokens; ++s)
          for (int64_t i = begin; i < end; ++i) {
            const float g = gate_up_d[s * 2 * intermediate + i];
            act_d[s * intermediate + i] = g / (1.f + std::exp(-g)) * gate_up_d[s * 2 * intermediate + intermediate + i];
          }
      }
#pragma omp barrier
      product(down_w, act_d, intermediate, out_d, lora(3), lora(4));
#pragma omp barrier
    }
  }
  return {out, stream};
}

}  // namespace

// One level of indirection, so that TORCH_LIBRARY sees the namespace BRIGADE_OPS_NAMESPACE names.
#define BRIGADE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define BRIGADE_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

BRIGADE_LIBRARY(BRIGADE_OPS_NAMESPACE, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, Tensor? sinks=None) -> Tensor");
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("few_rows_linear_quantized(Tensor x, Tensor blocks, str format) -> Tensor");
  m.def("linear_quantized_int8(Tensor x, Tensor blocks, str format) -> Tensor");
  m.def(
      "moe_experts(Tensor x, Tensor weights, Tensor experts, Tensor gate, str gate_format, Tensor up, "
      "str up_format, Tensor down, str down_format, Tensor? gate_up_bias=None, Tensor? down_bias=None, "
      "float swiglu_alpha=0.0, float swiglu_limit=0.0) -> Tensor");
  m.def("dequantize_blocks(Tensor blocks, str format) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual=None) -> (Tensor, Tensor)");
  m.def("logsumexp_argmax(Tensor x) -> (Tensor, Tensor)");
  m.def(
      "moe_route(Tensor x, Tensor router, Tensor? bias, int top_k, bool normalize, bool softmax_after_topk, "
      "float scaling) -> (Tensor, Tensor, bool)");
  m.def(
      "moe_layer(Tensor x, Tensor router, Tensor? router_bias, int top_k, bool normalize, bool softmax_after_topk, "
      "float scaling, Tensor gate, str gate_format, Tensor up, str up_format, Tensor down, str down_format, "
      "Tensor? gate_up_bias, Tensor? down_bias, float swiglu_alpha, float swiglu_limit) -> (Tensor, bool)");
  m.def(
      "few_rows_decode_layers(Tensor hidden, Tensor[] norms, Tensor[] weights, str[] formats, "
      "int[] parts_per_weight, Tensor?[] qkv_biases, float eps, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor slots, Tensor block_tables, Tensor seq_lens, int num_heads, float scale, "
      "bool int8_activations, Tensor[] lora_a, Tensor[] lora_b, Tensor? lora_ranks, Tensor? lora_rows, "
      "Tensor? lora_segments) -> (Tensor, Tensor)");
  m.def(
      "lora_add(Tensor(a!) out, Tensor x, Tensor[] a, Tensor[] b, Tensor ranks, Tensor rows, Tensor segments) "
      "-> ()");
}

BRIGADE_LIBRARY_IMPL(BRIGADE_OPS_NAMESPACE, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("few_rows_linear", &few_rows_linear);
  m.impl("few_rows_linear_quantized", &few_rows_linear_quantized);
  m.impl("linear_quantized_int8", &linear_quantized_int8);
  m.impl("moe_experts", &moe_experts);
  m.impl("dequantize_blocks", &dequantize_blocks);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("logsumexp_argmax", &logsumexp_argmax);
  m.impl("moe_route", &moe_route);
  m.impl("moe_layer", &moe_layer);
  m.impl("few_rows_decode_layers", &few_rows_decode_layers);
  m.impl("lora_add", &lora_add);
}
