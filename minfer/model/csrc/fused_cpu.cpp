// The element-wise ops of a Llama decoder layer as fused CPU loops (chapter 9, "where the time goes"):
// RMSNorm (with the residual add), SiLU(gate) * up, and RoPE applied in place. The torch versions
// (minfer/model/layers.py, minfer/model/positions.py) run each as 3-6 separate tensor ops, every one of them
// a pass over a [T, hidden] tensor in memory and a fresh allocation; a prefill step of 2,048 tokens spends
// about a tenth of its time there. Here each op is one pass, row by row (a row of 576 floats stays in L1),
// rows spread over the OpenMP threads. The contracts are those of the Triton kernels of minfer/kernels/fused.py
// (the same Python signatures, minfer/model/fused_cpu.py), so the model picks either one for one.
//
// Layout contract (checked on the Python side):
//   x, residual, out, res_out: float32 rows of `cols` floats, `stride` floats apart (last dim contiguous)
//   weight float32 [cols]
//   rotary: q [T, H, D] / k [T, KVH, D] with element stride 1, any token and head strides (views into the
//   q|k|v projection); cos, sin float32 [T, D/2] contiguous.
// Built with -O3 -march=native -ffast-math (vectorized exp through glibc's libmvec; nothing here is inf/NaN
// for finite inputs, and the results differ from torch's by a few float32 ulps, not more).

#include <omp.h>

#include <cmath>
#include <cstdint>

static inline float row_inv_rms(const float* x, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  return 1.f / std::sqrt(ss / (float)n + eps);
}

extern "C" void minfer_rms_norm_f32(float* out, const float* x, const float* w, int64_t rows, int64_t cols,
                                    int64_t x_stride, int64_t out_stride, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    float* o = out + r * out_stride;
    const float inv = row_inv_rms(xr, cols, eps);
#pragma omp simd
    for (int64_t i = 0; i < cols; ++i) o[i] = w[i] * (xr[i] * inv);
  }
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
    float* o = out + r * cols;
#pragma omp simd
    for (int64_t i = 0; i < cols; ++i) s[i] = xr[i] + rr[i];
    const float inv = row_inv_rms(s, cols, eps);
#pragma omp simd
    for (int64_t i = 0; i < cols; ++i) o[i] = w[i] * (s[i] * inv);
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
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
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
#pragma omp simd
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
