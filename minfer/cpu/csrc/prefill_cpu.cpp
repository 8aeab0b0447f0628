// Causal prefill attention of one sequence on the CPU, float32, GQA (chapter 9 §9.2.6; the algorithm is
// FlashAttention's: Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness",
// blocks of keys with an online softmax, as chapter 4's Triton kernel does on a GPU).
//
//   out[i, h] = sum_j softmax_j(scale * q[i, h] . k[j, g]) v[j, g],   g = h / (H / KVH),
//   j over the keys query i sees: the queries are the LAST Tq of the Tk keys (a whole prompt: Tq = Tk; a later
//   chunk or a prefix-cache hit: the earlier keys come first), so query i sees keys 0 .. Tk - Tq + i.
//
// Why not torch's SDPA: on the server workload (prompts of 192 tokens) its CPU flash kernel took ~0.9 ms per
// prompt and layer, ~45 GFLOP/s; this one skips the blocks a causal mask hides and keeps K transposed, so
// that scores and outputs are vector FMAs along the keys and along D, with no horizontal sums.
//
// Layout: q [Tq, H, D] with row stride q_stride (floats) and head stride D; k, v [Tk, KVH, D] with row strides
// k_stride, v_stride; out [Tq, H, D] contiguous. scratch: at least minfer_prefill_scratch_floats(...) floats.
//
// Exactness: each query row is computed on its own, in the same order whatever the other rows are: its scores
// block by block of kBK keys from key 0, each score one FMA chain over d, the online softmax over the blocks in
// order. So a row's result does not depend on Tq (a chunk gives the same bits as the whole prompt for its rows)
// or on the thread split. exp is the vectorized expf of -ffast-math builds (libmvec), not the scalar one.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBK = 64;  // keys per block
constexpr int64_t kBQ = 8;   // query rows per work item (they share each K and V load; rows stay independent)
constexpr int64_t kMaxD = 256;
// "Minus infinity" for masked scores and the running max before the first key: finite, since the library is
// built with -ffast-math (which lets the compiler assume no infinities); exp of it underflows to exactly 0.
constexpr float kNeg = -1e30f;

#if defined(__AVX512F__)
// e^x for 16 lanes of x <= 0 (a score minus the running max): x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// degree-6 Taylor polynomial (relative error ~2e-7, float32's own rounding), times 2^n (vscalefps). Below -87.3
// (e^x under float32's smallest normal, and the masked keys' kNeg) it is exactly 0. A NaN stays NaN (an
// overflowed activation must reach the output, as through libm's expf and the decode kernel): the compare is
// unordered-true and vmaxps returns its second operand, x, when either is NaN. Written out because the
// softmax's exp was about half of this kernel's time through libm's vector expf.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_NLT_UQ);
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts (Cody-Waite)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}
const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif

// Query rows r0 .. r0 + R - 1 (R <= kBQ) of one head; row r sees keys [0, n[r]) (n ascending). kt: the KV head's
// keys transposed, [D][ld] (ld >= keys rounded up to 16, zero padded); v: its values, rows of stride v_stride.
void attend_rows(float* out, int64_t out_stride, const float* q, int64_t q_stride, const float* kt, int64_t ld,
                 const float* v, int64_t v_stride, int64_t R, const int64_t* n, int64_t D, float scale) {
  // The hot loops run over all kBQ rows, so that their accumulators are registers (a loop bound known when
  // compiling); a block of fewer rows repeats its last row in the spare ones, whose results are not stored.
  alignas(64) float S[kBQ][kBK];
  alignas(64) float o[kBQ][kMaxD];
  float m[kBQ], l[kBQ];
  const float* qr[kBQ];
  int64_t lim_end[kBQ];
  for (int64_t r = 0; r < kBQ; ++r) {
    qr[r] = q + (r < R ? r : R - 1) * q_stride;
    lim_end[r] = n[r < R ? r : R - 1];
  }
  for (int64_t r = 0; r < kBQ; ++r) {
    m[r] = kNeg;
    l[r] = 0.0f;
    for (int64_t d = 0; d < D; ++d) o[r][d] = 0.0f;
  }
  const int64_t nmax = n[R - 1];
  for (int64_t j0 = 0; j0 < nmax; j0 += kBK) {
    const int64_t bk = nmax - j0 < kBK ? nmax - j0 : kBK;
    // scores S[r][c] = q_r . k_{j0+c}: one FMA chain over d per score
#if defined(__AVX512F__)
    for (int64_t c0 = 0; c0 < bk; c0 += 16) {
      __m512 acc[kBQ];
      for (int64_t r = 0; r < kBQ; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m512 kv = _mm512_loadu_ps(kt + d * ld + j0 + c0);
        for (int64_t r = 0; r < kBQ; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), kv, acc[r]);
      }
      for (int64_t r = 0; r < kBQ; ++r) _mm512_store_ps(&S[r][c0], acc[r]);
    }
#else
    for (int64_t r = 0; r < kBQ; ++r) {
      for (int64_t c = 0; c < bk; ++c) S[r][c] = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qr[r][d];
        const float* kr = kt + d * ld + j0;
        for (int64_t c = 0; c < bk; ++c) S[r][c] = __builtin_fmaf(qd, kr[c], S[r][c]);
      }
    }
#endif
    // Online softmax, row by row. Keys past a row's limit weigh exactly 0 and leave its max alone, and these
    // loops always run over the whole kBK (fixed-length vector loops, no scalar tail), so a row's bits do not
    // depend on how many keys the other rows of its block see.
