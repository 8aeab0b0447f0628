// y[T, N] = x[T, K] W^T for integer weights (4- or 8-bit codes with per-(column, group) scales), x float32:
// one register-tiled integer GEMM for GGUF's Q4_0 / Q4_1 / Q8_0 blocks and minfer's `int4` and `int8`
// (chapter 5 §5.3; the ideas of ggml's quantized dot products and of oneDNN-style register tiling, written
// here from scratch).
//
//   1. each activation row is quantized ONCE per call to int8 in blocks of 32: one float scale dx per block,
//      q = round(x / dx) (half to even), dx = max|x| / 127, and the block's integer sum sx = sum q;
//   2. a tile of R activation rows x 16 (or 32) output columns keeps its int32 sums in registers; for each
//      4 bytes of K, the 4 activation bytes of a row are broadcast to every lane (_mm512_set1_epi32 from
//      memory: a vpbroadcastd that runs on a load port, not a vector port) and one
//        AVX-512 VNNI: _mm512_dpbusd_epi32 (u8 x s8, 4 products summed into each of 16 int32 lanes: 64 MACs)
//        AVX2:         _mm256_maddubs_epi16 (u8 x s8 -> pairs in int16) + _mm256_madd_epi16 (-> int32)
//      multiplies them by the 16 columns' 4 weight bytes, so a weight byte loaded once serves R rows and an
//      activation byte broadcast once serves 16-32 columns (a GEMV repeated per row would reload both);
//      R = 6 on VNNI (6 x 2 sums + 6 x 2 float accumulators + weights fit its 32 zmm registers), 4 on AVX2;
//   3. per block of 32, the exact integer sum becomes floats once per output element:
//        dot' = dot - c sx                     (integer; c = 8 for Q4_0 / int4, 128 for 8-bit codes, else 0)
//        acc  = fma(float(dot'), d dx, acc)    (d: the column's scale for this block's group)
//        acc  = fma(m, dx sx, acc)             (only where there is an offset m: Q4_1's m, int4's zero z)
//      so  Q4_1: w = q d + m,  Q4_0 / int4: w = (q - 8) d + m (m = 0 for Q4_0),  Q8_0 / int8: w = q d.
//      Subtracting c sx costs no vector instruction: each sum starts at -c sx (a broadcast load) instead of at 0. Where
//      one scale covers the whole row (int8), d leaves the loop: acc = fma(float(dot'), dx, acc) per block and
//      y = acc d once at the end. On VNNI and on this CPU, cvt, mul and fma issue on the same two ports as
//      dpbusd, so per (row, 16 columns, block) the 8 dpbusd share them with 2 (int8), 3 (Q4_0, Q8_0) or 4
//      (Q4_1, int4) epilogue instructions: the kernel's ceiling is 8/10, 8/11 or 8/12 of dpbusd's peak
//      (benchmarks/peak_idiom.py measures both).
//
// Weight layout (`minfer/cpu/qgemm.py: pack_codes`), the same bytes as the codes: columns in tiles
// of 16 (N padded with zero columns), each tile's K in blocks of 32, each block as the loads want it:
//   4-bit: uint8 [N/16, K/32, 4, 16, 4]: byte [p, g, i, j, b] = code(16p+j, 32g+8i+b) | code(.., 32g+8i+4+b) << 4
//          one 64-byte load i holds 16 columns x 8 K; `& 15` gives K 8i..8i+3, `>> 4 & 15` K 8i+4..8i+7
//   8-bit: uint8 [N/16, K/32, 8, 16, 4]: byte [p, g, i, j, b] = code(16p+j, 32g+4i+b) + 128 (u8 for dpbusd;
//          the + 128 comes back off as the integer 128 sx; AVX2 turns it back into a signed code and moves
//          its sign onto x, since u8 255 x s8 127 pairs would saturate maddubs' int16)
//   scales d and offsets m: 16-bit (float16 for GGUF, bfloat16 for int4 / int8) [N/16, K/32/gs, 16], gs =
//          blocks of 32 per scale group (1 for GGUF, group_size / 32 for int4, K / 32 for int8).
// So a token reads 0.5625 (Q4_0), 0.625 (Q4_1, int4 g32), 1.0625 (Q8_0) bytes per weight: the file's bytes.
//
// Batch-invariant by construction: the integer sums are exact; the float work per output element is the same
// instructions per block in increasing block order whatever T is, whichever row tile (R = 1..6) or column tile
// a row or column falls in, whether the codes came from a panel or the packed stream, and however the tiles
// are split over threads. The AVX2, VNNI and scalar (std::fma) paths even do the same float operations, so
// all three give the same bits.
//
// The activation quantization runs in AVX2 on both SIMD paths (the same bits as the scalar loop), threaded
// when T x K is large (at T = 2048 it is ~3 M values per call, which a scalar loop would make a third of the
// call's time).
//
// Panels: from kPanelRows rows on, a thread first unpacks the column tiles of its work item (4-bit codes to
// one byte each, 16-bit scales to floats, ~18 KB at K = 576) and runs every row tile over that panel, so the
// inner loop only loads, broadcasts and multiplies; below (decode: bound by memory bandwidth, a panel would
// only add a pass) the loop reads the packed 4-bit stream and splits the nibbles itself.
//
// Work split: OpenMP over (groups of 8 chunks of 72 rows) x (pairs of column tiles on VNNI, single tiles on
// AVX2) x (the group's chunks), so that a thread's consecutive items reuse its panel while the group's
// activations (576 x K bytes) stay in L2; inside, row tiles of R. At T = 1 this is one pass over the weight,
// split across threads by columns.
//
// Instruction set chosen at run time (isa 0 = best this CPU has; 1 scalar, 2 AVX2, 3 AVX-512 VNNI forces one,
// which the tests use): the AVX2 and VNNI functions carry target attributes, so one build runs on both.

