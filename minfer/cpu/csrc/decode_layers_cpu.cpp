// A whole decode step of the Llama decoder stack in ONE call from Python (chapter 9 §9.2.4 and §9.2.6, chapter 5
// §5.4): one new token for each of `rows` sequences (1 for a quantized model), for every layer
//
//   rms_norm(+ residual) -> q|k|v GEMM -> RoPE -> K/V store into the paged cache -> decode attention
//   -> o GEMM -> residual + rms_norm -> gate|up GEMM -> silu * mul -> down GEMM
//
// with no Python, no torch allocation and no ctypes call between the steps.
//
// Why: at batch 1 the arithmetic of a 135M-parameter model is small (the integer GEMMs read ~85 MB per token,
// ~4-5 ms on two cores), but the per-op path pays ~60 Python-level calls per layer (module calls, tensor
// allocations, views, ctypes argument conversion), ~1,800 per token, which took about twice as long as the
// arithmetic. Here the 30 layers are one loop over a table of pointers built once. A float32 model's batched
// decode step (up to 16 rows, or 256 with the AVX-512 many-row tile; its weights in the panels) pays the same
// ~1,800 calls per step.
//
// Bit-identical to the per-op path BY CONSTRUCTION: this file does no arithmetic of its own. It calls the very
// functions the per-op path calls, through function pointers the Python side takes from the libraries it
// already loaded (`minfer_qgemm` of quantization/csrc/qgemm_cpu.cpp, `minfer_gemm_f32` of
// kernels/csrc/gemm_f32_cpu.cpp, the fused element-wise ops of
// model/csrc/fused_cpu.cpp, `minfer_paged_decode_f32` of attention/csrc/paged_decode_cpu.cpp), with the same
// arguments (the same thread count and instruction set), on buffers of the same layout. The same machine code
// on the same inputs gives the same bits; the only thing this file adds is memcpy (the K/V store and the
// contiguous copy of the queries, which are copies in the per-op path too). Each library keeps its own compiler flags (the attention kernel's
// -ffast-math, the others' -ffp-contract=off), which one shared build could not.
//
// Layout contract (checked on the Python side, minfer/cpu/decode_step.py):
//   x_in, residual_in (null when x_in is the embedding output: layer 0 of the model), x_out, residual_out:
//     float32 [rows, hidden]
//   per layer: the four projections, each as the integer GEMM's packed weights or as float32 panels
//     [ceil(N / 16), K, 16] (`panels` non-null); the two norm weights float32
//     [hidden]; the layer's K and V planes float32 [slots, KVH, D] (the pool's [num_blocks, block_size, KVH, D],
//     or the one-sequence cache's [max_len, KVH, D] seen as one block of max_len slots)
//   scratch: float32, at least `minfer_decode_layers_scratch_floats` floats

#include <cstdint>
#include <cstring>

