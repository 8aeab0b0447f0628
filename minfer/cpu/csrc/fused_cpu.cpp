// The element-wise ops of a Llama decoder layer as fused CPU loops (chapter 9, "where the time goes"):
// RMSNorm (with the residual add), SiLU(gate) * up, and RoPE applied in place. The torch versions
// (minfer/model/layers.py, minfer/model/positions.py) run each as 3-6 separate tensor ops, every one of them
// a pass over a [T, hidden] tensor in memory and a fresh allocation; a prefill step of 2,048 tokens spends
// about a tenth of its time there, and a batch-1 decode step pays ~10 aten calls per op. Here each op is one
// pass, row by row (a row of 576 floats stays in L1), rows spread over the OpenMP threads. The contracts are
// those of the Triton kernels of minfer/kernels/fused.py (the same Python signatures, minfer/cpu/fused_ops.py),
// so the model picks either one for one.
//
// Batch invariance, by construction. The serving engine is tested token for token against the one-sequence
// path, so a row's result must not depend on how many rows come with it, where the row sits in memory, or
// which thread computes it. Three things could make it depend on them, and each is ruled out here:
//   - a reduction whose order follows the vectorizer: with -ffast-math the compiler may peel a few elements
//     to reach an aligned address and sum them separately, so a row's sum changes with its address. Here the
//     sum of squares goes into LANES fixed partial sums (element i into lane i % LANES, whatever the address),
//     added up in one fixed tree; no -ffast-math, so the compiler may vectorize across lanes but not reorder
//     a single float add.
//   - fused multiply-adds taken in some places and not others (the vector body vs a scalar tail): built with
//     -ffp-contract=off, so every a * b + c is a rounded multiply and a rounded add, everywhere.
//   - exp from a library whose vector and scalar variants differ in the last bit (glibc's libmvec is picked
//     only for the vectorized part of a loop): exp here is our own polynomial (`exp_f32`), the same
//     arithmetic for every element, vectorized or not.
// tests/test_fused_cpu.py checks it: the same rows at T = 1, 7 and 64 and at odd float offsets, bit for bit.
//
// Layout contract (checked on the Python side):
//   x, residual, out, res_out: float32 rows of `cols` floats, `stride` floats apart (last dim contiguous)
//   weight float32 [cols]
//   rotary: q [T, H, D] / k [T, KVH, D] with element stride 1, any token and head strides (views into the
//   q|k|v projection); cos, sin float32 [T, D/2] contiguous.

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t LANES = 16;  // one AVX-512 register, two AVX2 ones

// sum(x[i]^2) in a fixed order: LANES partial sums (lane l gets elements l, l + LANES, ...), then a fixed
// pairwise tree. The same bits for the same row wherever it is stored.
inline float sum_squares(const float* x, int64_t n) {
  float acc[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
#pragma GCC unroll 16
    for (int64_t l = 0; l < LANES; ++l) acc[l] += x[i + l] * x[i + l];
  }
  for (int64_t l = 0; i + l < n; ++l) acc[l] += x[i + l] * x[i + l];
  for (int64_t w = LANES / 2; w >= 1; w /= 2)
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

inline float inv_rms(const float* x, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_squares(x, n) / (float)n + eps);
}

// exp(x) for float32: x = k ln2 + r with |r| <= ln2/2 (ln2 split in two parts so r is exact), e^r by a
// degree-7 Taylor polynomial in Horner form (truncation error r^8/8! < 5e-9 there, under a tenth of an ulp), times 2^k built in the
// exponent bits. Inputs are clamped to [-87, 88]: e^-87 ~ 1.6e-38 (the smallest normal float is 1.2e-38),
// e^88 ~ 1.7e38 (below float32's max, 3.4e38). Plain arithmetic, so the compiler vectorizes it, and every
// element, vectorized or not, goes through the same operations (see the top of the file).
inline float exp_f32(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  // round(x / ln2) to the nearest integer: adding and subtracting 1.5 * 2^23 drops the fraction bits
  const float kf = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (x - kf * 0.693359375f) - kf * -2.12194440e-4f;  // ln2 = 0.693359375 - 2.12194440e-4
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = ((int32_t)kf + 127) << 23;  // 2^k, k in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline void norm_row(float* o, const float* s, const float* w, int64_t n, float eps) {
  const float inv = inv_rms(s, n, eps);
  for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (s[i] * inv);
}

}  // namespace

extern "C" void minfer_rms_norm_f32(float* out, const float* x, const float* w, int64_t rows, int64_t cols,
                                    int64_t x_stride, int64_t out_stride, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)
  for (int64_t r = 0; r < rows; ++r) norm_row(out + r * out_stride, x + r * x_stride, w, cols, eps);
}

// res_out = x + residual; out = rms_norm(res_out) * w  (vLLM's fused_add_rms_norm, out of place).
extern "C" void minfer_fused_add_rms_norm_f32(float* out, float* res_out, const float* x, const float* residual,
                                              const float* w, int64_t rows, int64_t cols, int64_t x_stride,
                                              int64_t r_stride, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    const float* rr = residual + r * r_stride;
    float* s = res_out + r * cols;
    for (int64_t i = 0; i < cols; ++i) s[i] = xr[i] + rr[i];
    norm_row(out + r * cols, s, w, cols, eps);
  }
}

// out[t, i] = silu(x[t, i]) * x[t, inter + i], silu(g) = g / (1 + exp(-g)).
extern "C" void minfer_silu_and_mul_f32(float* out, const float* x, int64_t rows, int64_t inter, int64_t x_stride,
                                        int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = x + r * x_stride;
    const float* u = g + inter;
    float* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + exp_f32(-g[i])) * u[i];
  }
}

// RoPE in the rotate-half layout (HF Llama), in place: for each head, (x1, x2) = (x[:D/2], x[D/2:]) becomes
// (x1 c - x2 s, x2 c + x1 s) with c, s the token's cos/sin row.
static inline void rotate_rows(float* x, int64_t heads, int64_t head_stride, int64_t d, const float* c,
                               const float* s) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x1 = x + h * head_stride;
    float* x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * c[i] - b * s[i];
      x2[i] = b * c[i] + a * s[i];
    }
  }
}

extern "C" void minfer_rotary_f32(float* q, float* k, const float* cos, const float* sin, int64_t tokens,
                                  int64_t heads, int64_t kv_heads, int64_t d, int64_t q_stride, int64_t q_head_stride,
                                  int64_t k_stride, int64_t k_head_stride, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (tokens > 4)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * (d / 2);
    const float* s = sin + t * (d / 2);
    rotate_rows(q + t * q_stride, heads, q_head_stride, d, c, s);
    rotate_rows(k + t * k_stride, kv_heads, k_head_stride, d, c, s);
  }
}
