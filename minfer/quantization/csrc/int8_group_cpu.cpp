// y = x W^T for weights stored as int8 codes with one float32 scale per group of B consecutive inputs
// (chapter 5): GGUF's Q8_0 (B = 32; llama.cpp's ggml-common.h block_q8_0), Q5_0 (B = 32, codes q - 16) and
// Q6_K (B = 16, codes q - 32, scale d * sc) all are this once their bytes are decoded:
//
//   W[n, B g + j] = d[n, g] * qs[n, B g + j]      qs int8, d one scale per group of B weights
//
// The weight stays 1 byte per element (plus 4 bytes of scale per group: 1.125 bytes/weight at B = 32) and is
// turned into floats only in registers: per group, the B products q * x are summed in float32 and multiplied
// once by the group's scale. The activations stay float32 (no activation quantization, unlike llama.cpp's
// Q8_0 x Q8_0 dot), so the result is gguf's own dequantization times x, up to the order of the sums.
//
// Layout contract (checked on the Python side, minfer/quantization/gguf.py):
//   out float32 [T, N]; x float32 [T, K]; qs int8 [N, K]; d float32 [N, K / B]; all contiguous, K % B == 0,
//   B = 16 or 32.
//
// Work split: OpenMP over tiles of output rows n; within a tile, each weight row is read once for all T
// activation rows (it stays in L1: K bytes), so at batch 64 a weight byte crosses the memory bus once, not 64
// times. Built with -march=native for the machine it runs on (AVX2 or AVX-512: the compiler vectorizes the
// int8 -> float convert and the fused multiply-adds of the inner loop).

#include <omp.h>

#include <cstdint>

template <int64_t kBlock>
static inline float block_dot(const int8_t* q, const float* x) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < kBlock; ++j) s += (float)q[j] * x[j];
  return s;
}

template <int64_t kBlock>
static void matmul(float* out, const float* x, const int8_t* qs, const float* d, int64_t T, int64_t N, int64_t K,
                   int num_threads) {
  const int64_t G = K / kBlock;
  constexpr int64_t kTile = 16;  // output rows per work item
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t n0 = 0; n0 < N; n0 += kTile) {
    const int64_t n1 = n0 + kTile < N ? n0 + kTile : N;
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* qn = qs + n * K;
      const float* dn = d + n * G;
      for (int64_t t = 0; t < T; ++t) {
        const float* xt = x + t * K;
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) acc += dn[g] * block_dot<kBlock>(qn + g * kBlock, xt + g * kBlock);
        out[t * N + n] = acc;
      }
    }
  }
}

extern "C" void minfer_int8_group_matmul(float* out, const float* x, const int8_t* qs, const float* d, int64_t T,
                                         int64_t N, int64_t K, int64_t group_size, int num_threads) {
  (group_size == 16 ? matmul<16> : matmul<32>)(out, x, qs, d, T, N, K, num_threads);
}