extern "C" {

typedef int (*qgemm_fn)(float* out, const float* x, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
                        int bits, int offset, int bf16, int64_t gs, int64_t T, int64_t N, int64_t K, int isa,
                        int num_threads);
typedef void (*gemm_f32_fn)(float* out, const float* x, const float* packed, const float* bias, int64_t M,
                            int64_t N, int64_t K, int64_t x_stride, int64_t out_stride, float* xt_scratch,
                            int num_threads);
typedef void (*rms_norm_fn)(float* out, const float* x, const float* w, int64_t rows, int64_t cols,
                            int64_t x_stride, int64_t out_stride, float eps, int nthreads);
typedef void (*add_rms_norm_fn)(float* out, float* res_out, const float* x, const float* residual, const float* w,
                                int64_t rows, int64_t cols, int64_t x_stride, int64_t r_stride, float eps,
                                int nthreads);
typedef void (*silu_and_mul_fn)(float* out, const float* x, int64_t rows, int64_t inter, int64_t x_stride,
                                int nthreads);
typedef void (*rotary_fn)(float* q, float* k, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                          int64_t kv_heads, int64_t d, int64_t q_stride, int64_t q_head_stride, int64_t k_stride,
                          int64_t k_head_stride, int nthreads);
typedef void (*paged_decode_fn)(float* out, const float* q, const float* k_cache, const float* v_cache,
                                const int32_t* block_tables, const int32_t* context_lens, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                int64_t max_blocks, float scale, int64_t window, const float* alibi_slopes,
                                int num_threads);

// The kernels this step calls (the per-op path's own functions).
struct DecodeFns {
  qgemm_fn qgemm;
  rms_norm_fn rms_norm;
  add_rms_norm_fn add_rms_norm;
  silu_and_mul_fn silu_and_mul;
  rotary_fn rotary;
  paged_decode_fn paged_decode;
  gemm_f32_fn gemm_f32;
};

// One projection: in the integer GEMM's layout (minfer/cpu/qgemm.py: PackedWeight), with the
// arguments `qgemm_unchecked` passes (offset is 128 for 8-bit codes, gs the group in blocks of 32), or, when
// `panels` is set, float32 panels run by `minfer_gemm_f32` (minfer/cpu/gemm_f32.py).
struct QWeight {
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;  // null: no offset term
  int32_t bits, offset, bf16, pad_;
  int64_t gs, n, k;
  const float* panels;
};

struct DecodeLayer {
  QWeight qkv, o, gate_up, down;
  const float* input_norm;
  const float* post_norm;
  float* k_cache;
  float* v_cache;
};

// What the step shares across layers.
struct DecodeStep {
  int64_t hidden, heads, kv_heads, head_dim, inter;
  float eps, scale;
  const float* cos;  // [rows, D/2] at each token's position
  const float* sin;
  const int64_t* slots;  // [rows]: each token's K/V row in every layer's K and V planes
  const int32_t* block_table;  // [rows, max_blocks] of the sequences
  const int32_t* context_len;  // [rows], keys attended (this token's included)
  int64_t block_size, max_blocks;
  int32_t isa, nthreads;
  int64_t rows;
};

static int64_t gemm_scratch_floats(const DecodeStep* s) {
  const int64_t k = s->inter > s->hidden ? s->inter : s->hidden;  // the widest K (down: inter; o: heads * D)
  const int64_t hd = s->heads * s->head_dim;
  return s->rows * (k > hd ? k : hd);
}

int64_t minfer_decode_layers_scratch_floats(const DecodeStep* s) {
  const int64_t qkv = (s->heads + 2 * s->kv_heads) * s->head_dim;
  // per row: x, two residuals, the normed h, q|k|v, the queries, the attention output, gate|up, silu * up;
  // then the few-row GEMM's transposed rows
  return s->rows * (4 * s->hidden + qkv + 2 * s->heads * s->head_dim + 3 * s->inter) + gemm_scratch_floats(s);
}

static void gemm(const DecodeFns* f, const QWeight& w, float* out, const float* x, const DecodeStep* s,
                 float* xt) {
  if (w.panels != nullptr)
    f->gemm_f32(out, x, w.panels, nullptr, s->rows, w.n, w.k, w.k, w.n, xt, s->nthreads);
  else
    f->qgemm(out, x, w.qs, w.d, w.m, w.bits, w.offset, w.bf16, w.gs, s->rows, w.n, w.k, s->isa, s->nthreads);
}

void minfer_decode_layers(const DecodeFns* f, const DecodeLayer* layers, int64_t num_layers, const DecodeStep* s,
                          const float* x_in, const float* residual_in, float* x_out, float* residual_out,
                          float* scratch) {
  const int64_t hid = s->hidden, H = s->heads, KVH = s->kv_heads, D = s->head_dim, I = s->inter, T = s->rows;
  const int64_t row = (H + 2 * KVH) * D;  // one token's q|k|v
  const int nt = s->nthreads;
  float* x = scratch;               // [T, hid] the down projection's output (the next layer's input)
  float* res_a = x + T * hid;       // the residual after the input norm's add
  float* res_b = res_a + T * hid;   // ... and after the post-attention norm's add (two: no aliasing)
  float* h = res_b + T * hid;       // normed hidden state
  float* qkv = h + T * hid;         // [T, H + 2 KVH, D]
  float* qc = qkv + T * row;        // [T, H, D] the queries, contiguous (the attention kernel's layout)
  float* attn = qc + T * H * D;     // [T, H, D]
  float* gu = attn + T * H * D;     // [T, 2I] gate | up
  float* act = gu + T * 2 * I;      // [T, I] silu(gate) * up
  float* xt = act + T * I;          // the few-row GEMM's scratch
  const float* cur_x = x_in;
  const float* cur_res = residual_in;
  for (int64_t l = 0; l < num_layers; ++l) {
    const DecodeLayer& L = layers[l];
    // input norm, with the residual add except on the model's first layer (LlamaDecoderLayer.forward)
    if (cur_res == nullptr) {
      f->rms_norm(h, cur_x, L.input_norm, T, hid, hid, hid, s->eps, nt);
      cur_res = cur_x;
    } else {
      f->add_rms_norm(h, res_a, cur_x, cur_res, L.input_norm, T, hid, hid, hid, s->eps, nt);
      cur_res = res_a;
    }
    // attention block: q|k|v, RoPE in place on the q and k heads, K/V store, decode attention, o
    gemm(f, L.qkv, qkv, h, s, xt);
    f->rotary(qkv, qkv + H * D, s->cos, s->sin, T, H, KVH, D, row, D, row, D, nt);
    for (int64_t t = 0; t < T; ++t) {
      const float* k = qkv + t * row + H * D;
      std::memcpy(L.k_cache + s->slots[t] * KVH * D, k, KVH * D * sizeof(float));
      std::memcpy(L.v_cache + s->slots[t] * KVH * D, k + KVH * D, KVH * D * sizeof(float));
      std::memcpy(qc + t * H * D, qkv + t * row, H * D * sizeof(float));
    }
    f->paged_decode(attn, qc, L.k_cache, L.v_cache, s->block_table, s->context_len, T, H, KVH, D, s->block_size,
                    s->max_blocks, s->scale, 0, nullptr, nt);
    gemm(f, L.o, x, attn, s, xt);
    // MLP block: residual add + norm, gate|up, silu * up, down
    f->add_rms_norm(h, res_b, x, cur_res, L.post_norm, T, hid, hid, hid, s->eps, nt);
    cur_res = res_b;
    gemm(f, L.gate_up, gu, h, s, xt);
    f->silu_and_mul(act, gu, T, I, 2 * I, nt);
    gemm(f, L.down, x, act, s, xt);
    cur_x = x;
  }
  std::memcpy(x_out, cur_x, T * hid * sizeof(float));
  std::memcpy(residual_out, cur_res, T * hid * sizeof(float));
}

}  // extern "C"
