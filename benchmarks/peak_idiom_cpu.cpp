// The arithmetic peaks of this machine, measured: float32 FMA and the integer multiply-add idiom of
// minfer/cpu/csrc/qgemm_cpu.cpp, each with independent accumulators held in registers on every thread
// (benchmarks/peak_idiom.py builds, runs and reports it).
//
// FMA: acc = fma(acc, a, b) on 12 accumulators. An FMA has a latency of 4-5 cycles and up to 2 issue ports, so
// ~10 independent chains are needed to keep both ports busy; 12 fit the 16 ymm registers of AVX2 with a and b.
//
// Integer idiom (u8 x s8 products summed into int32 lanes), the forms the integer GEMMs use:
//   AVX2 / AVX-512BW: vpmaddubsw (u8 x s8 -> int16 pairs) + vpmaddwd by ones (-> int32) + vpaddd;
//   AVX-VNNI / AVX-512 VNNI: vpdpbusd (the three in one instruction).
// The maddubs idiom's accumulator chain is only the vpaddd (1 cycle): its speed is the two multiplies' ports,
// so 6 chains (AVX2, each with its own weight register: 6 + 6 + x + ones fit 16 registers) or 12 (AVX-512)
// suffice. The barrier on x each iteration stops the compiler from hoisting the loop-invariant products out
// of the loop; the distinct weight registers stop it from computing one product for all chains. vpdpbusd
// reads its accumulator (latency ~5), so 12 chains there.
//
// The integer GEMM's block (kind 2 + epilogue): the idiom alone is not what qgemm can reach, since every block of
// 32 also turns its integer sums into floats on the same vector ports. So this loop is qgemm's inner work on
// one block in L1, repeated: a tile of 6 rows x 32 columns (VNNI; 4 x 16 on AVX2) of sums started from a
// broadcast load, 8 dpbusd per (row, 16 columns) (on AVX2: maddubs + madd as the kernel does them for 4-bit
// codes, or with the sign moves for 8-bit ones), weights and broadcast activations loaded from memory, then the
// epilogue: 0 = per row (int8: cvt + fma), 1 = per block (Q4_0, Q8_0: cvt + mul + fma), 2 = per block with an
// offset (Q4_1, int4: one fma more). Its rate is the ceiling of qgemm with its arithmetic; the gap between it and
// the idiom's peak is the price of the per-block float scales.
//
// Operations are counted as a GEMM counts them: 2 per product (a multiply and an add), 2 per FMA lane.
// Each function runs `iters` iterations on each of `threads` OpenMP threads and returns the wall time of the
// parallel region in seconds (-1 when this CPU lacks the ISA); `checksum` receives the sum of the
// accumulators, so that no work can be dropped as dead.
//
// No -march=native: the per-ISA functions carry target attributes and are chosen at run time, as in qgemm.
#include <omp.h>
#include <cmath>
#include <cstdint>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PEAK_X86 1
#endif

// ISA codes (benchmarks/peak_idiom.py: FMA_ISAS, IDIOM_ISAS)
enum { FMA_SCALAR = 0, FMA_AVX2 = 1, FMA_AVX512 = 2 };
enum { IDIOM_SCALAR = 0, IDIOM_AVX2 = 1, IDIOM_AVX512BW = 2, IDIOM_AVX_VNNI = 3, IDIOM_AVX512_VNNI = 4 };

#define CHAINS 12
#define CHAINS_AVX2_IDIOM 6

// ------------------------------------------------------------------------------------------------ float32 FMA
static double fma_scalar(int64_t iters) {
  float acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = (float)i;
  const float a = 0.999999f, b = 1e-7f;
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = std::fma(acc[i], a, b);
  }
  double s = 0;
  for (int i = 0; i < CHAINS; ++i) s += acc[i];
  return s;
}

#ifdef PEAK_X86
__attribute__((target("avx2,fma"))) static double fma_avx2(int64_t iters) {
  __m256 acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_set1_ps((float)i);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  float out[8];
  double s = 0;
  for (int i = 0; i < CHAINS; ++i) {
    _mm256_storeu_ps(out, acc[i]);
    for (float v : out) s += v;
  }
  return s;
}

