"""SiLU with a fixed exp (decoding/runtime/activation.py, csrc/activation.cpp): torch's SiLU up to a few
units in the last place, every element's bits the same wherever it falls, installed on the int8
path's float32 model and read in place by the C++ layers (tests/test_llama.py: bitwise `hf`)."""

from __future__ import annotations

import pytest
import torch
from test_quant import int4_copy

from decoding.activation_error import float32_reference, float_activations
from decoding.runtime import kernels
from decoding.runtime.activation import FixedSiLU, use_fixed_silu
from decoding.runtime.llama import Layers


def test_it_computes_silu_within_a_few_ulp_over_the_whole_range():
    """Against float64 over [-100, 100] and the extremes: relative error below 4e-7 (the polynomial's
    and the division's roundings; torch's own reaches 2.6e-7), 0 below exp's range (-87, where SiLU is
    below 1e-35), x itself far above it, no NaN."""
    extremes = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 1e4, -1e4])
    x = torch.cat([torch.linspace(-100, 100, 200_001), extremes])
    y = FixedSiLU()(x)
    expected = torch.nn.functional.silu(x.double())
    assert not y.isnan().any()
    err = (y.double() - expected).abs()
    assert (err <= 4e-7 * expected.abs() + 1e-35).all(), float((err / expected.abs().clamp_min(1e-30)).max())
    assert (err[x.abs() < 80] <= 4e-7 * expected[x.abs() < 80].abs()).all()
    assert (y[x < -87.5] == 0).all() and torch.equal(y[x > 90], x[x > 90])


def test_an_elements_bits_do_not_depend_on_where_it_falls():
    """Vector lanes and loop tails compute alike: any slice of a tensor gets the whole tensor's bits,
    and silu_mul on strided halves of a joined product gives FixedSiLU(gate) * up."""
    k = kernels.load()
    x = torch.randn(7, 2 * 1000) * 6
    whole = k.silu_fixed(x)
    for start, n in ((0, 1), (3, 5), (1, 17), (13, 999), (5, 13_000)):
        assert torch.equal(k.silu_fixed(x.view(-1)[start : start + n]), whole.view(-1)[start : start + n])
    gate, up = x[:, :1000], x[:, 1000:]
    assert torch.equal(k.silu_mul(gate, up), FixedSiLU()(gate.contiguous()) * up.contiguous())


def test_the_int8_paths_model_gets_it_and_the_cpp_layers_read_it(tiny_model):
    model = int4_copy(tiny_model, "int8")
    assert use_fixed_silu(model) == len(model.model.layers)
    assert all(type(layer.mlp.act_fn) is FixedSiLU for layer in model.model.layers)
    layers = Layers.of(model)
    assert layers is not None and layers.fixed_silu
    # activation_error's other ways give the model torch's SiLU back (the float way runs in bfloat16)
    ids = torch.tensor([[1, 5, 9, 2]])
    for way in (float32_reference(model), float_activations(model)):
        assert not any(type(m) is FixedSiLU for m in way.modules())
        assert way(input_ids=ids).logits.isfinite().all()
    with pytest.raises(TypeError, match=r"FixedSiLU computes float32, not torch\.bfloat16"):
        FixedSiLU()(torch.ones(3, dtype=torch.bfloat16))
    model.model.layers[0].mlp.act_fn = torch.nn.SiLU()  # some layers only: not a forward the C++ layers run
    assert Layers.of(model) is None
    assert use_fixed_silu(tiny_model.to(torch.bfloat16)) == 0  # a bfloat16 model keeps torch's
