// y = x W^T for weights stored as int8 codes with one float32 scale per group of B consecutive inputs
// (chapter 5): GGUF's Q8_0 (B = 32; llama.cpp's ggml-common.h block_q8_0), Q5_0 (B = 32, codes q - 16) and
// Q6_K (B = 16, codes q - 32, scale d * sc) all are this once their bytes are decoded:
//
//   W[n, B g + j] = d[n, g] * qs[n, B g + j]      qs int8, d one scale per group of B weights
//
// The weight stays 1 byte per element (plus 4 bytes of scale per group: 1.125 bytes/weight at B = 32) and is
// turned into floats only in L1 (one row at a time). The activations stay float32 (no activation quantization, unlike llama.cpp's
// Q8_0 x Q8_0 dot), so the result is gguf's own dequantization times x, up to the order of the sums.
//
// Layout contract (checked on the Python side, minfer/cpu/int8_group.py):
//   out float32 [T, N]; x float32 [T, K]; qs int8 [N, K]; d float32 [N, K / B]; all contiguous, K % B == 0,
//   B = 16 or 32.
//
// Work split: OpenMP over output rows n; each weight row is read from memory once, turned into K floats
// (d * q, exact: an 8-bit integer times a float32 scale), and dotted with all T activation rows while it is
// in L1, so at batch 64 a weight byte crosses the memory bus once, not 64 times. Built with -march=native
// for the machine it runs on (AVX2 or AVX-512: the compiler vectorizes the int8 -> float convert and the
// 16-lane multiply-adds), without -ffast-math, so that the compiler keeps the order of the sums fixed.

#include <omp.h>

#include <cstdint>
#include <vector>

constexpr int64_t kLanes = 16;  // independent partial sums per dot product (K is a multiple of 16)

// sum_k w[k] x[k] with kLanes partial sums added in a fixed order: the same code for every row of every
// batch, so a row's result does not depend on how many rows share the call (batch invariance).
static inline float dot(const float* w, const float* x, int64_t K) {
  float acc[kLanes] = {0.f};
  for (int64_t k0 = 0; k0 < K; k0 += kLanes)
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += w[k0 + j] * x[k0 + j];
  float s = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

template <int64_t kBlock>
static void matmul(float* out, const float* x, const int8_t* qs, const float* d, int64_t T, int64_t N, int64_t K,
                   int num_threads) {
  const int64_t G = K / kBlock;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> w(K);  // one weight row in floats: K * 4 bytes, stays in L1/L2 for all T rows
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const int8_t* qn = qs + n * K;
      const float* dn = d + n * G;
      for (int64_t g = 0; g < G; ++g) {
        const float dg = dn[g];
#pragma omp simd
        for (int64_t j = 0; j < kBlock; ++j) w[g * kBlock + j] = dg * (float)qn[g * kBlock + j];
      }
      for (int64_t t = 0; t < T; ++t) out[t * N + n] = dot(w.data(), x + t * K, K);
    }
  }
}

extern "C" void minfer_int8_group_matmul(float* out, const float* x, const int8_t* qs, const float* d, int64_t T,
                                         int64_t N, int64_t K, int64_t group_size, int num_threads) {
  (group_size == 16 ? matmul<16> : matmul<32>)(out, x, qs, d, T, N, K, num_threads);
}