__attribute__((target("avx512f"))) static double fma_avx512(int64_t iters) {
  __m512 acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_set1_ps((float)i);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  double s = 0;
  for (int i = 0; i < CHAINS; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

// ------------------------------------------------------------------------------------------ integer idiom
__attribute__((target("avx2"))) static double idiom_avx2(int64_t iters) {
  __m256i acc[CHAINS_AVX2_IDIOM], w[CHAINS_AVX2_IDIOM];
  for (int i = 0; i < CHAINS_AVX2_IDIOM; ++i) {
    acc[i] = _mm256_setzero_si256();
    w[i] = _mm256_set1_epi8((char)(i + 1));
  }
  __m256i x = _mm256_set1_epi8(3);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = 0; n < iters; ++n) {
    asm volatile("" : "+x"(x));
#pragma GCC unroll 6
    for (int i = 0; i < CHAINS_AVX2_IDIOM; ++i)
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w[i]), ones));
  }
  int32_t out[8];
  double s = 0;
  for (int i = 0; i < CHAINS_AVX2_IDIOM; ++i) {
    _mm256_storeu_si256((__m256i*)out, acc[i]);
    for (int32_t v : out) s += v;
  }
  return s;
}

__attribute__((target("avx512f,avx512bw"))) static double idiom_avx512bw(int64_t iters) {
  __m512i acc[CHAINS], w[CHAINS];
  for (int i = 0; i < CHAINS; ++i) {
    acc[i] = _mm512_setzero_si512();
    w[i] = _mm512_set1_epi8((char)(i + 1));
  }
  __m512i x = _mm512_set1_epi8(3);
  const __m512i ones = _mm512_set1_epi16(1);
  for (int64_t n = 0; n < iters; ++n) {
    asm volatile("" : "+v"(x));
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i)
      acc[i] = _mm512_add_epi32(acc[i], _mm512_madd_epi16(_mm512_maddubs_epi16(x, w[i]), ones));
  }
  double s = 0;
  for (int i = 0; i < CHAINS; ++i) s += _mm512_reduce_add_epi32(acc[i]);
  return s;
}

__attribute__((target("avx2,avxvnni"))) static double idiom_avx_vnni(int64_t iters) {
  __m256i acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_set1_epi32(i);
  const __m256i x = _mm256_set1_epi8(3), w = _mm256_set1_epi8(5);
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], x, w);
  }
  int32_t out[8];
  double s = 0;
  for (int i = 0; i < CHAINS; ++i) {
    _mm256_storeu_si256((__m256i*)out, acc[i]);
    for (int32_t v : out) s += v;
  }
  return s;
}

__attribute__((target("avx512f,avx512vnni"))) static double idiom_avx512_vnni(int64_t iters) {
  __m512i acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i x = _mm512_set1_epi8(3), w = _mm512_set1_epi8(5);
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], x, w);
  }
  double s = 0;
  for (int i = 0; i < CHAINS; ++i) s += _mm512_reduce_add_epi32(acc[i]);
  return s;
}

// ------------------------------------------------------------------------------------ qgemm's block, in L1
// A compiler barrier on the base pointers each iteration keeps every load in the loop (nothing is hoisted).
struct BlockData {
  alignas(64) uint8_t w[2][512];  // 2 column tiles of one block: 8 vectors of 16 columns x 4 codes
  alignas(64) int8_t x[6][32];    // 6 rows' activation codes
  alignas(64) float d[2][16], m[2][16];
  float dx[6], ds[6];
  int32_t init[6];                // -c sx
  void fill(int bits) {
    for (int c = 0; c < 2; ++c)
      for (int i = 0; i < 512; ++i) w[c][i] = (uint8_t)(bits == 4 ? (i * 7 + c) % 16 : (i * 37 + c) % 256);
    for (int r = 0; r < 6; ++r) {
      for (int k = 0; k < 32; ++k) x[r][k] = (int8_t)((r * 31 + k * 13) % 255 - 127);
      dx[r] = 1e-3f * (r + 1);
      ds[r] = 1e-2f * (r + 1);
      init[r] = -8 * r;
    }
    for (int c = 0; c < 2; ++c)
      for (int j = 0; j < 16; ++j) d[c][j] = m[c][j] = 1e-4f * (j + 1);
  }
};