#include <omp.h>

#include <cfloat>
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
constexpr int kMaxMR = 6;        // activation rows per register tile: 6 on VNNI (32 zmm), 4 on AVX2 (16 ymm)
constexpr int64_t kChunk = 72;   // activation rows per work item (a multiple of both)
constexpr int64_t kSuper = 8;    // chunks whose activations (576 x K bytes) stay in L2 while the columns pass
constexpr int64_t kPanelRows = 32;  // from this many rows on, the column tiles are unpacked once per call

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The activations, quantized: q int8 [T, K], d float [T, K/32], ds = d * float(s) and ncs = -c s int32 [T, K/32]
// (s: the block's integer sum; -c s is where each block's integer sum with the weight codes starts).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> ncs;
};

// A block the 8-bit grid cannot hold, the same rule on every path (so the paths keep giving the same bits):
// a NaN or an inf anywhere in it makes the block's scale NaN (every output of the row becomes NaN, as the
// float product's would be NaN or inf: garbage must not come out finite), and a block whose scale would be
// below the smallest normal float (max|x| < 127 * FLT_MIN, or all zeros) is the zero block.
inline bool special_block(bool nonfinite, float amax, int8_t* q, float* d_out, int32_t* s_out, float* ds_out) {
  const bool tiny = !(amax / 127.f >= FLT_MIN);
  if (!nonfinite && !tiny) return false;
  std::memset(q, 0, kBlock);
  *d_out = nonfinite ? NAN : 0.f;
  *s_out = 0;
  *ds_out = nonfinite ? NAN : 0.f;
  return true;
}

inline bool is_nonfinite(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return (b & 0x7f800000u) == 0x7f800000u;
}

