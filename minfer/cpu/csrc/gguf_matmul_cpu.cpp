// y = x W^T with W in GGUF's own 4- and 8-bit blocks (Q4_0, Q4_1, Q8_0) and x float32, the way llama.cpp does
// it on a CPU (chapter 5 §5.3; the ideas of ggml's quantized dot products, written here from scratch):
//
//   1. each activation row is quantized ONCE per call to int8 in blocks of 32 (one float scale dx per block,
//      q = round(x / dx), dx = max|x| / 127), keeping the block's integer sum sx = sum q;
//   2. each weight block meets each activation block in an integer dot product
//        AVX2:         _mm256_maddubs_epi16 (u8 x s8 -> pairs summed in int16) + _mm256_madd_epi16 (-> int32)
//        AVX-512 VNNI: _mm256_dpbusd_epi32 (u8 x s8, four products summed straight into int32)
//   3. and one float multiply-add per block turns it into floats:
//        Q4_1: w = q d + m   (q in 0..15)      block = d dx (q . qx) + m dx sx
//        Q4_0: w = (q-8) d  = q d + (-8 d)      the same with m = -8 d
//        Q8_0: w = q d       (q in -128..127)   block = d dx (q . qx)
//
// The weights stay in the file's bytes, repacked (same size) into planes the loads like:
//   qs  uint8 [N, K/2] (Q4: block g's 16 bytes, weight j in the low nibble, j+16 in the high one, as in the
//       file) or int8 [N, K] (Q8_0);  d, m  float16 [N, K/32].
// So a token reads 20 bytes per 32 weights for Q4_1 (18 for Q4_0, 34 for Q8_0), what the GGUF holds.
//
// Why quantize the activations: an int8 x 4-bit product is one byte-wide SIMD lane, 32 of them per 256-bit
// instruction, against 8 float lanes for a float32 dot; the weight never becomes floats at all. The price is
// the rounding of x to 8 bits per block of 32 (relative error <= 1/254 of the block's max), which the tests
// bound against a plain dequantize-then-matmul reference.
//
// Work split: OpenMP threads over output rows n; each weight row is read from memory once per call and, while
// it sits in L1, dotted with all T activation rows (8 at a time, one register accumulator per row), so at a
// batch of 64 a weight byte still crosses the memory bus once. Each row's result is computed by the same
// instructions in the same order whatever T is and however the rows are split over threads: batch-invariant.
//
// Instruction set chosen at run time (isa argument 0 = best this CPU has; 1 scalar, 2 AVX2, 3 AVX-512 VNNI
// to force one, which the tests use to check every path on one machine): the AVX2 and VNNI functions are
// compiled with target attributes, so one build runs on both kinds of CPU.

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MINFER_X86 1
#endif

#include "half.h"  // half_to_float

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRows = 8;  // activation rows per pass over a weight row (register accumulators)

enum WeightType { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };


// The activations, quantized: qx int8 [T, K], dx float [T, K/32], sx int32 [T, K/32].
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s;
};

void quantize_rows(const float* x, int64_t T, int64_t K, QuantizedRows& out) {
  const int64_t G = K / kBlock;
  out.q.resize(T * K);
  out.d.resize(T * G);
  out.s.resize(T * G);
  for (int64_t i = 0; i < T * G; ++i) {
    const float* xb = x + i * kBlock;
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int v = (int)std::nearbyint(xb[j] * id);  // |v| <= 127 (round half to even)
      out.q[i * kBlock + j] = (int8_t)v;
      sum += v;
    }
    out.d[i] = d;
    out.s[i] = sum;
  }
}

struct Weights {
  int type;
  const uint8_t* qs;    // [N, row_bytes]
  const uint16_t* d;    // [N, G] float16
  const uint16_t* m;    // [N, G] float16 (Q4_1 only)
  int64_t row_bytes;    // K / 2 (Q4) or K (Q8_0)
};

