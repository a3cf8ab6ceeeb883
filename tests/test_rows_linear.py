"""decoding/runtime/rows_linear.py: the row-invariant bfloat16 kernel gives each row the same bits in any
batch and the float product within bfloat16 rounding; model.linear chooses it (auto: CPUs without
AVX-512); decoders on a model of either kernel return `hf`'s tokens, greedy and sampled."""

from __future__ import annotations

import pytest
import torch
from helpers import with_linear_kernel
from test_decoders import PROMPTS

from decoding.api.engine import Engine
from decoding.base.errors import BackendError
from decoding.base.values import GenRequest
from decoding.runtime import kernels
from decoding.runtime.llama import Layers
from decoding.runtime.models import ModelSpec
from decoding.runtime.quant import kernel_fits
from decoding.runtime.rows_linear import RowsLinear, resolve_linear, use_rows_kernel


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).to(torch.bfloat16), torch.randn(n, generator=g).to(torch.bfloat16)


def test_a_row_gets_the_same_bits_in_any_batch():
    """37 outputs (not a whole number of the kernel's 4-column blocks), 13 rows (tiles of 4 and a
    remainder): every row alone, and inside every window of rows, gives the full batch's bits."""
    w, b = _weights(37, 80)
    x = torch.randn(13, 80).to(torch.bfloat16)
    full = kernels.load().rows_linear(x, w, b)
    for start in range(13):
        for size in (1, 2, 3, 4, 5, 9):
            part = kernels.load().rows_linear(x[start : start + size], w, b)
            assert torch.equal(part, full[start : start + size])
    assert not torch.equal(full[0], full[1])  # the rows do differ


def test_threads_do_not_change_the_bits():
    w, b = _weights(64, 96, seed=1)
    x = torch.randn(6, 96).to(torch.bfloat16)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(kernels.load().rows_linear(x, w, b))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_the_kernel_computes_the_linear_within_bfloat16_rounding():
    w, b = _weights(50, 64, seed=2)
    x = torch.randn(3, 2, 64).to(torch.bfloat16)
    got = kernels.load().rows_linear(x, w, b)
    want = x.double() @ w.double().T + b.double()
    assert got.shape == (3, 2, 50) and got.dtype == torch.bfloat16
    # one rounding to bfloat16 (8 significant bits) after a float32 sum of 64 products
    assert torch.allclose(got.double(), want, rtol=2**-7, atol=1e-3)
    wrong = kernels.load().rows_linear(x, w, torch.zeros_like(b))
    assert not torch.allclose(wrong.double(), want, rtol=2**-7, atol=1e-3)  # the bias counts


def test_rows_linear_trains_through_the_plain_path():
    layer = torch.nn.Linear(32, 8).to(torch.bfloat16)
    layer.__class__ = RowsLinear
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_use_rows_kernel_converts_bfloat16_layers_in_place(tiny_model):
    model = with_linear_kernel(tiny_model, "aten")
    head = model.lm_head.weight
    n = use_rows_kernel(model)
    assert n == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) > 0
    assert type(model.lm_head) is RowsLinear and model.lm_head.weight is head
    assert Layers.of(model).rows
    odd = torch.nn.Linear(24, 8).to(torch.bfloat16)  # 24 input features: not in the kernel's 16 lanes
    assert use_rows_kernel(odd) == 0 and type(odd) is torch.nn.Linear
    assert use_rows_kernel(with_linear_kernel(tiny_model, "aten").float()) == 0  # float32 layers stay
    assert kernel_fits(model.model.layers[0].mlp.up_proj)  # a GGUF file's int4 layers can still replace it


def test_model_linear_is_resolved_per_device(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert resolve_linear("auto", cpu) == "rows"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert resolve_linear("auto", cpu) == "aten"
    assert resolve_linear("auto", gpu) == "aten" and resolve_linear("rows", cpu) == "rows"
    with pytest.raises(BackendError, match=r"model.linear=rows is CPU code"):
        resolve_linear("rows", gpu)
    with pytest.raises(BackendError, match=r"model.linear='fast' is not one of auto, aten, rows"):
        ModelSpec(linear="fast")


@pytest.mark.parametrize("kind", ["aten", "rows"])
def test_decoders_return_hfs_tokens_on_either_kernel(kind, tiny_model, tokenizer, loaded):
    """Greedy and sampled, several rows at once: every decoder's tokens are `hf`'s on the same model."""
    model = with_linear_kernel(tiny_model, kind)
    assert Layers.of(model).rows == (kind == "rows")
    same = type(loaded)(model, tokenizer, loaded.device, False, f"tiny-{kind}")
    requests = [GenRequest(p, max_new_tokens=12) for p in PROMPTS]
    requests += [GenRequest(p, max_new_tokens=12, temperature=0.9, seed=i) for i, p in enumerate(PROMPTS)]
    want = [r.token_ids for r in Engine(same, "hf").generate(requests)]
    for decoder in ("ar", "seed_stand", "stand", "recycling"):
        assert [r.token_ids for r in Engine(same, decoder).generate(requests)] == want, decoder
