"""RMSNorm in one pass per row (decoding/runtime/norm.py, csrc/norm.cpp): what LlamaRMSNorm computes, up
to the rounding of the result, row-invariant, installed by the CPU load path (tests/test_llama.py
shows the C++ layers run it with the model's own bits)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from decoding.runtime.llama import Layers
from decoding.runtime.norm import RowsRMSNorm, use_rows_norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_it_computes_llamas_norm_up_to_the_results_rounding(dtype):
    """Against float64: bfloat16 within two units in its last place (the kernel rounds x * r, then
    the product with the weight, as LlamaRMSNorm does), float32 within 1e-5 (the float sum of 576
    squares); beside LlamaRMSNorm itself within twice that (its own sum and rounding)."""
    torch.manual_seed(0)
    x = (torch.randn(37, 576) * torch.logspace(-2, 1, 37)[:, None]).to(dtype)
    weight = torch.nn.Parameter(torch.randn(576).to(dtype), requires_grad=False)
    y = RowsRMSNorm(weight, 1e-5)(x)
    xd = x.double()
    expected = weight.double() * xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    tolerance = 2 * 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    assert ((y.double() - expected).abs() <= tolerance * expected.abs()).all()
    llama = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    llama.weight = weight
    assert ((y.double() - llama(x).double()).abs() <= 2 * tolerance * expected.abs()).all()
    assert y.dtype == dtype and y.shape == x.shape


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    torch.manual_seed(1)
    x = torch.randn(3, 50, 200).to(torch.bfloat16)  # 200: a tail past the 8 lanes' whole groups
    norm = RowsRMSNorm(torch.nn.Parameter(torch.randn(200).to(torch.bfloat16), requires_grad=False), 1e-6)
    every = norm(x)
    assert torch.equal(norm(x[1, 7:8]), every[1, 7:8])
    assert torch.equal(norm(x[:, :3]), every[:, :3])
    assert torch.equal(norm(x.transpose(0, 1)).transpose(0, 1), every)  # a strided input


def test_the_cpu_load_path_installs_it(tiny_model):
    norms = [m for m in tiny_model.modules() if isinstance(m, (LlamaRMSNorm, RowsRMSNorm))]
    assert norms and all(type(m) is RowsRMSNorm for m in norms)  # 2 per layer and the final one
    assert len(norms) == 2 * tiny_model.config.num_hidden_layers + 1
    assert use_rows_norm(tiny_model) == 0  # nothing left to replace
    assert Layers.of(tiny_model).rows_norm  # the C++ layers run it too, not transformers' ops
