// Decode attention read in place from the paged KV pool, on the CPU (chapter 6 §6.5, notebook 06 §5c;
// the pool and its block tables are chapter 3's).
//
// One query token per sequence. The torch reference (PagedTorchBackend) first gathers each sequence's
// blocks into a padded [B, L, KVH, D] tensor and then calls SDPA: the K/V bytes cross the memory bus three
// times (read by the gather, written by it, read again by SDPA). This kernel follows the block table itself,
// so every K/V byte is read exactly once, and it does the three query heads that share a K/V head (GQA)
// together, so each key is loaded once for all of them.
//
// Work item = one sequence and some of its K/V heads (all of them when there are enough sequences to keep
// every thread busy); items are independent, so OpenMP hands them to the threads. Per item, three plain loops over the keys the query may see (its context, or the last `window` of it):
//   1. scores[g][t] = scale * q[g] . k[t]  (+ ALiBi bias)
//   2. softmax of each row of scores (max, exp, sum)
//   3. out[g] = sum_t p[g][t] * v[t] / sum
// A sequence's scores fit in L1/L2 (3 heads x 1k keys x 4 B = 12 KB), so "all scores, then the softmax"
// costs nothing extra and needs no online-softmax bookkeeping (the GPU kernel in minfer/kernels/paged_decode.py does
// need it: there a program only sees one tile of keys at a time).
//
// Layout contract (checked on the Python side, minfer/cpu/attention.py):
//   q, out         float32 [B, H, D], contiguous
//   k_cache, v_cache float32 [num_blocks, block_size, KVH, D], contiguous (or bfloat16: minfer_paged_decode_bf16)
//   block_tables   int32 [B, max_blocks], contiguous; context_lens int32 [B]
//   alibi_slopes   float32 [H] or null
// Built with -ffast-math so that the exp loop is vectorized (glibc's libmvec): no value here is inf or NaN.
//
// A quantized pool (kv_cache_dtype int8 / fp8, minfer/attention/kv_quant.py) enters through
// minfer_paged_decode_q8: the caches hold one byte per element and, beside them, one float32 scale per token
// and K/V head (k_scales, v_scales: [num_blocks, block_size, KVH]). Each key row is turned into floats once
// (int8: a convert; fp8: a 256-entry table, exact) into a D-float buffer that the G query heads of its group
// share; its scale multiplies the finished dot product (q . (s k) = s (q . k)), and a value row's scale
// multiplies its softmax weight, so dequantizing costs one multiply per token, not per element.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

constexpr int64_t kMaxHeadsPerItem = 256;  // query heads per work item (checked in Python)

// Calls fn(i, row) for each visible token t = first + i of [first, len), with `row` pointing at that token's
// K (or V) of head `offset / D`: token t lives at offset t % block_size of block table[t / block_size], and
// the tokens of one block lie back to back, `token_stride` floats apart.
// `slot` (block id * block_size + offset) indexes the per-token scales of a quantized pool.
template <typename T, typename Fn>
static inline void for_each_token(const T* cache, const int32_t* table, int64_t first, int64_t len,
                                  int64_t block_size, int64_t token_stride, int64_t offset, Fn&& fn) {
  for (int64_t t = first; t < len;) {
    const int64_t blk = t / block_size, end = std::min(len, (blk + 1) * block_size);
    int64_t slot = (int64_t)table[blk] * block_size + t % block_size;
    const T* row = cache + slot * token_stride + offset;
    for (; t < end; ++t, ++slot, row += token_stride) fn(t - first, row, slot);
  }
}

