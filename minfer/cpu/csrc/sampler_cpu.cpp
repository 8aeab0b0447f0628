// The fused CPU sampler (chapter 7 §7.4, article §7-2 and §13): one row of logits in, one token out, with
// temperature, the grammar's token mask, top-k, top-p and min-p and an inverse-CDF draw done together in
// a few passes over the row's own scratch memory (which stays in the core's cache), where the torch path
// (minfer/sampling.py) makes a new [B, V] tensor for every step: divide, sort, softmax, cumsum, mask,
// scatter back, softmax, an exponential noise tensor (one log a token), divide, argmax.
//
// What the passes do, per row (rows in parallel, OpenMP):
//   1. s_i = logit_i / T (or -inf where the mask forbids token i), and m = max s.
//   2. The kept set is a prefix of the row sorted by (s descending, index ascending). top-k, top-p (on the
//      top-k set, renormalized, as HF and vLLM) and min-p each give a prefix length; the shortest wins
//      (what torch gets by applying them one after another). Only top-k and top-p need an order: top-k one
//      nth_element (O(V)); top-p a partial sort that grows until the mass reaches p (it rarely needs more
//      than a few hundred tokens). The last kept element c is the cut: token i is kept iff
//      (s_i, -i) >= (s_c, -c).
//   3. Inverse CDF: Z = sum over kept tokens of exp(s_i - m), in double; with one uniform u of the row,
//      the token is the first i (in index order) where the running sum passes u * Z. One random number a
//      row, not one a token.
//   4. Optionally the drawn token's logprob under the raw logits (what the engine reports, as vLLM).
// T = 0 (greedy) is an exact argmax, the lowest index on ties, as torch.argmax.
// Plain extern "C" functions over raw pointers: minfer/cpu/sampler.py checks shapes and calls them
// through ctypes.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr float kNegInf = -INFINITY;

struct Row {
    std::vector<float> s;    // scaled, masked logits
    std::vector<float> e;    // exp(s - m) of kept tokens, 0 elsewhere
    std::vector<int32_t> idx;  // candidate token ids, for top-k / top-p ordering
};

// argmax with the lowest index on ties; -1 when every value is -inf.
int64_t argmax(const float* s, int64_t n) {
    float best = -FLT_MAX;
    int64_t arg = -1;
    for (int64_t i = 0; i < n; ++i)
        if (s[i] > best) { best = s[i]; arg = i; }
    return arg;
}

float raw_logprob(const float* raw, int64_t v, int64_t token) {
    float m = -FLT_MAX;
    for (int64_t i = 0; i < v; ++i) m = std::max(m, raw[i]);
    double z = 0.0;
#pragma omp simd reduction(+ : z)
    for (int64_t i = 0; i < v; ++i) z += std::exp(raw[i] - m);
    return static_cast<float>(raw[token] - m - std::log(z));
}

