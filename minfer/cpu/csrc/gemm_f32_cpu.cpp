// y = x W^T for a FEW rows of x (a decode step: one row per running sequence), float32, on the CPU
// (chapter 9 §9.2.6). Weights are read once per call; each weight value loaded feeds up to MR rows' FMAs.
// Many rows (a wide decode step, a prefill chunk) take the AVX-512 tiles of gemm_many_rows (lab notes 9b §9b.17).
//
// Why not oneDNN (what torch runs): at 16 rows a projection is close to the balance point of this machine
// (16 FMAs per weight float: 2 cores x 16 lanes x ~3 GHz want ~24 GB/s of weights, about the DRAM's rate), and
// oneDNN's float32 kernel, built for many rows, ran at ~11.6 GB/s and 93 GFLOP/s there (chapter 9 §9.2.6).
// This kernel streams each weight panel once from DRAM, straight into FMAs against rows kept in L1.
//
// Layout (minfer/cpu/gemm_f32.py: pack_weight):
//   packed: float32 [ceil(N / 16), K, 16]: panel p holds output features 16p .. 16p+15 (zero padded), one
//           16-float line per k, so a panel is one contiguous stream of K cache lines
//   x: float32 [M, K], row stride x_stride (floats); out: float32 [M, N], row stride out_stride
//   bias: float32 [N] or null
//
// Arithmetic: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), accumulated in float32 in increasing k, one
// fused multiply-add per term. A row's result does not depend on the other rows, on M or on the thread
// split (each output is one accumulator's chain over k), so the kernel is batch-invariant.
//
// Threads: the panels are split into `num_threads` contiguous ranges (OpenMP), so each core streams its own
// part of the weights.

#include <cstdint>
#include <cstring>
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MINFER_GEMM_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINFER_GEMM_ISA "avx2"
#else
#define MINFER_GEMM_ISA "scalar"
#endif

namespace {
// Software prefetch distance, in panel lines (64 bytes each): 2 KB ahead of the FMAs. Without it the FMAs and
// the DRAM stream took turns (a 16-row step's linears 38-39 ms against 31 with it, 8 and 128 lines no better).
constexpr int64_t kPrefetchLines = 32;

constexpr int kLanes = 16;  // output features per panel (one 512-bit vector of floats)
constexpr int kMaxRows = 16;  // rows per pass over a panel (the accumulators: one vector each)

// xt: the pass's rows transposed, [K][MR] (one line of MR floats per k), so the k loop reads it in order.
template <int MR>
void panel_rows(float* out, int64_t out_stride, const float* xt, const float* panel, const float* bias,
                int64_t K, int64_t cols) {
#if defined(__AVX512F__)
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch((const char*)(panel + (k + kPrefetchLines) * kLanes), _MM_HINT_T0);
    const __m512 w = _mm512_loadu_ps(panel + k * kLanes);  // loadu: same speed aligned, safe if not
    const float* xk = xt + k * MR;
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xk[m]), w, acc[m]);
  }
  const __mmask16 mask = cols >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(out + m * out_stride, mask, _mm512_add_ps(acc[m], b));
#elif defined(__AVX2__) && defined(__FMA__)
  // Two 8-lane halves per panel line: 2 MR accumulators (MR <= 6 keeps them in the 16 ymm registers with the
  // two weight halves; larger MR spills, which the caller avoids by passing at most kRowsAvx2 rows).
  __m256 lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch((const char*)(panel + (k + kPrefetchLines) * kLanes), _MM_HINT_T0);
    const __m256 wl = _mm256_loadu_ps(panel + k * kLanes), wh = _mm256_loadu_ps(panel + k * kLanes + 8);
    const float* xk = xt + k * MR;
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_broadcast_ss(xk + m);
      lo[m] = _mm256_fmadd_ps(xv, wl, lo[m]);
      hi[m] = _mm256_fmadd_ps(xv, wh, hi[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(32) float tmp[kLanes];
    _mm256_store_ps(tmp, lo[m]);
    _mm256_store_ps(tmp + 8, hi[m]);
    for (int64_t c = 0; c < cols; ++c) out[m * out_stride + c] = tmp[c] + (bias ? bias[c] : 0.0f);
  }
#else
  float acc[MR][kLanes] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < kLanes; ++c) acc[m][c] = __builtin_fmaf(xt[k * MR + m], panel[k * kLanes + c], acc[m][c]);
  for (int m = 0; m < MR; ++m)
    for (int64_t c = 0; c < cols; ++c) out[m * out_stride + c] = acc[m][c] + (bias ? bias[c] : 0.0f);
#endif
}

#if defined(__AVX512F__)
constexpr int kRowsPerPass = kMaxRows;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRowsPerPass = 6;
#else
constexpr int kRowsPerPass = 8;
#endif

using PanelFn = void (*)(float*, int64_t, const float*, const float*, const float*, int64_t, int64_t);

template <int... I>
struct Table {
  static constexpr PanelFn fns[sizeof...(I)] = {&panel_rows<I + 1>...};
};
template <int... I>
constexpr PanelFn Table<I...>::fns[sizeof...(I)];

// The kernel for a pass of `rows` rows, 1 .. kRowsPerPass (one instance per row count: the accumulators are
// registers, so their number must be known when compiling).
PanelFn panel_fn(int rows) { return Table<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>::fns[rows - 1]; }