// How a stored element becomes a float: Float (the float32 pool, no scales), Int8 (a convert), Table (fp8:
// lut[byte]). `row` returns a pointer to D floats: the row itself for Float, else `buf` filled from it.
struct Float {
  using T = float;
  static constexpr bool kScaled = false;
  static inline const float* row(const float* src, float*, int64_t, const float*) { return src; }
};
struct Int8 {
  using T = int8_t;
  static constexpr bool kScaled = true;
  static inline const float* row(const int8_t* src, float* buf, int64_t D, const float*) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) buf[d] = (float)src[d];
    return buf;
  }
};
// A bfloat16 pool (a bfloat16 model's): bfloat16 is the top half of a float32, so widening is a 16-bit shift,
// exact; the arithmetic stays float32 (more precise than SDPA run in bfloat16, and the same for every row).
struct BF16 {
  using T = uint16_t;
  static constexpr bool kScaled = false;
  static inline const float* row(const uint16_t* src, float* buf, int64_t D, const float*) {
    uint32_t* bits = reinterpret_cast<uint32_t*>(buf);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) bits[d] = (uint32_t)src[d] << 16;
    return buf;
  }
};
struct Table {
  using T = uint8_t;
  static constexpr bool kScaled = true;
  static inline const float* row(const uint8_t* src, float* buf, int64_t D, const float* lut) {
    for (int64_t d = 0; d < D; ++d) buf[d] = lut[src[d]];
    return buf;
  }
};

// kHeadDim > 0: the head size is a compile-time constant, so the compiler unrolls the loops over it into
// a few full-width vector instructions (the common sizes get their own copy); 0: any head size.
template <int64_t kHeadDim, typename Elem>
static void paged_decode(
    float* out, const float* q, const typename Elem::T* k_cache, const typename Elem::T* v_cache,
    const float* k_scales, const float* v_scales, const float* lut,
    const int32_t* block_tables, const int32_t* context_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale, int64_t window, const float* alibi_slopes,
    int num_threads) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t G = num_heads / num_kv_heads;     // query heads per K/V head (GQA group)
  const int64_t token_stride = num_kv_heads * D;  // floats from one token's K row to the next
  // Work item = one sequence and a range of its K/V heads. Whole sequences when there are enough of them
  // to keep every thread busy: a token's K row of all heads is one contiguous run of memory, and a block
  // is block_size of them back to back. With few sequences, one K/V head per item, so that even a single
  // sequence is spread over the threads.
  const int64_t kv_per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / kv_per_item;
  const int64_t nh = kv_per_item * G;  // query heads per item

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, acc(nh * D), buf(D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * items_per_seq; ++item) {
      const int64_t b = item / items_per_seq;
      const int64_t kv0 = (item % items_per_seq) * kv_per_item;  // first K/V head of this item
      const int64_t len = context_lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;  // keys this query sees: [first, len)
      const int32_t* table = block_tables + b * max_blocks;
      const float* qb = q + (b * num_heads + kv0 * G) * D;  // query head kv0*G + h is row h
      float* ob = out + (b * num_heads + kv0 * G) * D;
      if (n <= 0) {  // nothing visible (the Python side never asks for this): a zero output, not a NaN
        std::fill(ob, ob + nh * D, 0.f);
        continue;
      }
      scores.resize(nh * n);  // row h: the scores of query head kv0*G + h
      std::fill(acc.begin(), acc.end(), 0.f);

      // 1. scores. The G query heads of a group read the same K/V head (Hugging Face's GQA order: h -> h / G).
      for_each_token(k_cache, table, first, len, block_size, token_stride, kv0 * D,
                     [&](int64_t i, const typename Elem::T* k, int64_t slot) {
        for (int64_t kv = 0; kv < kv_per_item; ++kv) {
          const float* kh = Elem::row(k + kv * D, buf.data(), D, lut);
          const float s_tok = Elem::kScaled ? scale * k_scales[slot * num_kv_heads + kv0 + kv] : scale;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kv * G + g;
            const float* qh = qb + h * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
            scores[h * n + i] = s * s_tok;
          }
        }
      });
      if (alibi_slopes)  // ALiBi: a bias growing with the distance to the query (at position len - 1)
        for (int64_t h = 0; h < nh; ++h)
          for (int64_t i = 0; i < n; ++i) scores[h * n + i] -= alibi_slopes[kv0 * G + h] * (float)(n - 1 - i);

      // 2. softmax of each query head's row (left unnormalized; divided once at the end).
      float inv_sum[kMaxHeadsPerItem];
      for (int64_t h = 0; h < nh; ++h) {
        float* row = scores.data() + h * n;
        float m = row[0];
        for (int64_t i = 1; i < n; ++i) m = std::max(m, row[i]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          row[i] = std::exp(row[i] - m);
          sum += row[i];
        }
        inv_sum[h] = 1.f / sum;
      }

      // 3. weighted sum of the values, read through the same block table.
      for_each_token(v_cache, table, first, len, block_size, token_stride, kv0 * D,
                     [&](int64_t i, const typename Elem::T* v, int64_t slot) {
        for (int64_t kv = 0; kv < kv_per_item; ++kv) {
          const float* vh = Elem::row(v + kv * D, buf.data(), D, lut);
          const float s_tok = Elem::kScaled ? v_scales[slot * num_kv_heads + kv0 + kv] : 1.f;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kv * G + g;
            const float p = scores[h * n + i] * s_tok;
            float* a = acc.data() + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
          }
        }
      });
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < D; ++d) ob[h * D + d] = acc[h * D + d] * inv_sum[h];
    }
  }
}

