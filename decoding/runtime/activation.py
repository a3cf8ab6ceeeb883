"""SiLU with a fixed exp (csrc/activation.cpp) for the int8 path's float32 model.

ATen's SiLU computes a vector's lanes with one exp and the loop's tail with another, so an
element's bits depend on where the tail falls: csrc/layers.cpp had to copy gate and up out of their
joined product (four ops a layer) for its SiLU to split as the model's did. `FixedSiLU` replaces the
model's own `act_fn`, so the model's forward (what `hf` runs) and the C++ layers compute every
element alike, and the C++ layers read gate and up in place and multiply in the same pass.
"""

from __future__ import annotations

import torch

from decoding.runtime import kernels
from decoding.runtime.architectures import mlps
from decoding.runtime.pretrained import pretrained


class FixedSiLU(torch.nn.Module):
    """x / (1 + exp(-x)) in float32, exp a fixed polynomial (Cephes expf's): within 4e-7 of the exact
    value (torch's SiLU: 2.6e-7)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"FixedSiLU computes float32, not {x.dtype}: give the model torch's SiLU (use_torch_silu)")
        y: torch.Tensor = kernels.load().silu_fixed(x)
        return y


def use_fixed_silu(model: torch.nn.Module) -> int:
    """Give the MLPs (of an architectures.ARCHITECTURES entry) of a float32 SiLU model `FixedSiLU`; how many."""
    embeddings = pretrained(model).get_input_embeddings()
    if getattr(model.config, "hidden_act", None) != "silu" or embeddings.weight.dtype != torch.float32:
        return 0
    kernels.load()  # built now: a missing compiler is a load-time error
    replaced = 0
    for module in model.modules():
        if type(module) in mlps():
            module.act_fn = FixedSiLU()
            replaced += 1
    return replaced


def use_torch_silu(model: torch.nn.Module) -> int:
    """Give the model's MLPs torch's SiLU back (before the model leaves float32); how many."""
    replaced = 0
    for module in model.modules():
        if type(module) in mlps() and type(module.act_fn) is FixedSiLU:
            from transformers.activations import ACT2FN  # on first use: importing transformers' utils costs seconds

            module.act_fn = ACT2FN["silu"]
            replaced += 1
    return replaced