void quantize_block(const float* xb, int8_t* q, float* d_out, int32_t* s_out, float* ds_out) {
  float amax = 0.f;
  bool nonfinite = false;
  for (int j = 0; j < kBlock; ++j) {
    nonfinite |= is_nonfinite(xb[j]);
    amax = std::fmax(amax, std::fabs(xb[j]));
  }
  if (special_block(nonfinite, amax, q, d_out, s_out, ds_out)) return;
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    const int v = (int)std::nearbyint(xb[j] * id);  // |v| <= 127 (round half to even)
    q[j] = (int8_t)v;
    sum += v;
  }
  *d_out = d;
  *s_out = sum;
  *ds_out = d * (float)sum;
}

#ifdef MINFER_X86
// The same block quantization in AVX2, the same bits: max of |x| (exact), d and 1 / d as scalars, x * (1 / d)
// rounded half to even (cvtps_epi32 under the default rounding mode = nearbyint), integer sum.
__attribute__((target("avx2,fma,f16c"))) void quantize_block_avx2(const float* xb, int8_t* q, float* d_out,
                                                                  int32_t* s_out, float* ds_out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const float amax = _mm_cvtss_f32(h);
  const __m256i expm = _mm256_set1_epi32(0x7f800000);
  __m256i bad = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i)
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v[i]), expm), expm));
  if (special_block(!_mm256_testz_si256(bad, bad), amax, q, d_out, s_out, ds_out)) return;
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
  const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  const int32_t sum = _mm_cvtsi128_si32(s4);
  // int32 -> int8 keeping the order: the packs work per 128-bit lane, the permute puts the dwords back
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d_out = d;
  *s_out = sum;
  *ds_out = d * (float)sum;
}
#endif

// offset: c of the weight codes (0, 8 or 128), for ncs
void quantize_rows(const float* x, int64_t T, int64_t K, int offset, QuantizedRows& out, int num_threads,
                   bool simd) {
  const int64_t G = K / kBlock;
  out.q.resize(T * K);
  out.d.resize(T * G);
  out.ds.resize(T * G);
  out.ncs.resize(T * G);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T * K >= 65536)
  for (int64_t i = 0; i < T * G; ++i) {
    int32_t* s = &out.ncs[i];  // the block's sum s, then -c s in place
#ifdef MINFER_X86
    if (simd)
      quantize_block_avx2(x + i * kBlock, out.q.data() + i * kBlock, &out.d[i], s, &out.ds[i]);
    else
#endif
      quantize_block(x + i * kBlock, out.q.data() + i * kBlock, &out.d[i], s, &out.ds[i]);
    *s *= -offset;
  }
}

struct Packed {
  const uint8_t* qs;   // [P, G, 64 * (bits == 4 ? 4 : 8)]
  const uint16_t* d;   // [P, Gs, 16]
  const uint16_t* m;   // [P, Gs, 16] or null
  int bits;            // 4 or 8
  int offset;          // c above: subtracted from each code (as c sx); 128 for 8-bit codes
  int bf16;            // scales are bfloat16 (else float16)
  int64_t gs;          // blocks of 32 per scale group
  int64_t G, Gs;       // K / 32, G / gs
  int64_t block_bytes; // 256 (4-bit) or 512 (8-bit)
};

// How a block's integer sums become floats (step 3 above), one rule chosen per call, the same on every path:
enum Epilogue {
  kPerBlock = 0,   // acc = fma(float(dot'), d dx, acc)
  kPerBlockM = 1,  //   + acc = fma(m, dx sx, acc)
  kPerRow = 2,     // 8-bit codes with one scale per row (int8): acc = fma(float(dot'), dx, acc), y = acc d at the end
};

inline int epilogue_of(const Packed& w) {
  if (w.m) return kPerBlockM;
  return w.bits == 8 && w.gs == w.G ? kPerRow : kPerBlock;
}

inline float scale_at(const Packed& w, const uint16_t* plane, int64_t p, int64_t g, int j) {
  const uint16_t h = plane[(p * w.Gs + g / w.gs) * 16 + j];
  return w.bf16 ? bf16_to_float(h) : half_to_float(h);
}