int64_t sample_row(const float* x, const int32_t* mask, int64_t v, float temperature, int64_t top_k,
                   float top_p, float min_p, float u, Row& w) {
    float* s = w.s.data();
    // Pass 1: scale, mask, max.
    const float inv_t = temperature > 0.f ? 1.f / temperature : 1.f;
    if (mask) {
        for (int64_t i = 0; i < v; ++i)
            s[i] = ((mask[i >> 5] >> (i & 31)) & 1) ? x[i] * inv_t : kNegInf;
    } else {
#pragma omp simd
        for (int64_t i = 0; i < v; ++i) s[i] = x[i] * inv_t;
    }
    if (temperature <= 0.f) {
        int64_t a = argmax(s, v);
        return a < 0 ? 0 : a;
    }
    float m = -FLT_MAX;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < v; ++i) m = std::max(m, s[i]);
    if (!(m > -FLT_MAX)) return 0;  // nothing allowed: token 0, as torch's argmax of an all -inf row

    // Pass 2: the cut. Start with every allowed token (cut below all of them); min-p is a threshold on s.
    float cut_s = -FLT_MAX;
    int64_t cut_i = v;
    if (min_p > 0.f) cut_s = m + std::log(min_p);  // p_i >= min_p * p_max  <=>  s_i >= m + log(min_p)
    const bool use_k = top_k > 0 && top_k < v, use_p = top_p < 1.f;
    if (use_k || use_p) {
        auto before = [s](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
        int32_t* idx = w.idx.data();
        int64_t n = 0;
        for (int64_t i = 0; i < v; ++i)
            if (s[i] > -FLT_MAX) idx[n++] = static_cast<int32_t>(i);
        int64_t keep = n;
        if (use_k && top_k < n) {
            std::nth_element(idx, idx + top_k - 1, idx + n, before);
            keep = top_k;
        }
        if (use_p) {
            // Mass of the top-k set (or of all): the renormalizer of top-p.
            double z = 0.0;
            for (int64_t j = 0; j < keep; ++j) z += std::exp(s[idx[j]] - m);
            const double target = static_cast<double>(top_p) * z;
            // Sorted prefix grows until the mass strictly before a token reaches top_p: that token and all
            // after it are dropped (the top token is always kept).
            double acc = 0.0;
            int64_t sorted = 0, j = 0, chunk = std::min<int64_t>(keep, 256);
            int64_t p_keep = keep;
            while (true) {
                std::partial_sort(idx + sorted, idx + chunk, idx + keep, before);
                sorted = chunk;
                for (; j < sorted; ++j) {
                    if (j > 0 && acc >= target) break;
                    acc += std::exp(s[idx[j]] - m);
                }
                if (j < sorted || sorted == keep) { p_keep = j; break; }
                chunk = std::min<int64_t>(keep, chunk * 8);
            }
            keep = p_keep;
        } else {
            std::nth_element(idx, idx + keep - 1, idx + keep, before);  // the cut: the last of the top-k
        }
        if (keep < n) {
            const int32_t c = idx[keep - 1];
            if (s[c] > cut_s || (s[c] == cut_s && c < cut_i)) { cut_s = s[c]; cut_i = c; }
        }
    }

    // Pass 3: exp of the kept tokens and their sum, then the inverse-CDF walk.
    float* e = w.e.data();
    double z = 0.0;
#pragma omp simd reduction(+ : z)
    for (int64_t i = 0; i < v; ++i) {
        const bool kept = s[i] > cut_s || (s[i] == cut_s && i <= cut_i);
        const float ei = kept ? std::exp(s[i] - m) : 0.f;
        e[i] = ei;
        z += ei;
    }
    const double target = static_cast<double>(u) * z;
    double acc = 0.0;
    int64_t last = -1;
    for (int64_t i = 0; i < v; ++i) {
        if (e[i] > 0.f) {
            acc += e[i];
            last = i;
            if (acc > target) return i;
        }
    }
    return last < 0 ? argmax(s, v) : last;  // rounding left the walk short: the last kept token
}

}  // namespace

extern "C" {

// logits: float32 [B, V] (processed: penalties, bias); raw: float32 [B, V] for logprobs, or null;
// mask: int32 [B, W] bitmask or null; temperature, top_p, min_p, uniform: float32 [B]; top_k: int64 [B]
// (<= 0 or >= V: off); tokens: int64 [B] out; logprobs: float32 [B] out, or null.
void minfer_sample_f32(const float* logits, const float* raw, const int32_t* mask, int64_t mask_words,
                       int64_t b, int64_t v, const float* temperature, const int64_t* top_k, const float* top_p,
                       const float* min_p, const float* uniform, int64_t* tokens, float* logprobs,
                       int num_threads) {
    // One row per thread at a time; a single row (or a single thread) runs without a parallel region.
    const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, b)));
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        Row w;
        w.s.resize(v);
        w.e.resize(v);
        w.idx.resize(v);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < b; ++r) {
            const int64_t t = sample_row(logits + r * v, mask ? mask + r * mask_words : nullptr, v,
                                         temperature[r], top_k[r], top_p[r], min_p[r], uniform[r], w);
            tokens[r] = t;
            if (logprobs) logprobs[r] = raw_logprob(raw + r * v, v, t);
        }
    }
}

}  // extern "C"