template <int E>
__attribute__((target("avx512f,avx512vnni"))) static double block_vnni(int64_t iters) {
  BlockData b;
  b.fill(8);
  const BlockData* p = &b;
  __m512 acc[6][2];
  for (int r = 0; r < 6; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t n = 0; n < iters; ++n) {
    asm volatile("" : "+r"(p));
    __m512i dot[6][2];
    for (int r = 0; r < 6; ++r) dot[r][0] = dot[r][1] = _mm512_set1_epi32(p->init[r]);
    for (int v = 0; v < 8; ++v) {
      const __m512i w0 = _mm512_load_si512(p->w[0] + 64 * v), w1 = _mm512_load_si512(p->w[1] + 64 * v);
      for (int r = 0; r < 6; ++r) {
        int32_t a;
        __builtin_memcpy(&a, p->x[r] + 4 * v, 4);
        const __m512i xa = _mm512_set1_epi32(a);
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, xa);
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, xa);
      }
    }
    for (int r = 0; r < 6; ++r)
      for (int c = 0; c < 2; ++c) {
        const __m512 f = _mm512_cvtepi32_ps(dot[r][c]), dx = _mm512_set1_ps(p->dx[r]);
        if (E == 0) {
          acc[r][c] = _mm512_fmadd_ps(f, dx, acc[r][c]);
        } else {
          acc[r][c] = _mm512_fmadd_ps(f, _mm512_mul_ps(_mm512_load_ps(p->d[c]), dx), acc[r][c]);
          if (E == 2) acc[r][c] = _mm512_fmadd_ps(_mm512_load_ps(p->m[c]), _mm512_set1_ps(p->ds[r]), acc[r][c]);
        }
      }
  }
  double s = 0;
  for (int r = 0; r < 6; ++r) s += _mm512_reduce_add_ps(acc[r][0]) + _mm512_reduce_add_ps(acc[r][1]);
  return s;
}

// AVX2: 4 rows x 16 columns as two halves of 8; epilogue 0 runs the 8-bit codes' loop (int8), 1 and 2 the
// 4-bit one (Q4_0, Q4_1)
template <int E>
__attribute__((target("avx2,fma"))) static double block_avx2(int64_t iters) {
  BlockData b;
  b.fill(E == 0 ? 8 : 4);
  const BlockData* p = &b;
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
  __m256 acc[4][2];
  for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t n = 0; n < iters; ++n) {
    asm volatile("" : "+r"(p));
    for (int h = 0; h < 2; ++h) {
      __m256i dot[4];
      for (int r = 0; r < 4; ++r) dot[r] = E == 0 ? _mm256_setzero_si256() : _mm256_set1_epi32(p->init[r]);
      for (int i = 0; i < (E == 0 ? 8 : 4); ++i) {
        int32_t a, c;
        if (E == 0) {
          const __m256i q = _mm256_xor_si256(_mm256_load_si256((const __m256i*)(p->w[0] + 64 * i + 32 * h)), flip);
          const __m256i aq = _mm256_sign_epi8(q, q);
          for (int r = 0; r < 4; ++r) {
            __builtin_memcpy(&a, p->x[r] + 4 * i, 4);
            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(a), q);
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, xs), ones));
          }
        } else {
          const __m256i lo = _mm256_load_si256((const __m256i*)(p->w[0] + 128 * i + 32 * h));
          const __m256i hi = _mm256_load_si256((const __m256i*)(p->w[0] + 128 * i + 64 + 32 * h));
          for (int r = 0; r < 4; ++r) {
            __builtin_memcpy(&a, p->x[r] + 8 * i, 4);
            __builtin_memcpy(&c, p->x[r] + 8 * i + 4, 4);
            const __m256i pa = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a));
            const __m256i pb = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(c));
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_add_epi16(pa, pb), ones));
          }
        }
      }
      for (int r = 0; r < 4; ++r) {
        const __m256 f = _mm256_cvtepi32_ps(dot[r]), dx = _mm256_set1_ps(p->dx[r]);
        if (E == 0) {
          acc[r][h] = _mm256_fmadd_ps(f, dx, acc[r][h]);
        } else {
          acc[r][h] = _mm256_fmadd_ps(f, _mm256_mul_ps(_mm256_load_ps(p->d[0] + 8 * h), dx), acc[r][h]);
          if (E == 2) acc[r][h] = _mm256_fmadd_ps(_mm256_load_ps(p->m[0] + 8 * h), _mm256_set1_ps(p->ds[r]), acc[r][h]);
        }
      }
    }
  }
  float out[8];
  double s = 0;
  for (int r = 0; r < 4; ++r)
    for (int h = 0; h < 2; ++h) {
      _mm256_storeu_ps(out, acc[r][h]);
      for (float v : out) s += v;
    }
  return s;
}
#endif

static double idiom_scalar(int64_t iters) {
  int32_t acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = i;
  volatile uint8_t xv = 3;  // read once per iteration: the product cannot be hoisted out of the loop
  const int8_t w = 5;
  for (int64_t n = 0; n < iters; ++n) {
    const int32_t p = (int32_t)xv * w;
    for (int i = 0; i < CHAINS; ++i) acc[i] += p + i;
  }
  double s = 0;
  for (int i = 0; i < CHAINS; ++i) s += acc[i];
  return s;
}