// ---- scalar: the same float operations as the SIMD paths (std::fma), one output element at a time ----
void tile_scalar(const Packed& w, int64_t p, const QuantizedRows& x, int64_t t0, int R, int64_t K, float* out,
                 int64_t N) {
  const int64_t G = w.G;
  const int epi = epilogue_of(w);
  for (int j = 0; j < 16; ++j) {
    const int64_t n = p * 16 + j;
    if (n >= N) break;
    for (int r = 0; r < R; ++r) {
      const int64_t row = t0 + r;
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* blk = w.qs + (p * G + g) * w.block_bytes;
        const int8_t* xq = x.q.data() + row * K + g * kBlock;
        int32_t dot = x.ncs[row * G + g];
        if (w.bits == 4) {
          for (int i = 0; i < 4; ++i)
            for (int b = 0; b < 4; ++b) {
              const uint8_t v = blk[i * 64 + j * 4 + b];
              dot += (int32_t)(v & 15) * xq[8 * i + b] + (int32_t)(v >> 4) * xq[8 * i + 4 + b];
            }
        } else {
          for (int i = 0; i < 8; ++i)
            for (int b = 0; b < 4; ++b) dot += (int32_t)blk[i * 64 + j * 4 + b] * xq[4 * i + b];
        }
        const float dx = x.d[row * G + g];
        if (epi == kPerRow) {
          acc = std::fma((float)dot, dx, acc);
          continue;
        }
        acc = std::fma((float)dot, scale_at(w, w.d, p, g, j) * dx, acc);
        if (epi == kPerBlockM) acc = std::fma(scale_at(w, w.m, p, g, j), x.ds[row * G + g], acc);
      }
      out[row * N + n] = epi == kPerRow ? acc * scale_at(w, w.d, p, 0, j) : acc;
    }
  }
}

// The column tiles a tile function reads: straight from the packed weight (4-bit codes two to a byte, 16-bit
// scales per group), or from a panel unpacked for this call (one code per byte in the 8-bit layout, float
// scales per block; `fill_panel`).
struct Cols {
  const uint8_t* qs;   // the first tile's codes
  int64_t qs_tile;     // bytes from one column tile's codes to the next
  const uint16_t *d16, *m16;  // packed: the first tile's [Gs, 16] scales (tile stride Gs * 16)
  const float *d32, *m32;     // panel: [NC, G, 16] scales
};

Cols packed_cols(const Packed& w, int64_t p0) {
  return Cols{w.qs + p0 * w.G * w.block_bytes, w.G * w.block_bytes, w.d + p0 * w.Gs * 16,
              w.m ? w.m + p0 * w.Gs * 16 : nullptr, nullptr, nullptr};
}

#ifdef MINFER_X86
#define MINFER_VNNI_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
#define MINFER_AVX2_TARGET "avx2,fma,f16c"