#if defined(__AVX512F__)
// Many rows (more than kMaxRows): a tile of kTileRows rows x kTilePanels panels (48 output features) whose 24
// accumulators stay in registers; per k, 3 weight lines and 8 row values (broadcast straight from the rows of x,
// 8 streams through L1, so nothing is transposed) feed 24 FMAs, where the few-row pass above needs 17 loads for
// 16. The tile's 3 panels (3 x K lines of 64 B: 110 KB at K = 576) stay in L2 while every row tile of the call
// passes over them.
// Each output is still one FMA chain over k in increasing order, so a row gets the same bits here as in the
// few-row pass (batch-invariant across M).
constexpr int kTileRows = 8;
constexpr int kTilePanels = 3;

// Rows r0 .. r0 + rows - 1 of x (rows <= 8; a short tile repeats its last row in the spare accumulators, which
// are not stored); panel: the first of NP (1..3) consecutive panels.
template <int NP>
void tile_rows(float* out, int64_t out_stride, const float* x, int64_t x_stride, const float* panel,
               const float* bias, int64_t K, int64_t rows, int64_t cols) {
  const float* xr[kTileRows];
  for (int m = 0; m < kTileRows; ++m) xr[m] = x + (m < rows ? m : rows - 1) * x_stride;
  __m512 acc[kTileRows][NP];
  for (int m = 0; m < kTileRows; ++m)
    for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NP];
    for (int j = 0; j < NP; ++j) w[j] = _mm512_loadu_ps(panel + (j * K + k) * kLanes);
    for (int m = 0; m < kTileRows; ++m) {
      const __m512 xv = _mm512_set1_ps(xr[m][k]);
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_fmadd_ps(xv, w[j], acc[m][j]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t c = cols - j * kLanes;
    const __mmask16 mask = c >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << c) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kLanes) : _mm512_setzero_ps();
    for (int m = 0; m < rows; ++m)
      _mm512_mask_storeu_ps(out + m * out_stride + j * kLanes, mask, _mm512_add_ps(acc[m][j], b));
  }
}

void gemm_many_rows(float* out, const float* x, const float* packed, const float* bias, int64_t M, int64_t N,
                    int64_t K, int64_t x_stride, int64_t out_stride, int num_threads) {
  const int64_t panels = (N + kLanes - 1) / kLanes, groups = (panels + kTilePanels - 1) / kTilePanels;
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
#pragma omp parallel num_threads(num_threads)
  {
    const int nt = omp_get_num_threads(), th = omp_get_thread_num();
    const int64_t g0 = groups * th / nt, g1 = groups * (th + 1) / nt;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * kTilePanels, np = panels - p < kTilePanels ? panels - p : kTilePanels;
      const int64_t n0 = p * kLanes, cols = N - n0;
      const float* panel = packed + p * K * kLanes;
      const float* b = bias ? bias + n0 : nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = t * kTileRows, rows = M - r0 < kTileRows ? M - r0 : kTileRows;
        float* o = out + r0 * out_stride + n0;
        const float* xs = x + r0 * x_stride;  // the tile's first row
        if (np == 3) tile_rows<3>(o, out_stride, xs, x_stride, panel, b, K, rows, cols);
        else if (np == 2) tile_rows<2>(o, out_stride, xs, x_stride, panel, b, K, rows, cols);
        else tile_rows<1>(o, out_stride, xs, x_stride, panel, b, K, rows, cols);
      }
    }
  }
}
#endif

}  // namespace

extern "C" {

const char* minfer_gemm_f32_isa() { return MINFER_GEMM_ISA; }

// Scratch for the transposed rows: K * M floats (the caller's buffer, so that a call allocates nothing); unused,
// and may be null, where an AVX-512 build takes more than kMaxRows rows in its tiles.
void minfer_gemm_f32(float* out, const float* x, const float* packed, const float* bias, int64_t M, int64_t N,
                     int64_t K, int64_t x_stride, int64_t out_stride, float* xt_scratch, int num_threads) {
#if defined(__AVX512F__)
  if (M > kMaxRows) {  // reads x in place (xt_scratch unused)
    gemm_many_rows(out, x, packed, bias, M, N, K, x_stride, out_stride, num_threads);
    return;
  }
#endif
  const int64_t panels = (N + kLanes - 1) / kLanes;
  // Transpose each pass's rows into [K][rows]: pass g occupies xt_scratch[g * kRowsPerPass * K ...].
  for (int64_t r0 = 0; r0 < M; r0 += kRowsPerPass) {
    const int64_t rows = M - r0 < kRowsPerPass ? M - r0 : kRowsPerPass;
    float* xt = xt_scratch + r0 * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t m = 0; m < rows; ++m) xt[k * rows + m] = x[(r0 + m) * x_stride + k];
  }
#pragma omp parallel num_threads(num_threads)
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = packed + p * K * kLanes;
      const int64_t n0 = p * kLanes, cols = N - n0 < kLanes ? N - n0 : kLanes;
      for (int64_t r0 = 0; r0 < M; r0 += kRowsPerPass) {
        const int64_t rows = M - r0 < kRowsPerPass ? M - r0 : kRowsPerPass;
        panel_fn((int)rows)(out + r0 * out_stride + n0, out_stride, xt_scratch + r0 * K, panel,
                            bias ? bias + n0 : nullptr, K, cols);
      }
    }
  }
}

}  // extern "C"