#if defined(__AVX512F__)
    for (int64_t r = 0; r < kBQ; ++r) {
      const __m512i lim = _mm512_set1_epi32((int)(lim_end[r] - j0));
      __m512 s[kBK / 16];
      __m512 vmax = _mm512_set1_ps(m[r]);
      for (int64_t c = 0; c < kBK / 16; ++c) {
        const __mmask16 seen = _mm512_cmplt_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32((int)(16 * c))), lim);
        s[c] = _mm512_mask_mul_ps(_mm512_set1_ps(kNeg), seen, _mm512_load_ps(&S[r][16 * c]), _mm512_set1_ps(scale));
        vmax = _mm512_max_ps(vmax, s[c]);
      }
      const float mb = _mm512_reduce_max_ps(vmax);
      const float alpha = std::exp(m[r] - mb);  // 0 on the row's first block, 1 on a block it does not see
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t c = 0; c < kBK / 16; ++c) {
        const __m512 e = exp_nonpositive(_mm512_sub_ps(s[c], _mm512_set1_ps(mb)));
        _mm512_store_ps(&S[r][16 * c], e);
        vsum = _mm512_add_ps(vsum, e);
      }
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(vsum);
      m[r] = mb;
      for (int64_t d = 0; d < D; ++d) o[r][d] *= alpha;
    }
#else
    for (int64_t r = 0; r < kBQ; ++r) {
      const int64_t lim = lim_end[r] - j0;  // keys of this block row r sees
      float mb = m[r];
      for (int64_t c = 0; c < kBK; ++c) {
        S[r][c] = c < lim ? S[r][c] * scale : kNeg;
        mb = S[r][c] > mb ? S[r][c] : mb;
      }
      const float alpha = std::exp(m[r] - mb);  // 0 on the row's first block, 1 on a block it does not see
      float sum = 0.0f;
      for (int64_t c = 0; c < kBK; ++c) {
        S[r][c] = std::exp(S[r][c] - mb);
        sum += S[r][c];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = mb;
      for (int64_t d = 0; d < D; ++d) o[r][d] *= alpha;
    }
#endif
    // o_r += sum_c p_rc v_c
#if defined(__AVX512F__)
    if (D % 32 == 0) {
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m512 a0[kBQ], a1[kBQ];
        for (int64_t r = 0; r < kBQ; ++r) {
          a0[r] = _mm512_load_ps(&o[r][d0]);
          a1[r] = _mm512_load_ps(&o[r][d0 + 16]);
        }
        for (int64_t c = 0; c < bk; ++c) {
          const float* vr = v + (j0 + c) * v_stride + d0;
          const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
          for (int64_t r = 0; r < kBQ; ++r) {
            const __m512 p = _mm512_set1_ps(S[r][c]);
            a0[r] = _mm512_fmadd_ps(p, v0, a0[r]);
            a1[r] = _mm512_fmadd_ps(p, v1, a1[r]);
          }
        }
        for (int64_t r = 0; r < kBQ; ++r) {
          _mm512_store_ps(&o[r][d0], a0[r]);
          _mm512_store_ps(&o[r][d0 + 16], a1[r]);
        }
      }
      continue;
    }
#endif
    for (int64_t r = 0; r < kBQ; ++r)
      for (int64_t c = 0; c < bk; ++c) {
        const float p = S[r][c];
        const float* vr = v + (j0 + c) * v_stride;
        for (int64_t d = 0; d < D; ++d) o[r][d] = __builtin_fmaf(p, vr[d], o[r][d]);
      }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / l[r];
    for (int64_t d = 0; d < D; ++d) out[r * out_stride + d] = o[r][d] * inv;
  }
}

int64_t padded(int64_t tk) { return (tk + 15) / 16 * 16 + 16; }

}  // namespace

extern "C" {

int64_t minfer_prefill_scratch_floats(int64_t tk, int64_t kv_heads, int64_t head_dim) {
  return kv_heads * head_dim * padded(tk);
}

// Returns 0, or -1 when head_dim is over kMaxD (256) and nothing was computed.
int minfer_prefill_attention_f32(float* out, const float* q, const float* k, const float* v, int64_t tq, int64_t tk,
                                 int64_t H, int64_t KVH, int64_t D, int64_t q_stride, int64_t k_stride,
                                 int64_t v_stride, float scale, float* scratch, int num_threads) {
  if (D > kMaxD) return -1;
  const int64_t ld = padded(tk);
  float* kt = scratch;  // [KVH][D][ld], the keys transposed and zero padded
#pragma omp parallel for num_threads(num_threads)
  for (int64_t gd = 0; gd < KVH * D; ++gd) {
    const int64_t g = gd / D, d = gd % D;
    float* row = kt + gd * ld;
    for (int64_t j = 0; j < tk; ++j) row[j] = k[j * k_stride + g * D + d];
    for (int64_t j = tk; j < ld; ++j) row[j] = 0.0f;
  }
  const int64_t group = H / KVH, blocks = (tq + kBQ - 1) / kBQ, first = tk - tq;
  // Work items (block of query rows, head), the longest (last rows) first so that the threads end together.
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t item = 0; item < H * blocks; ++item) {
    const int64_t b = blocks - 1 - item / H, h = item % H, g = h / group;
    const int64_t i0 = b * kBQ, R = tq - i0 < kBQ ? tq - i0 : kBQ;
    int64_t n[kBQ];
    for (int64_t r = 0; r < R; ++r) n[r] = first + i0 + r + 1;
    attend_rows(out + (i0 * H + h) * D, H * D, q + i0 * q_stride + h * D, q_stride, kt + g * D * ld, ld,
                v + g * D, v_stride, R, n, D, scale);
  }
  return 0;
}

}  // extern "C"
