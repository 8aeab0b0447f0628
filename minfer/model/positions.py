"""Positional encoding (article §2): RoPE with its context-extension scalings, and ALiBi slopes.

RoPE (Su et al., 2021, arXiv:2104.09864) rotates each (x_i, x_{i+d/2}) pair of a query/key by an angle
`position * inv_freq[i]`, so q·k depends only on the distance between positions. The scalings stretch the
trained length by changing `inv_freq` (and, for YaRN, the magnitude of cos/sin):

- linear (position interpolation, Chen et al. 2023): inv_freq / factor.
- dynamic NTK (bloc97 / HF): raise the base when the sequence grows past the trained length.
- YaRN (Peng et al. 2023, arXiv:2309.00071): interpolate low frequencies, keep high ones, ramp between;
  scale cos/sin by an attention factor.
- llama3 (Meta, Llama 3.1): like YaRN's ramp, keyed on wavelength bands.

The formulas follow Hugging Face's `modeling_rope_utils.py` so that logits match transformers exactly.

ALiBi (Press et al., 2021, arXiv:2108.12409) adds `-slope_h * distance` to attention scores instead.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from minfer.model.layers import FusedOps


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim // 2]` (float32) and the cos/sin magnitude factor.

    Args:
        head_dim: rotary dimension. theta: RoPE base. scaling: HF rope dict with `rope_type`, or None.
        max_position_embeddings: the config's value. seq_len: current length (dynamic NTK only).

    Raises:
        ValueError: an unknown `rope_type`.
    """
    rope_type = (scaling or {}).get("rope_type", "default")
    dim = int(head_dim * (scaling or {}).get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        return _base_inv_freq(theta, dim), 1.0
    factor = scaling.get("factor")
    if rope_type == "linear":
        return _base_inv_freq(theta, dim) / factor, 1.0
    if rope_type == "dynamic":
        seq_len = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "llama3":
        inv_freq = _base_inv_freq(theta, dim)
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling.get("original_max_position_embeddings", max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (beyond the trained context) are interpolated, short ones kept, a ramp between.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        orig = scaling.get("original_max_position_embeddings", max_position_embeddings)
        if factor is None:
            factor = max_position_embeddings / orig

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn_factor = scaling.get("attention_factor")
        if attn_factor is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attn_factor = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def correction_dim(rotations):
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
        extrapolation = 1 - ramp  # 1 where frequencies are kept as trained
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv_freq, float(attn_factor)
    raise ValueError(f"unknown rope_type {rope_type!r}; minfer supports default, linear, dynamic, yarn, llama3")


def rotate_half_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE in the rotate-half layout (HF Llama): x `[T, heads, D]`, cos/sin `[T, D/2]`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE for the positions of one forward pass.

    cos/sin are tabulated once up to `max_positions` (float32), so a decode step only gathers rows.
    Dynamic NTK recomputes frequencies from the largest position in the forward, as transformers does.
    `fused` (a `minfer.model.layers.FusedOps`: the Triton kernels or the CPU wing's C++ loops) rotates q and k
    in place with its `apply_rotary_` (the same contract).
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int,
                 max_positions: int, fused: "FusedOps | None" = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.max_position_embeddings = max_position_embeddings
        self.dynamic = (scaling or {}).get("rope_type") == "dynamic"
        self.fused = fused is not None
        if fused is not None:
            self._apply_rotary_ = fused.apply_rotary_
        inv_freq, self.attention_scaling = compute_inv_freq(head_dim, theta, scaling, max_position_embeddings)
        # float32 whatever the model's dtype: the loader builds the model under its dtype as the default.
        self.register_buffer("cos_sin", self._table(inv_freq, max_positions), persistent=False)

    def _table(self, inv_freq: torch.Tensor, n: int) -> torch.Tensor:
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
        return torch.stack((freqs.cos(), freqs.sin())) * self.attention_scaling  # [2, n, D/2]

    def cos_sin_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, D/2]` float32 for int64 `positions [T]`."""
        if self.dynamic:
            longest = int(positions.max()) + 1
            if longest > self.max_position_embeddings:
                inv_freq, _ = compute_inv_freq(self.head_dim, self.theta, self.scaling,
                                               self.max_position_embeddings, seq_len=longest)
                table = self._table(inv_freq.to(positions.device), longest)
                return table[0][positions], table[1][positions]
        # Checked on the host, except inside a CUDA-graph capture (a host read is an error there; the captured
        # decode step's positions come from the scheduler, below max_model_len, which sized this table).
        capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
        if positions.numel() and not capturing and int(positions.max()) >= self.cos_sin.shape[1]:
            raise ValueError(f"position {int(positions.max())} beyond the RoPE table ({self.cos_sin.shape[1]})")
        return self.cos_sin[0][positions], self.cos_sin[1][positions]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q `[T, H, D]` and k `[T, KVH, D]`; returns new tensors in q's dtype.

        `cos_sin`: this forward's `cos_sin_for(positions)`, computed once by the model for all its layers.
        """
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin_for(positions)
        if (self.fused and cos.shape[-1] * 2 == q.shape[-1] and q.stride(-1) == 1 and k.stride(-1) == 1
                and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
            # In place: q and k are fresh views of this layer's qkv projection, read by nothing else.
            return self._apply_rotary_(q, k, cos.contiguous(), sin.contiguous())
        return (rotate_half_(q.float(), cos, sin).to(q.dtype), rotate_half_(k.float(), cos, sin).to(k.dtype))


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes `[num_heads]` float32: a geometric sequence 2^(-8/n), 2^(-16/n), ... (Press et al.),
    with the paper's interleaving when num_heads is not a power of two."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** (i + 1) for i in range(0, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)