// 8 scales (float16 or bfloat16) -> 8 floats
__attribute__((always_inline, target(MINFER_AVX2_TARGET))) inline __m256 load_scales8(const uint16_t* s, int bf16) {
  const __m128i h = _mm_loadu_si128((const __m128i*)s);
  if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

// A thread's panel of up to 2 column tiles: 4-bit codes split into one byte each (the K order of the 8-bit
// layout: 64-byte vector 2i holds a load's low nibbles, K 8i..8i+3; vector 2i+1 its high ones), so the inner
// loop does no and / shift; 8-bit codes are already bytes and stay where they are. Scales become floats,
// one row of 16 per block of 32 (no g / gs in the loop).
struct Panel {
  std::vector<uint8_t> bytes;
  std::vector<float> d, m;
  uint8_t* codes = nullptr;  // bytes, 64-byte aligned
  int64_t p0 = -1;
};

__attribute__((target(MINFER_AVX2_TARGET))) Cols fill_panel(Panel& pn, const Packed& w, int64_t p0, int nc) {
  const int64_t G = w.G;
  if (pn.p0 != p0) {
    pn.p0 = p0;
    if (w.bits == 4) {
      pn.bytes.resize(nc * G * 512 + 64);
      pn.codes = (uint8_t*)(((uintptr_t)pn.bytes.data() + 63) & ~(uintptr_t)63);
      const __m256i low4 = _mm256_set1_epi8(0x0f);
      for (int64_t b = 0; b < nc * G; ++b)  // the tiles' blocks are consecutive in both layouts
        for (int i = 0; i < 4; ++i)
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(w.qs + (p0 * G + b) * 256 + i * 64 + h * 32));
            uint8_t* o = pn.codes + b * 512 + 2 * i * 64 + h * 32;
            _mm256_store_si256((__m256i*)o, _mm256_and_si256(v, low4));
            _mm256_store_si256((__m256i*)(o + 64), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
          }
    }
    pn.d.resize(nc * G * 16);
    if (w.m) pn.m.resize(nc * G * 16);
    for (int c = 0; c < nc; ++c)
      for (int64_t g = 0; g < G; ++g)
        for (int h = 0; h < 2; ++h) {
          const int64_t from = ((p0 + c) * w.Gs + g / w.gs) * 16 + 8 * h, to = (c * G + g) * 16 + 8 * h;
          _mm256_storeu_ps(pn.d.data() + to, load_scales8(w.d + from, w.bf16));
          if (w.m) _mm256_storeu_ps(pn.m.data() + to, load_scales8(w.m + from, w.bf16));
        }
  }
  return Cols{w.bits == 4 ? pn.codes : w.qs + p0 * G * 512, G * 512, nullptr, nullptr, pn.d.data(),
              w.m ? pn.m.data() : nullptr};
}

// 16 scales (float16 or bfloat16) -> 16 floats
__attribute__((always_inline, target(MINFER_VNNI_TARGET))) inline __m512 load_scales16(const uint16_t* s, int bf16) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)s);
  if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// The 32 bits of activation codes at `p` (4 of K), for a broadcast load.
inline int32_t load4(const int8_t* p) {
  int32_t a;
  std::memcpy(&a, p, 4);
  return a;
}