// The element type picks the pool reader (Float, BF16, Int8, Table), the head size the specialization; the
// scales and lut are null for an unquantized pool.
template <typename Elem>
static void dispatch(float* out, const float* q, const void* k_cache, const void* v_cache, const float* k_scales,
                     const float* v_scales, const float* lut, const int32_t* block_tables,
                     const int32_t* context_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                     const float* alibi_slopes, int num_threads) {
  using T = typename Elem::T;
  auto kernel = head_dim == 64    ? paged_decode<64, Elem>
                : head_dim == 128 ? paged_decode<128, Elem>
                                  : paged_decode<0, Elem>;
  kernel(out, q, (const T*)k_cache, (const T*)v_cache, k_scales, v_scales, lut, block_tables, context_lens,
         num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, window, alibi_slopes,
         num_threads);
}

extern "C" void minfer_paged_decode_f32(
    float* out, const float* q, const float* k_cache, const float* v_cache,
    const int32_t* block_tables, const int32_t* context_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale, int64_t window, const float* alibi_slopes,
    int num_threads) {
  dispatch<Float>(out, q, k_cache, v_cache, nullptr, nullptr, nullptr, block_tables, context_lens, num_seqs,
                  num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, window, alibi_slopes, num_threads);
}

// The bfloat16 pool: k_cache/v_cache bfloat16 bits [num_blocks, block_size, KVH, D]; q and out stay float32.
extern "C" void minfer_paged_decode_bf16(
    float* out, const float* q, const void* k_cache, const void* v_cache,
    const int32_t* block_tables, const int32_t* context_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale, int64_t window, const float* alibi_slopes,
    int num_threads) {
  dispatch<BF16>(out, q, k_cache, v_cache, nullptr, nullptr, nullptr, block_tables, context_lens, num_seqs,
                 num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, window, alibi_slopes, num_threads);
}

// The quantized pool: k_cache/v_cache hold one byte per element (int8 codes, or fp8 bytes decoded by `lut`,
// float32 [256]; lut == null means int8), k_scales/v_scales float32 [num_blocks, block_size, KVH].
extern "C" void minfer_paged_decode_q8(
    float* out, const float* q, const void* k_cache, const void* v_cache, const float* k_scales,
    const float* v_scales, const float* lut, const int32_t* block_tables, const int32_t* context_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale, int64_t window, const float* alibi_slopes,
    int num_threads) {
  (lut ? dispatch<Table> : dispatch<Int8>)(out, q, k_cache, v_cache, k_scales, v_scales, lut, block_tables,
                                           context_lens, num_seqs, num_heads, num_kv_heads, head_dim,
                                           block_size, max_blocks, scale, window, alibi_slopes, num_threads);
}