static bool fma_supported(int isa) {
#ifdef PEAK_X86
  __builtin_cpu_init();
  if (isa == FMA_AVX512) return __builtin_cpu_supports("avx512f");
  if (isa == FMA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == FMA_SCALAR;
}

static bool idiom_supported(int isa) {
#ifdef PEAK_X86
  __builtin_cpu_init();
  if (isa == IDIOM_AVX512_VNNI) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni");
  if (isa == IDIOM_AVX_VNNI) return __builtin_cpu_supports("avxvnni");
  if (isa == IDIOM_AVX512BW) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (isa == IDIOM_AVX2) return __builtin_cpu_supports("avx2");
#endif
  return isa == IDIOM_SCALAR;
}

// qgemm's block (kind 2 + epilogue) exists for AVX2 and AVX-512 VNNI, its two SIMD paths
static bool block_supported(int isa) {
  return (isa == IDIOM_AVX2 || isa == IDIOM_AVX512_VNNI) && idiom_supported(isa);
}

static double run_one(int kind, int isa, int64_t iters) {
#ifdef PEAK_X86
  if (kind >= 2) {
    const int e = kind - 2;
    if (isa == IDIOM_AVX512_VNNI) return e == 0 ? block_vnni<0>(iters) : e == 1 ? block_vnni<1>(iters) : block_vnni<2>(iters);
    return e == 0 ? block_avx2<0>(iters) : e == 1 ? block_avx2<1>(iters) : block_avx2<2>(iters);
  }
#endif
  if (kind == 0) {
#ifdef PEAK_X86
    if (isa == FMA_AVX512) return fma_avx512(iters);
    if (isa == FMA_AVX2) return fma_avx2(iters);
#endif
    return fma_scalar(iters);
  }
#ifdef PEAK_X86
  if (isa == IDIOM_AVX512_VNNI) return idiom_avx512_vnni(iters);
  if (isa == IDIOM_AVX_VNNI) return idiom_avx_vnni(iters);
  if (isa == IDIOM_AVX512BW) return idiom_avx512bw(iters);
  if (isa == IDIOM_AVX2) return idiom_avx2(iters);
#endif
  return idiom_scalar(iters);
}

extern "C" {

// The widest FMA / idiom ISA this CPU runs.
int peak_best_fma_isa() {
  for (int isa = FMA_AVX512; isa > FMA_SCALAR; --isa)
    if (fma_supported(isa)) return isa;
  return FMA_SCALAR;
}

int peak_best_idiom_isa() {
  for (int isa = IDIOM_AVX512_VNNI; isa > IDIOM_SCALAR; --isa)
    if (idiom_supported(isa)) return isa;
  return IDIOM_SCALAR;
}

// Operations (2 per FMA lane, 2 per u8 x s8 product) one iteration of one thread performs.
int64_t peak_ops_per_iter(int kind, int isa) {
  if (kind >= 2) return isa == IDIOM_AVX512_VNNI ? 6 * 32 * 32 * 2 : 4 * 16 * 32 * 2;  // rows x columns x K x 2
  if (kind == 0) return (int64_t)CHAINS * 2 * (isa == FMA_AVX512 ? 16 : isa == FMA_AVX2 ? 8 : 1);
  switch (isa) {
    case IDIOM_AVX512_VNNI: case IDIOM_AVX512BW: return (int64_t)CHAINS * 2 * 64;
    case IDIOM_AVX_VNNI: return (int64_t)CHAINS * 2 * 32;
    case IDIOM_AVX2: return (int64_t)CHAINS_AVX2_IDIOM * 2 * 32;
    default: return (int64_t)CHAINS * 2;
  }
}

// kind 0: FMA, 1: integer idiom, 2..4: qgemm's block with epilogue 0..2. Seconds of the parallel region, or -1 when this CPU lacks `isa`.
double peak_run(int kind, int isa, int64_t iters, int threads, double* checksum) {
  if (!(kind == 0 ? fma_supported(isa) : kind == 1 ? idiom_supported(isa) : block_supported(isa))) return -1.0;
  double sum = 0;
  const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sum)
  sum += run_one(kind, isa, iters);
  const double dt = omp_get_wtime() - t0;
  *checksum = sum;
  return dt;
}

}  // extern "C"