// ---- AVX-512 VNNI: R rows x NC tiles of 16 columns; zmm int32 sums per (row, tile) per block ----
// Each dot starts at -c sx (a broadcast load, no vector instruction), so only dpbusd runs until the epilogue.
template <int R, int NC, int kBits, bool kPanel, int kEpi>
__attribute__((target(MINFER_VNNI_TARGET))) void tile_vnni(const Packed& w, const Cols& cols, int64_t p0,
                                                          const QuantizedRows& x, int64_t t0, int64_t K, float* out,
                                                          int64_t N) {
  constexpr bool kNibbles = kBits == 4 && !kPanel;  // two codes per byte: split in the loop
  const int64_t G = w.G, bb = kNibbles ? 256 : 512;
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const int8_t* xrow[R];
  for (int r = 0; r < R; ++r) xrow[r] = x.q.data() + (t0 + r) * K;
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[R][NC];
    for (int r = 0; r < R; ++r) {
      const __m512i init = _mm512_set1_epi32(x.ncs[(t0 + r) * G + g]);
      for (int c = 0; c < NC; ++c) dot[r][c] = init;
    }
    const uint8_t* blk[NC];
    for (int c = 0; c < NC; ++c) blk[c] = cols.qs + c * cols.qs_tile + g * bb;
    for (int i = 0; i < 4; ++i) {  // K 8i..8i+3 (lo) and 8i+4..8i+7 (hi)
      __m512i lo[NC], hi[NC];
      for (int c = 0; c < NC; ++c) {
        if (kNibbles) {
          const __m512i v = _mm512_loadu_si512((const void*)(blk[c] + i * 64));
          lo[c] = _mm512_and_si512(v, low4);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        } else {
          lo[c] = _mm512_loadu_si512((const void*)(blk[c] + 2 * i * 64));
          hi[c] = _mm512_loadu_si512((const void*)(blk[c] + (2 * i + 1) * 64));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xa = _mm512_set1_epi32(load4(xrow[r] + g * kBlock + 8 * i));
        const __m512i xb = _mm512_set1_epi32(load4(xrow[r] + g * kBlock + 8 * i + 4));
        for (int c = 0; c < NC; ++c) {
          dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], lo[c], xa);
          dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], hi[c], xb);
        }
      }
    }
    if (kEpi == kPerRow) {
      for (int r = 0; r < R; ++r) {
        const __m512 dx = _mm512_set1_ps(x.d[(t0 + r) * G + g]);
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), dx, acc[r][c]);
      }
      continue;
    }
    __m512 dw[NC], mw[NC];
    for (int c = 0; c < NC; ++c) {
      if (kPanel) {
        dw[c] = _mm512_loadu_ps(cols.d32 + (c * G + g) * 16);
        if (kEpi == kPerBlockM) mw[c] = _mm512_loadu_ps(cols.m32 + (c * G + g) * 16);
      } else {
        dw[c] = load_scales16(cols.d16 + (c * w.Gs + g / w.gs) * 16, w.bf16);
        if (kEpi == kPerBlockM) mw[c] = load_scales16(cols.m16 + (c * w.Gs + g / w.gs) * 16, w.bf16);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t xi = (t0 + r) * G + g;
      const __m512 dx = _mm512_set1_ps(x.d[xi]);
      for (int c = 0; c < NC; ++c) {
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), _mm512_mul_ps(dw[c], dx), acc[r][c]);
        if (kEpi == kPerBlockM) acc[r][c] = _mm512_fmadd_ps(mw[c], _mm512_set1_ps(x.ds[xi]), acc[r][c]);
      }
    }
  }
  for (int c = 0; c < NC; ++c) {
    const int64_t n0 = (p0 + c) * 16;
    const int64_t left = N - n0;
    const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    __m512 dw = _mm512_setzero_ps();
    if (kEpi == kPerRow) dw = kPanel ? _mm512_loadu_ps(cols.d32 + c * G * 16) : load_scales16(cols.d16 + c * 16, w.bf16);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + (t0 + r) * N + n0, mask, kEpi == kPerRow ? _mm512_mul_ps(acc[r][c], dw) : acc[r][c]);
  }
}

