"""GPTQ (Frantar, Ashkboos, Hoefler, Alistarh 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", arXiv:2210.17323), written for minfer.

A layer's output error for inputs X `[n, in]` (calibration activations) is ||W X^T - W_hat X^T||^2, a
quadratic in each row of W with the same Hessian for every row:

    H = 2/n sum_t x_t x_t^T                                    `[in, in]`, `hessian` accumulates it

Quantizing the columns one at a time, in order, and moving each column's rounding error onto the columns
not yet quantized (the Optimal Brain Surgeon update restricted to them) keeps the error down:

    for column j:  q_j = quant(w_j)        e = (w_j - q_j) / [H^-1]_jj        w_{j+1:} -= e [H^-1]_{j, j+1:}

where H^-1 is the inverse Hessian *of the columns still unquantized*. The paper's three tricks, all here:

1. Dampening: H + lambda I with lambda = `percdamp` x mean(diag H) (1%), so the Cholesky below exists and
   the updates stay small. Inputs that are always 0 (diag 0) get H_jj = 1 and weight 0.
2. Cholesky: the rows [H^-1]_{j, j:} of all those shrinking inverses are the rows of the upper Cholesky
   factor U of H^-1 (H^-1 = U^T U), computed once; `e` divides by U_jj.
3. Lazy batch updates: the error is pushed inside a block of `blocksize` columns at once per column, and
   onto the columns after the block once per block (one matmul), so most of the work is a few large
   matmuls instead of `in` rank-1 updates of the whole matrix.

Group-wise parameters (the paper's §"Additional tricks"): the scale and zero point of a group of G columns
are the min-max ones of the group's weights *as updated so far*, computed when the loop reaches its first
column. Blocks are whole groups, so those weights are current. The column loop is Python by nature (each
column needs the previous one's error); it runs once per layer at calibration time, never when serving.

Act-order (`desc_act=True`, the paper's reference code and AutoGPTQ): the columns are quantized in order of
decreasing H_jj, so the inputs with the largest activations are rounded first, while the most columns are
left to absorb their error. W and H are permuted by that order `perm`, quantized as above, and the codes
permuted back; the groups are then G consecutive columns *in quantization order*, so column i belongs to
group `g_idx[i] = inv_perm[i] // G`, which AutoGPTQ saves as `g_idx` (non-monotonic).
"""

from __future__ import annotations

import torch

from minfer.quantization.formats import affine_params


def hessian(x: torch.Tensor) -> torch.Tensor:
    """X^T X of inputs `x [n, in]` in float64 (summed; `gptq_quantize` is invariant to its scale)."""
    x = x.reshape(-1, x.shape[-1]).double()
    return x.t() @ x


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, bits: int = 4, blocksize: int = 128,
                  percdamp: float = 0.01, zp_min: int = 1, desc_act: bool = False, return_g_idx: bool = False):
    """GPTQ of one weight (module docstring).

    Args:
        w: `[out, in]` float weight. h: `[in, in]` Hessian (`hessian` of the layer's calibration inputs).
        group_size: G, dividing `in`. bits: code bits. blocksize: columns per lazy block (rounded up to a
            multiple of G). percdamp: the dampening fraction. zp_min: smallest zero point (1 for GPTQ v1).
        desc_act: act-order (module docstring). return_g_idx: also return g_idx.

    Returns:
        (codes int32 [out, in], scale float32 [out, in/G], zp int32 [out, in/G]), with
        w[:, i] ~ (q[:, i] - zp[:, g_idx[i]]) s[:, g_idx[i]]; and, if `return_g_idx`, g_idx int32 [in]
        (i // G without act-order).

    Raises:
        ValueError: G does not divide `in`, or the shapes disagree.
        torch.linalg.LinAlgError: H + damp is not positive definite (raise `percdamp`).
    """
    out, k = w.shape
    if k % group_size or h.shape != (k, k):
        raise ValueError(f"gptq: weight {tuple(w.shape)}, Hessian {tuple(h.shape)}, group_size {group_size}")
    # The column loop is thousands of small ops: with more than one CPU thread each pays a thread barrier,
    # which on a busy machine costs far more than the arithmetic. So it runs on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gptq(w, h, group_size, bits, blocksize, percdamp, zp_min, desc_act, return_g_idx)
    finally:
        torch.set_num_threads(threads)


def _gptq(w, h, group_size, bits, blocksize, percdamp, zp_min, desc_act, return_g_idx):
    out, k = w.shape
    qmax = 2 ** bits - 1
    W = w.double().clone()
    H = h.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += percdamp * torch.diag(H).mean() * torch.eye(k, dtype=H.dtype)
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if desc_act else None
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    codes = torch.zeros(out, k, dtype=torch.int32)
    scales = torch.zeros(out, k // group_size)
    zps = torch.zeros(out, k // group_size, dtype=torch.int32)
    blocksize = -(-max(blocksize, group_size) // group_size) * group_size
    for b0 in range(0, k, blocksize):
        b1 = min(b0 + blocksize, k)
        W1, U1 = W[:, b0:b1].clone(), U[b0:b1, b0:b1]
        E1 = torch.zeros_like(W1)
        for i in range(b1 - b0):
            j = b0 + i
            if j % group_size == 0:
                s, zp = affine_params(W1[:, i:i + group_size].float(), bits, zp_min)
                scales[:, j // group_size], zps[:, j // group_size] = s, zp
                s, zp = s.double(), zp.double()
            col = W1[:, i]
            q = (torch.round(col / s) + zp).clamp(0, qmax)
            codes[:, j] = q.to(torch.int32)
            e = (col - (q - zp) * s) / U1[i, i]
            W1[:, i:] -= e[:, None] * U1[i, i:][None, :]
            E1[:, i] = e
        W[:, b1:] -= E1 @ U[b0:b1, b1:]  # the lazy update of every column after the block
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    if perm is not None:  # back to the weight's own column order
        inv = torch.argsort(perm)
        codes, g_idx = codes[:, inv].contiguous(), g_idx[inv].contiguous()
    return (codes, scales, zps, g_idx) if return_g_idx else (codes, scales, zps)
