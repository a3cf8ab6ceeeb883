"""RMSNorm in one pass per row (csrc/norm.cpp) for the CPU forward.

`transformers`' LlamaRMSNorm (Qwen2's is the same) runs eight ATen ops per call (a float copy, square,
mean, add, rsqrt, multiply, a bfloat16 copy, the weight), 61 calls per forward of the embedded
model: at one token their dispatch and buffers cost more than their arithmetic. `RowsRMSNorm` replaces the model's own
modules, so the model's forward (what `hf` runs) and csrc/layers.cpp run the same kernel: one set of
bits for every decoder. Each row is normalized alone, in a fixed order (batch-invariant).
"""

from __future__ import annotations

import torch

from decoding.runtime import kernels
from decoding.runtime.architectures import rms_norms


class RowsRMSNorm(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), in x's type, on csrc/norm.cpp."""

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = kernels.load().rms_norm_rows(x, self.weight, self.variance_epsilon)
        return y

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, one pass per row"


def use_rows_norm(model: torch.nn.Module) -> int:
    """Replace the model's RMSNorms (bfloat16 or float32 weights) by `RowsRMSNorm`; how many."""
    kernels.load()  # built now: a missing compiler is a load-time error
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module) in rms_norms() and module.weight.dtype in (torch.bfloat16, torch.float32):
            parent, _, child = name.rpartition(".")
            norm = RowsRMSNorm(module.weight, module.variance_epsilon)
            setattr(model.get_submodule(parent) if parent else model, child, norm)
            replaced += 1
    return replaced