// ---- AVX2: R rows x one tile of 16 columns, as two halves of 8 (ymm); same float operations as VNNI ----
template <int R, int NC, int kBits, bool kPanel, int kEpi>
__attribute__((target(MINFER_AVX2_TARGET))) void tile_avx2(const Packed& w, const Cols& cols, int64_t p0,
                                                           const QuantizedRows& x, int64_t t0, int64_t K, float* out,
                                                           int64_t N) {
  static_assert(NC == 1, "the AVX2 tile is one column tile (16 ymm registers)");
  constexpr bool kNibbles = kBits == 4 && !kPanel;
  const int64_t G = w.G, bb = kNibbles ? 256 : 512;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
  const int8_t* xrow[R];
  for (int r = 0; r < R; ++r) xrow[r] = x.q.data() + (t0 + r) * K;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* blk = cols.qs + g * bb;
    for (int h = 0; h < 2; ++h) {  // columns 8h .. 8h + 7
      __m256i dot[R];
      // 8-bit: the sums below are already q . x (no + 128: see the layout), so they start at 0, not -128 sx
      for (int r = 0; r < R; ++r)
        dot[r] = kBits == 8 ? _mm256_setzero_si256() : _mm256_set1_epi32(x.ncs[(t0 + r) * G + g]);
      if (kBits == 4) {
        for (int i = 0; i < 4; ++i) {
          __m256i lo, hi;
          if (kNibbles) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + i * 64 + h * 32));
            lo = _mm256_and_si256(v, low4);
            hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          } else {
            lo = _mm256_loadu_si256((const __m256i*)(blk + 2 * i * 64 + h * 32));
            hi = _mm256_loadu_si256((const __m256i*)(blk + (2 * i + 1) * 64 + h * 32));
          }
          for (int r = 0; r < R; ++r) {
            // 0..15 x -127..127: the int16 pair sums cannot saturate
            const __m256i pa = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(xrow[r] + g * kBlock + 8 * i)));
            const __m256i pb = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(xrow[r] + g * kBlock + 8 * i + 4)));
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_add_epi16(pa, pb), ones));
          }
        }
      } else {
        for (int i = 0; i < 8; ++i) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + i * 64 + h * 32));
          const __m256i q = _mm256_xor_si256(v, flip);  // back to the signed code
          const __m256i aq = _mm256_sign_epi8(q, q);    // |q| as u8 (-128 -> 128)
          for (int r = 0; r < R; ++r) {
            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load4(xrow[r] + g * kBlock + 4 * i)), q);
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, xs), ones));
          }
        }
      }
      if (kEpi == kPerRow) {
        for (int r = 0; r < R; ++r)
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(x.d[(t0 + r) * G + g]), acc[r][h]);
        continue;
      }
      const __m256 dw = kPanel ? _mm256_loadu_ps(cols.d32 + g * 16 + 8 * h)
                               : load_scales8(cols.d16 + (g / w.gs) * 16 + 8 * h, w.bf16);
      __m256 mw = _mm256_setzero_ps();
      if (kEpi == kPerBlockM)
        mw = kPanel ? _mm256_loadu_ps(cols.m32 + g * 16 + 8 * h) : load_scales8(cols.m16 + (g / w.gs) * 16 + 8 * h, w.bf16);
      for (int r = 0; r < R; ++r) {
        const int64_t xi = (t0 + r) * G + g;
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(dw, _mm256_set1_ps(x.d[xi])), acc[r][h]);
        if (kEpi == kPerBlockM) acc[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.ds[xi]), acc[r][h]);
      }
    }
  }
  const int64_t n0 = p0 * 16;
  for (int h = 0; h < 2 && kEpi == kPerRow; ++h) {
    const __m256 dw = kPanel ? _mm256_loadu_ps(cols.d32 + 8 * h) : load_scales8(cols.d16 + 8 * h, w.bf16);
    for (int r = 0; r < R; ++r) acc[r][h] = _mm256_mul_ps(acc[r][h], dw);
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + (t0 + r) * N + n0;
    if (N - n0 >= 16) {
      _mm256_storeu_ps(o, acc[r][0]);
      _mm256_storeu_ps(o + 8, acc[r][1]);
    } else {
      float tmp[16];
      _mm256_storeu_ps(tmp, acc[r][0]);
      _mm256_storeu_ps(tmp + 8, acc[r][1]);
      std::memcpy(o, tmp, (N - n0) * sizeof(float));
    }
  }
}
#endif

using TileFn = void (*)(const Packed&, const Cols&, int64_t, const QuantizedRows&, int64_t, int64_t, float*, int64_t);

// fn[R - 1][NC - 1] for one ISA, weight kind, source (packed or panel) and epilogue
struct Tiles {
  TileFn fn[kMaxMR][2];
  int mr, max_nc;
};

#ifdef MINFER_X86
template <int B, bool P, int E>
Tiles vnni_tiles() {
#define MINFER_ROW(R) {tile_vnni<R, 1, B, P, E>, tile_vnni<R, 2, B, P, E>}
  return Tiles{{MINFER_ROW(1), MINFER_ROW(2), MINFER_ROW(3), MINFER_ROW(4), MINFER_ROW(5), MINFER_ROW(6)}, 6, 2};
#undef MINFER_ROW
}

template <int B, bool P, int E>
Tiles avx2_tiles() {
#define MINFER_ROW(R) {tile_avx2<R, 1, B, P, E>, nullptr}
  return Tiles{{MINFER_ROW(1), MINFER_ROW(2), MINFER_ROW(3), MINFER_ROW(4), {nullptr, nullptr}, {nullptr, nullptr}},
               4, 1};
#undef MINFER_ROW
}

