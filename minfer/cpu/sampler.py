"""The fused sampler on the CPU (chapter 7 §7.4; article §7-2 and §13, "fused sampling"): one C++ call
draws every row's token from its logits, where the torch path of `minfer.sampling.Sampler` runs a chain of
whole-tensor ops (divide by temperature, sort, softmax, cumsum, mask, scatter back, softmax again, an
exponential noise tensor, divide, argmax), each reading and writing `[B, V]` floats.

`csrc/sampler_cpu.cpp` does temperature, the grammar's token bitmask, top-k, top-p, min-p and an
inverse-CDF draw per row in its own cache-resident scratch: top-k is one `nth_element` (O(V)), top-p a
partial sort that grows only until the mass reaches p, and the draw needs one uniform number a row
(`u`), not one exponential a token. It can also return the drawn token's logprob under the raw logits.
It is built by `minfer.cpu.build` like the other C++ kernels; `kernels="reference"` leaves it out
(`minfer.platform`).

`CpuFusedSampler` is the engine's sampler on the CPU when the kernel builds (`minfer/worker.py`). Greedy rows
are the same argmax (lowest index on ties) as torch's, so greedy output is token-for-token unchanged.
A sampled row draws from the same distribution as the torch path, but not the same token for the same
seed: a seeded request draws its `u` from its own stream (`request_generator`), so its tokens stay
reproducible and independent of the batch, yet differ from the torch Sampler's.
"""

from __future__ import annotations

import torch

from minfer.cpu.build import I32, I64, PTR, CppLibrary, KernelUnavailable
from minfer.sampling import Sampler, apply_logits_processors

# -ffast-math lets gcc vectorize the exp loops (glibc's libmvec); -inf only meets comparisons, never math.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


class CpuSamplerUnavailable(KernelUnavailable):
    """The C++ sampler could not be built or loaded here (the message says why)."""


LIBRARY = CppLibrary("minfer_sampler_cpu", "sampler_cpu.cpp", CFLAGS, {
    "minfer_sample_f32": ([PTR, PTR, PTR, I64, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I32], None),
}, CpuSamplerUnavailable)
_library = LIBRARY.load
cpu_sampler_available = LIBRARY.available


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def fused_sample_cpu(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, uniform: torch.Tensor, bitmask: torch.Tensor | None = None,
                     raw_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row, drawn in one C++ call: temperature, bitmask, top-k, top-p, min-p, inverse CDF.

    Args:
        logits: float32 `[B, V]` CPU (after penalties and logit_bias, if any).
        temperature: float32 `[B]`, >= 0; 0 is greedy (exact argmax, the lowest index on ties).
        top_k: int64 `[B]`, <= 0 or >= V is off. top_p: float32 `[B]` in (0, 1], 1 is off (applied to the
            top-k set renormalized, as HF and vLLM). min_p: float32 `[B]` in [0, 1], 0 is off.
        uniform: float32 `[B]` in [0, 1), one per row: the draw is the first token (by id) where the
            cumulative probability of the kept tokens passes `uniform`.
        bitmask: structured output's int32 `[B, ceil(V/32)]` (bit j of word w allows token 32w + j), or None.
        raw_logits: float32 `[B, V]` or None: when given, also return the drawn tokens' logprobs under them.

    Returns:
        (tokens int64 `[B]`, logprobs float32 `[B]` or None).

    Raises:
        CpuSamplerUnavailable: the kernel cannot be built here.
        ValueError: a tensor of the wrong dtype, device or shape.
    """
    lib = _library()
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise ValueError(f"logits must be a float32 CPU tensor [B, V], got {logits.dtype} {tuple(logits.shape)} "
                         f"on {logits.device}")
    b, v = logits.shape
    logits = logits.contiguous()
    args = {}
    for name, t, dt in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                        ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                        ("uniform", uniform, torch.float32)):
        if t.shape != (b,) or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor of shape [{b}], got {tuple(t.shape)} on {t.device}")
        args[name] = t.to(dt).contiguous()
    words = 0
    if bitmask is not None:
        words = (v + 31) // 32
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != b or bitmask.shape[1] < words:
            raise ValueError(f"bitmask must be int32 [{b}, >= {words}], got {bitmask.dtype} {tuple(bitmask.shape)}")
        bitmask = bitmask.cpu().contiguous()
        words = bitmask.shape[1]
    if raw_logits is not None:
        if raw_logits.shape != logits.shape or raw_logits.dtype != torch.float32:
            raise ValueError(f"raw_logits must be float32 {tuple(logits.shape)}, got {raw_logits.dtype} "
                             f"{tuple(raw_logits.shape)}")
        raw_logits = raw_logits.contiguous()
    tokens = torch.empty(b, dtype=torch.int64)
    logprobs = torch.empty(b, dtype=torch.float32) if raw_logits is not None else None
    if b:
        lib.minfer_sample_f32(logits.data_ptr(), _ptr(raw_logits), _ptr(bitmask), words, b, v,
                              args["temperature"].data_ptr(), args["top_k"].data_ptr(), args["top_p"].data_ptr(),
                              args["min_p"].data_ptr(), args["uniform"].data_ptr(), tokens.data_ptr(),
                              _ptr(logprobs), torch.get_num_threads())
    return tokens, logprobs


class CpuFusedSampler(Sampler):
    """`minfer.sampling.Sampler` with the draw (and the chosen token's logprob) done by `fused_sample_cpu`.

    Same inputs and outputs as `Sampler.__call__`. Penalties, logit_bias and min_tokens are still applied
    by `apply_logits_processors` first (they need the token history); the bitmask goes into the kernel.
    Each row's uniform comes from its request's seeded stream, or for unseeded rows from the engine's
    generator (one draw of B numbers a step). Rows that ask for top logprobs get them from torch's
    log_softmax, as the base class does; the chosen token's logprob comes from the kernel.
    """

    def __call__(self, logits: torch.Tensor, seqs, bitmask: torch.Tensor | None = None):
        params = [s.params for s in seqs]
        # An all-greedy batch is one argmax in torch already: nothing to fuse.
        if logits.device.type != "cpu" or logits.dtype != torch.float32 or all(p.greedy for p in params):
            return super().__call__(logits, seqs, bitmask)
        b = logits.shape[0]
        raw = logits
        if any(p.needs_logits_processing for p in params):
            logits = apply_logits_processors(logits, seqs)
        greedy = [p.greedy for p in params]
        uniform = torch.zeros(b)  # some row samples (an all-greedy batch returned above)
        gens = [self.generator_for(s, "cpu") for s in seqs]
        unseeded = [i for i, (g, gr) in enumerate(zip(gens, greedy)) if g is None and not gr]
        if unseeded:
            uniform[unseeded] = torch.rand(len(unseeded), generator=self.generator)
        for i, g in enumerate(gens):
            if g is not None:
                uniform[i] = torch.rand(1, generator=g)
        vocab = logits.shape[1]
        want_lp = [p.logprobs for p in params]
        tokens, chosen = fused_sample_cpu(
            logits,
            torch.tensor([0.0 if g else p.temperature for g, p in zip(greedy, params)]),
            torch.tensor([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params]),
            torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params]), uniform,
            bitmask, raw if any(k is not None for k in want_lp) else None)
        if chosen is None:
            return tokens, None, None
        return tokens, chosen, self.top_logprobs(raw, tokens, chosen, want_lp)
