"""The fused sampler (article §4 kernel fusion, §7 sampling): `minfer.sampling.Sampler` drawing with the
one-pass Gumbel-max kernel `fused_sample` where a batch allows it."""

from __future__ import annotations

import torch

from minfer.kernels.fused import fused_sample
from minfer.sampling import Sampler


class TritonSampler(Sampler):
    """`Sampler` that draws with `fused_sample` (one Gumbel-max kernel, top-k/top-p as a torch pre-pass).

    The kernel path is taken only for batches where no row wants logprobs, min_p, penalties, logit_bias or
    min_tokens and no row has its own
    seed (a seeded request must keep the torch Sampler's stream to stay reproducible across backends and
    batches). All-greedy batches stay an exact argmax; greedy rows of a mixed batch get temperature 0,
    which the kernel turns into an exact argmax too. Random draws come from the engine generator (one seed
    per row for the kernel's Philox), so a run is reproducible for a given engine seed.
    """

    def __call__(self, logits: torch.Tensor, seqs, bitmask: torch.Tensor | None = None):
        params = [s.params for s in seqs]
        if bitmask is not None or all(p.greedy for p in params) or any(
                p.logprobs is not None or p.min_p > 0 or p.seed is not None or p.needs_logits_processing
                for p in params):
            return super().__call__(logits, seqs, bitmask)
        dev = logits.device
        temp = torch.tensor([0.0 if p.greedy else float(p.temperature) for p in params], device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
        top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=dev)
        tokens = fused_sample(logits, temp, top_k, top_p, generator=self.generator)
        return tokens, None, None