// ---- scalar: the reference the SIMD paths must agree with (up to the order of float adds) ----
template <int R>
void rows_scalar(const Weights& w, int64_t n, const QuantizedRows& x, int64_t t0, int64_t K, float* out, int64_t N) {
  const int64_t G = K / kBlock;
  const uint8_t* qs = w.qs + n * w.row_bytes;
  float acc[R] = {0.f};
  for (int64_t g = 0; g < G; ++g) {
    const float dw = half_to_float(w.d[n * G + g]);
    const float mw = w.type == kQ4_1 ? half_to_float(w.m[n * G + g]) : w.type == kQ4_0 ? -8.f * dw : 0.f;
    int8_t wq[kBlock];
    if (w.type == kQ8_0) {
      std::memcpy(wq, qs + g * kBlock, kBlock);
    } else {
      for (int j = 0; j < 16; ++j) {
        wq[j] = (int8_t)(qs[g * 16 + j] & 15);
        wq[j + 16] = (int8_t)(qs[g * 16 + j] >> 4);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = t0 + r;
      const int8_t* xq = x.q.data() + row * K + g * kBlock;
      int32_t dot = 0;
      for (int j = 0; j < kBlock; ++j) dot += (int32_t)wq[j] * (int32_t)xq[j];
      const float dx = x.d[row * G + g];
      acc[r] += dw * dx * (float)dot + mw * dx * (float)x.s[row * G + g];
    }
  }
  for (int r = 0; r < R; ++r) out[(t0 + r) * N + n] = acc[r];
}

#ifdef MINFER_X86
// ---- AVX2 (+FMA, F16C) and AVX-512 VNNI: one template, the integer dot product differs ----
template <bool kVnni>
__attribute__((always_inline)) inline __m256i dot_u8s8(__m256i u, __m256i s);

template <>
__attribute__((always_inline, target("avx2,fma,f16c"))) inline __m256i dot_u8s8<false>(__m256i u, __m256i s) {
  // u in 0..255, s in -127..127; pairs in int16 (cannot saturate here: |u| <= 128 for Q8_0 via the sign
  // trick, <= 15 for Q4), then pairs of those in int32
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

template <>
__attribute__((always_inline, target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni"))) inline __m256i
dot_u8s8<true>(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);  // four u8 x s8 products per int32 lane
}

#define MINFER_SIMD_BODY                                                                                       \
  const int64_t G = K / kBlock;                                                                                \
  const uint8_t* qs = w.qs + n * w.row_bytes;                                                                  \
  __m256 acc[R];                                                                                               \
  float corr[R];                                                                                               \
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); corr[r] = 0.f; }                                 \
  const __m256i low4 = _mm256_set1_epi8(0x0f);                                                                 \
  for (int64_t g = 0; g < G; ++g) {                                                                            \
    const float dw = _cvtsh_ss(w.d[n * G + g]);                                                                \
    __m256i wu, wsign;                                                                                         \
    float mw = 0.f;                                                                                            \
    if (w.type == kQ8_0) {                                                                                     \
      wsign = _mm256_loadu_si256((const __m256i*)(qs + g * kBlock));                                           \
      wu = _mm256_sign_epi8(wsign, wsign); /* |q| as u8 (-128 -> 128) */                                       \
    } else {                                                                                                   \
      const __m128i raw = _mm_loadu_si128((const __m128i*)(qs + g * 16));                                      \
      wu = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4); /* 0..15, j then j+16 */     \
      wsign = wu;                                                                                              \
      mw = w.type == kQ4_1 ? _cvtsh_ss(w.m[n * G + g]) : -8.f * dw;                                            \
    }                                                                                                          \
    for (int r = 0; r < R; ++r) {                                                                              \
      const int64_t row = t0 + r;                                                                              \
      __m256i xs = _mm256_loadu_si256((const __m256i*)(x.q.data() + row * K + g * kBlock));                    \
      if (w.type == kQ8_0) xs = _mm256_sign_epi8(xs, wsign); /* the weight's sign moves onto x */              \
      const __m256i p = dot_u8s8<kVnni>(wu, xs);                                                               \
      const float dx = x.d[row * G + g];                                                                       \
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), _mm256_cvtepi32_ps(p), acc[r]);                        \
      if (w.type != kQ8_0) corr[r] += mw * dx * (float)x.s[row * G + g];                                       \
    }                                                                                                          \
  }                                                                                                            \
  for (int r = 0; r < R; ++r) {                                                                                \
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));             \
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));                                                      \
    const __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));                                               \
    out[(t0 + r) * N + n] = _mm_cvtss_f32(h1) + corr[r];                                                       \
  }

template <int R>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Weights& w, int64_t n, const QuantizedRows& x,
                                                         int64_t t0, int64_t K, float* out, int64_t N) {
  constexpr bool kVnni = false;
  MINFER_SIMD_BODY
}

template <int R>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni"))) void rows_vnni(
    const Weights& w, int64_t n, const QuantizedRows& x, int64_t t0, int64_t K, float* out, int64_t N) {
  constexpr bool kVnni = true;
  MINFER_SIMD_BODY
}
#undef MINFER_SIMD_BODY
#endif

using RowsFn = void (*)(const Weights&, int64_t, const QuantizedRows&, int64_t, int64_t, float*, int64_t);

RowsFn pick(int isa, int rows) {
#define MINFER_PICK(fn)                                                                                    \
  switch (rows) {                                                                                          \
    case 1: return fn<1>; case 2: return fn<2>; case 3: return fn<3>; case 4: return fn<4>;                \
    case 5: return fn<5>; case 6: return fn<6>; case 7: return fn<7>; default: return fn<8>;               \
  }
#ifdef MINFER_X86
  if (isa == 3) { MINFER_PICK(rows_vnni) }
  if (isa == 2) { MINFER_PICK(rows_avx2) }
#endif
  MINFER_PICK(rows_scalar)
#undef MINFER_PICK
}

int best_isa() {
#ifdef MINFER_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return 3;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return 2;
#endif
  return 1;
}

}  // namespace

extern "C" int minfer_gguf_best_isa() { return best_isa(); }

// out float32 [T, N]; x float32 [T, K]; qs/d/m as in the header comment; K % 32 == 0 (checked in Python).
// isa: 0 = best available; a forced one this CPU lacks falls back to the best available. Returns the one used.
extern "C" int minfer_gguf_matmul(float* out, const float* x, const uint8_t* qs, const uint16_t* d,
                                  const uint16_t* m, int type, int64_t T, int64_t N, int64_t K, int isa,
                                  int num_threads) {
  const int best = best_isa();
  if (isa <= 0 || isa > best) isa = best;
  QuantizedRows xq;
  quantize_rows(x, T, K, xq);
  const Weights w{type, qs, d, m, type == kQ8_0 ? K : K / 2};
  RowsFn full = pick(isa, kRows), tail = pick(isa, (int)(T % kRows));
  const int64_t full_chunks = T / kRows;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < full_chunks; ++c) full(w, n, xq, c * kRows, K, out, N);
    if (T % kRows) tail(w, n, xq, full_chunks * kRows, K, out, N);
  }
  return isa;
}