template <int B, bool P, int E>
Tiles tiles_for(int isa) { return isa == 3 ? vnni_tiles<B, P, E>() : avx2_tiles<B, P, E>(); }

// 4-bit codes have a per-block or per-block-with-m epilogue, 8-bit ones (no m) a per-block or per-row one
template <bool P>
Tiles pick(int isa, int bits, int epi) {
  if (bits == 4) return epi == kPerBlockM ? tiles_for<4, P, kPerBlockM>(isa) : tiles_for<4, P, kPerBlock>(isa);
  return epi == kPerRow ? tiles_for<8, P, kPerRow>(isa) : tiles_for<8, P, kPerBlock>(isa);
}
#endif

int best_isa() {
#ifdef MINFER_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return 3;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return 2;
#endif
  return 1;
}

}  // namespace

extern "C" int minfer_qgemm_best_isa() { return best_isa(); }

// out float32 [T, N]; x float32 [T, K]; qs / d / m as in the header comment (m may be null); K % 32 == 0,
// (K / 32) % gs == 0, bits 4 or 8 (checked in Python). isa: 0 = best available; a forced one this CPU lacks
// falls back to the best available. Returns the one used.
extern "C" int minfer_qgemm(float* out, const float* x, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
                            int bits, int offset, int bf16, int64_t gs, int64_t T, int64_t N, int64_t K, int isa,
                            int num_threads) {
  const int best = best_isa();
  if (isa <= 0 || isa > best) isa = best;
  if (num_threads < 1) num_threads = 1;
  QuantizedRows xq;
  quantize_rows(x, T, K, offset, xq, num_threads, isa >= 2);
  Packed w{qs, d, m, bits, offset, bf16, gs, K / kBlock, K / kBlock / gs, bits == 4 ? 256 : 512};
  const int64_t P = (N + 15) / 16;
  const int64_t chunks = (T + kChunk - 1) / kChunk;
#ifdef MINFER_X86
  if (isa >= 2) {
    const bool panel = T >= kPanelRows;
    const int epi = epilogue_of(w);
    const Tiles tiles = panel ? pick<true>(isa, bits, epi) : pick<false>(isa, bits, epi);
    const int nc = tiles.max_nc, mr = tiles.mr;
    const int64_t units = (P + nc - 1) / nc, supers = (chunks + kSuper - 1) / kSuper;
#pragma omp parallel num_threads(num_threads)
    {
      Panel pn;  // this thread's; refilled only when its next work item has other column tiles
#pragma omp for collapse(3) schedule(static)
      for (int64_t sc = 0; sc < supers; ++sc) {
        for (int64_t u = 0; u < units; ++u) {
          for (int64_t c8 = 0; c8 < kSuper; ++c8) {
            const int64_t ch = sc * kSuper + c8;
            if (ch >= chunks) continue;
            const int64_t p0 = u * nc;
            const int this_nc = (int)(P - p0 < nc ? P - p0 : nc);
            const Cols cols = panel ? fill_panel(pn, w, p0, this_nc) : packed_cols(w, p0);
            const int64_t t_end = (ch + 1) * kChunk < T ? (ch + 1) * kChunk : T;
            for (int64_t t0 = ch * kChunk; t0 < t_end; t0 += mr) {
              const int R = (int)(t_end - t0 < mr ? t_end - t0 : mr);
              tiles.fn[R - 1][this_nc - 1](w, cols, p0, xq, t0, K, out, N);
            }
          }
        }
      }
    }
    return isa;
  }
#endif
#pragma omp parallel for collapse(2) num_threads(num_threads) schedule(static)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    for (int64_t p = 0; p < P; ++p) {
      const int64_t t_end = (ch + 1) * kChunk < T ? (ch + 1) * kChunk : T;
      tile_scalar(w, p, xq, ch * kChunk, (int)(t_end - ch * kChunk), K, out, N);
    }
  }
  return 1;
}
