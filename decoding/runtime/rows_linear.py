"""bfloat16 linear layers through the project's row-invariant kernel (csrc/matmul.cpp), chosen where
oneDNN's bfloat16 linear costs about as much per extra row as for the first row: CPUs without
AVX-512 (no bfloat16 instructions), where a verification forward's cost grew with its tokens.

Measured on a 2-core AMD EPYC without AVX-512 (torch 2.13.0, the embedded model's LM head, 49152 x
576, bfloat16): 1 row 3.7 ms with oneDNN, 2.9 ms here; 4 rows 11.6 / 4.2; 16 rows 47 / 12.5; 64 rows
184 / 47. The kernel reads the weights once for all rows; each output is one dot product in a fixed
order, so a row gets the same bits in any batch (what the batch-invariant forward rests on). `hf`
runs the same modules, so it stays every decoder's reference whichever kernel is chosen.
"""

from __future__ import annotations

import torch

from decoding.base.errors import BackendError
from decoding.runtime import kernels
from decoding.runtime.spec import LINEARS

# model.linear: auto = rows on a CPU without AVX-512, aten elsewhere; aten = torch's own kernels.
CHOICES = LINEARS  # model.linear (decoding/runtime/spec.py)
LANES = 16  # the kernel's dot products run in 16 float lanes: in_features must be a multiple
_NONE = torch.empty(0)


class RowsLinear(torch.nn.Linear):
    """An `nn.Linear` whose CPU inference calls run the row-invariant kernel (training and other
    devices take the plain path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu" or not fits(self):
            return super().forward(x)
        y: torch.Tensor = kernels.load().rows_linear(x, self.weight, _NONE if self.bias is None else self.bias)
        return y


def fits(module: torch.nn.Module) -> bool:
    """Whether the kernel can run this layer: a contiguous bfloat16 CPU weight, in_features in lanes."""
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and fits_shape(w)


def fits_shape(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and w.is_contiguous() and w.shape[-1] % LANES == 0


def resolve_linear(choice: str, device: torch.device, key: str = "model") -> str:
    """auto: rows on a CPU whose torch kernels lack AVX-512, aten elsewhere."""
    if choice == "auto":
        fast = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        return "rows" if device.type == "cpu" and not fast else "aten"
    if choice == "rows" and device.type != "cpu":
        raise BackendError(f"{key}.linear=rows is CPU code; on {device} use {key}.linear=aten")
    return choice


@torch.no_grad()
def use_rows_kernel(model: torch.nn.Module) -> int:
    """Give every bfloat16 `nn.Linear` the kernel can run the `RowsLinear` forward, in place (modules,
    parameters and tied weights stay); returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and fits(module):
            module.__class__ = RowsLinear
            n += 1
    if n:
        kernels.load()  # build it now: a missing compiler is a load-time error
    return n


@torch.no_grad()
def dense_in_bfloat16(model: torch.nn.Module) -> int:
    """With int8 activations the model runs in float32 (quant.INT8_HIDDEN); its linear layers that are
    neither 4-bit nor Q8_0 (a GGUF's Q6_K or F16 tensors) keep the bfloat16 weights the float path
    has, on this kernel, which takes float32 rows and returns float32 (a row's bits alone, as ever).
    A weight tied to the embedding gets its own copy: the embedding stays float32. Returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32 and fits_shape(module.weight):
            w = module.weight
            module.weight = torch.nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False)
            module.__class__ = RowsLinear
            n += 1
    if n:
        kernels.load()
    return n
