"""AWQ (Lin, Tang, Tang, Yang, Dang, Gan, Han 2023, "AWQ: Activation-aware Weight Quantization for LLM
Compression and Acceleration", arXiv:2306.00978), written for minfer.

A few input channels carry much larger activations than the rest; their weights matter more. Scaling
weight column j up by s_j before quantizing (and its input down by s_j) shrinks its relative rounding
error, and the product is unchanged in exact arithmetic:

    W x = (W diag(s)) (diag(s)^-1 x)          quantize W diag(s), fold diag(s)^-1 into the op before

The op before is what produces x: an RMSNorm's weight (q|k|v after `input_layernorm`, gate|up after
`post_attention_layernorm`), v's rows (o_proj reads the attention output, a mix of v's channels), up's rows
(down_proj reads silu(gate) * up, linear in up). The scale is s = mean|x|^alpha, normalised by
sqrt(max s min s), and alpha in {0, 1/n_grid, ..., (n_grid-1)/n_grid} is chosen per group of layers that
share the input by the smallest output error

    L(alpha) = || Q(W diag(s)) diag(s)^-1 X^T - W X^T ||^2   over calibration rows X          (`search_scale`)

with Q the group-wise min-max INT4 of the saved format (`minfer.quantization.formats`). The loss is
measured on the group's own linear outputs (AutoAWQ measures q|k|v and gate|up through the whole attention
block and MLP; minfer takes the linear outputs, the simpler choice: one matmul per grid point).

Then the clipping search (`search_clip`): per output row and group, the largest |w| allowed is max|w| x r
for r in {1, 0.95, ..., 0.55}, chosen by the smallest error of that group's share of the output
(W_g - Q(clip(W_g))) x_g. It is skipped for q and k (as in AWQ's code: their error shows in the attention
scores, which a linear-output loss does not see).
"""

from __future__ import annotations

import torch


def fake_quantize(w: torch.Tensor, group_size: int, bits: int = 4) -> torch.Tensor:
    """Min-max group-wise quantize-dequantize of `w [out, in]`, float32: the saved format's rounding
    (`formats.affine_params` + `quantize_affine`, scale rounded to float16), in float ops only, since the
    searches call it hundreds of times per layer."""
    out, k = w.shape
    qmax = 2 ** bits - 1
    wg = w.reshape(out, k // group_size, group_size)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s = ((hi - lo) / qmax).clamp_min_(1e-5).half().float()
    zp = torch.round(-lo / s).clamp_(0, qmax)
    q = torch.round(wg / s).add_(zp).clamp_(0, qmax)
    return q.sub_(zp).mul_(s).reshape(out, k)


def scales_for(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = x_mean^alpha / sqrt(max * min) (AWQ's normalisation keeps s around 1)."""
    s = x_mean.clamp_min(1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_scale(x: torch.Tensor, w: torch.Tensor, group_size: int, x_mean: torch.Tensor | None = None,
                 expand: torch.Tensor | None = None, n_grid: int = 20) -> tuple[torch.Tensor, list[float]]:
    """AWQ's grid search of the scale exponent for one group of linears sharing their input.

    Args:
        x: calibration rows `[n, in]` (float32). w: the group's weights concatenated by rows `[out, in]`.
        x_mean: mean |x| per channel of the op before, `[c]` (default: of `x`, with c = in).
        expand: int64 `[in]`, for each input channel the index of its scale in `[c]` (o_proj under GQA: several
            query heads read one v head, so they share its scale); default the identity.
        n_grid: alphas 0, 1/n_grid, ..., (n_grid - 1)/n_grid.

    Returns:
        (best s `[c]`, the loss per alpha), the loss a mean squared output error.
    """
    x_mean = x.abs().mean(0) if x_mean is None else x_mean
    expand = torch.arange(w.shape[1]) if expand is None else expand
    ref = x @ w.t()
    losses, best, best_s = [], float("inf"), None
    for i in range(n_grid):
        s = scales_for(x_mean, i / n_grid)
        se = s[expand]
        wq = fake_quantize(w * se, group_size) / se
        loss = float(((x @ wq.t() - ref) ** 2).mean())
        losses.append(loss)
        if loss < best:
            best, best_s = loss, s
    return best_s, losses


@torch.no_grad()
def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int, n_grid: int = 20, max_shrink: float = 0.5,
                rows_per_chunk: int = 256) -> torch.Tensor:
    """AWQ's weight-clipping search: `w [out, in]` clipped per (row, group) to the best max|w| x r.

    `x [n, in]` are calibration rows (n of a few hundred is what the method needs). Returns the clipped
    float32 weight; its quantization is then min-max as usual."""
    out, k = w.shape
    ng = k // group_size
    xg = x.reshape(-1, ng, group_size).permute(1, 2, 0).contiguous()  # [ng, G, n]
    result = torch.empty_like(w)
    for r0 in range(0, out, rows_per_chunk):  # chunks of rows bound the [rows, ng, n] error tensors
        wg = w[r0:r0 + rows_per_chunk].reshape(-1, ng, group_size)  # [o, ng, G]
        amax = wg.abs().amax(-1, keepdim=True)
        best_err = torch.full(wg.shape[:2], float("inf"))
        best_max = amax.clone()
        for i in range(int(max_shrink * n_grid)):
            mx = amax * (1 - i / n_grid)
            wc = wg.clamp(-mx, mx)
            wq = fake_quantize(wc.reshape(wg.shape[0], k), group_size).reshape_as(wg)
            err = torch.bmm((wq - wg).transpose(0, 1), xg).pow_(2).mean(-1).t()  # [ng, o, n] -> [o, ng]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better[..., None], mx, best_max)
        result[r0:r0 + rows_per_chunk] = wg.clamp(-best_max, best_max).reshape(-1, k)
    return result
