"""The feed-forward of GPT-2 and BLOOM (two matrices and a GELU) and the activations of Hugging Face configs
(Gemma 3's gated GELU reads them too). The Llama family's SwiGLU `MLP` is in `minfer/model/layers.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minfer.model.layers import BuildOptions, Linear

# Activation names of HF configs -> functions (GPT-2's "gelu_new" and BLOOM's GELU are the tanh approximation).
ACTIVATIONS = {
    "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu, "silu": F.silu,
}


def activation(name: str, source: str = "config") -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of an HF activation name. Raises ValueError for one minfer does not implement."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{source}: activation {name!r} is not supported; minfer implements {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GeluMLP(nn.Module):
    """The two-matrix feed-forward of GPT-2 and BLOOM: down(act(up(x) + b) ) + b, act usually tanh-GELU.

    `up`/`down` are the module names given (GPT-2: c_fc/c_proj; BLOOM: dense_h_to_4h/dense_4h_to_h), so the
    parameter names stay the checkpoint's."""

    def __init__(self, hidden: int, intermediate_size: int, act: str, names: tuple[str, str],
                 build: BuildOptions | None = None):
        super().__init__()
        build = build or BuildOptions()
        self.names = names
        setattr(self, names[0], Linear(hidden, intermediate_size, bias=True, method=build.linear_method))
        setattr(self, names[1], Linear(intermediate_size, hidden, bias=True, method=build.linear_method))
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = getattr(self, self.names[0]), getattr(self, self.names[1])
        return down(self.act(up(x)))
