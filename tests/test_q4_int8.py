"""model.activations=int8: a GGUF's 4-bit blocks multiplied by activations quantized to int8 per row
and block of 32 (decoding/runtime/csrc/q4_int8.cpp), against a float reference of the same blocks,
row-invariant, run by the C++ layers as by `hf`, and refused where it cannot run."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from builds import BUILDS, other_build
from gguf import GGMLQuantizationType, quantize
from test_quant import int4_copy, k_quant_layer, q4_k_bytes, q6_k_bytes

from decoding.base.errors import BackendError
from decoding.runtime import kernels, numerics
from decoding.runtime.llama import Layers
from decoding.runtime.models import ModelSpec, default_cache_dir, gguf_file, resolve_activations
from decoding.runtime.numerics import Numerics
from decoding.runtime.quant import (
    GROUP,
    Q8_TYPES,
    Int4Linear,
    Q8Linear,
    decode_int4,
    decode_q8,
    k_factors_floats,
    q6_k_scales,
    use_k_block,
)

RNG = np.random.default_rng(1)
NO_BIAS = torch.empty(0)  # the kernels' "no bias"


def test_a_k_quants_file_factors_follow_a_row_permutation():
    """The loader undoes the converter's q / k row permutation on every array of a layer (quant.py
    `rows`): permuted, the file's factors still form the permuted layer's float32 factors exactly."""
    perm = RNG.permutation(96)

    def rows(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a[perm]))

    raw = q4_k_bytes(96, 512)
    blocks = decode_int4(raw, "Q4_K", 96, 512)
    t = [rows(a) for a in (blocks.codes, blocks.scale, blocks.minimum)]
    compact, floats = Int4Linear(*t, None, "int8", blocks.k.rows(rows)), Int4Linear(*t, None, "int8")
    assert compact.factors.dtype == torch.uint8
    assert torch.equal(k_factors_floats(compact.factors, halves=False), floats.factors)
    raw = q6_k_bytes(96, 512)
    codes, scale = (rows(a) for a in decode_q8(raw, "Q6_K", 96, 512))
    compact = Q8Linear(None, codes, scale, None, q6_k_scales(raw, 96, 512).rows(rows))
    assert torch.equal(k_factors_floats(compact.factors, halves=True), Q8Linear(None, codes, scale, None).factors)


def gguf_layer(n_out: int, n_in: int, kind: str, activations: str = "int8") -> Int4Linear | Q8Linear:
    """A layer as a GGUF file ships it in `kind` (Q4_K from random bytes: its 6-bit scales; Q8_0 and
    Q5_0 as the int8 path's Q8Linear, with the bfloat16 weight an LM head keeps); a K-quant's factors
    as the loader keeps them."""
    if kind in Q8_TYPES:
        w = RNG.normal(scale=0.05, size=(n_out, n_in)).astype(np.float32)
        raw = q6_k_bytes(n_out, n_in) if kind == "Q6_K" else quantize(w, GGMLQuantizationType[kind])
        codes, scale = decode_q8(raw, kind, n_out, n_in)
        weight = torch.nn.Parameter(torch.from_numpy(w).to(torch.bfloat16), requires_grad=False)
        k = q6_k_scales(raw, n_out, n_in).rows(torch.from_numpy) if kind == "Q6_K" else None
        return Q8Linear(weight, torch.from_numpy(codes), torch.from_numpy(scale), None, k)
    if kind == "Q4_K":
        raw = q4_k_bytes(n_out, n_in)
    else:
        raw = quantize(RNG.normal(scale=0.05, size=(n_out, n_in)).astype(np.float32), GGMLQuantizationType[kind])
    blocks = decode_int4(raw, kind, n_out, n_in)
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (blocks.codes, blocks.scale, blocks.minimum)]
    k = blocks.k.rows(torch.from_numpy) if blocks.k is not None and activations == "int8" else None
    return Int4Linear(*t, None, activations, k)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_a_k_quants_factors_as_the_file_holds_them_give_the_float_factors_bits(kind):
    """A K-quant's factors kept as the file holds them (a float per 256 inputs, bytes per block: 24 or
    20 bytes a block of 8 outputs instead of 64) are the float32 factors exactly once formed, and the
    kernel gives the bits of the float32 factors' layout from them, for every tile of rows and level."""
    raw = q6_k_bytes(96, 512) if kind == "Q6_K" else q4_k_bytes(96, 512)
    compact, floats = (k_quant_layer(raw, kind, 96, 512, file_factors=f) for f in (True, False))
    assert compact.factors.dtype == torch.uint8 and floats.factors.dtype == torch.float32
    assert compact.factors.numel() <= floats.factors.numel() * 4 * 3 // 8
    assert torch.equal(k_factors_floats(compact.factors, halves=kind == "Q6_K"), floats.factors)
    assert torch.equal(compact.dequantized(), floats.dequantized())
    x = torch.randn(37, 512)
    for levels in (1, 2):
        compact.levels = floats.levels = levels
        for m in (1, 4, 8, 13, 37):
            assert torch.equal(compact(x[:m]), floats(x[:m])), (levels, m)


def quantized_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int8 rule in numpy: per row and block of 32, d = max|x| / 127, q = x * (127 / max|x|)
    rounded half to even, s = d * sum(q) (float32 arithmetic, as the kernel)."""
    b = x.astype(np.float32).reshape(x.shape[0], -1, GROUP)
    amax = np.abs(b).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int8)
    d = (amax / np.float32(127)).astype(np.float32)
    return q.reshape(x.shape), d, (d * q.astype(np.int32).sum(-1)).astype(np.float32)


def test_activations_are_quantized_by_the_stated_rule():
    x = torch.randn(9, 256) * torch.logspace(-3, 2, 256)  # blocks of very different scales
    x[3, :32] = 0  # an all-zero block: scale 0, codes 0
    q, d, s = kernels.load().q4_int8_quantize(x, 1, GROUP)
    rq, rd, rs = quantized_rows(x.numpy())
    assert np.array_equal(q.numpy(), rq) and np.array_equal(d.numpy(), rd) and np.array_equal(s.numpy(), rs)
    assert q.abs().max() == 127


def test_two_levels_quantize_the_first_levels_residual_by_the_same_rule():
    """Level 2: r = x - d q (one rounding), quantized as x is; s = d sum(q) + d2 sum(q2) (one
    rounding); x then within 1/508 of the first level's step, about 16 bits of the block's maximum."""
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(381)) * torch.logspace(-3, 2, 256)
    x[3, :32] = 0
    q, d, s, q2, d2 = kernels.load().q4_int8_quantize(x, 2, GROUP)
    rq, rd, rs = quantized_rows(x.numpy())
    assert np.array_equal(q.numpy(), rq) and np.array_equal(d.numpy(), rd)
    step = np.repeat(rd, GROUP, axis=1)
    residual = (x.numpy().astype(np.float64) - step.astype(np.float64) * rq).astype(np.float32)  # exact, then rounded
    rq2, rd2, _ = quantized_rows(residual)
    assert np.array_equal(q2.numpy(), rq2) and np.array_equal(d2.numpy(), rd2)
    sums = rd2.astype(np.float64) * rq2.reshape(9, -1, GROUP).astype(np.int64).sum(-1) + rs.astype(np.float64)
    assert np.array_equal(s.numpy(), sums.astype(np.float32))
    # in float64: float32's own rounding of x_hat (half a unit of |x|) is not the levels' error
    x_hat = step.astype(np.float64) * rq + np.repeat(rd2, GROUP, axis=1).astype(np.float64) * rq2
    assert (np.abs(x.numpy() - x_hat) <= step / 508 * (1 + 1e-5)).all()
    with pytest.raises(RuntimeError, match="in 1 or 2 int8 levels, not 3"):
        kernels.load().q4_int8_quantize(x, 3, GROUP)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q6_K"])
def test_the_kernel_computes_the_blocks_against_the_quantized_rows(kind):
    """Against float64 of the same blocks and the same int8 rows, the output is exact up to its
    bfloat16 rounding (half a unit in the last place: 2^-8 relative) and float32 accumulation
    (1e-5 of the output's scale); against the float rows, within 2% of the outputs' RMS."""
    layer = gguf_layer(90 if kind in Q8_TYPES else 96, 512, kind)  # 90 outputs: padded to groups of 8
    assert layer.dequantized().abs().max() > 0
    x = torch.randn(13, 512).to(torch.bfloat16)
    y = layer(x).double()
    w = layer.dequantized().double()
    q, d, _ = quantized_rows(x.float().numpy())
    xq = torch.from_numpy((q.astype(np.float64).reshape(13, -1, GROUP) * d[..., None]).reshape(13, 512))
    expected = xq @ w.t()
    scale = expected.abs().max()
    assert ((y - expected).abs() <= expected.abs() * 2**-8 + 1e-5 * scale).all()
    from_float = x.double() @ w.t()
    assert ((y - from_float).pow(2).mean().sqrt() / from_float.pow(2).mean().sqrt()) < 0.02


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q6_K"])
def test_two_levels_compute_the_blocks_against_both_levels(kind):
    """In two levels the output is the blocks against d q + d2 q2, exact up to the float32 result's
    rounding and accumulation (1e-5 of the outputs' scale), and within 2e-4 of the float rows' RMS."""
    layer = gguf_layer(96, 512, kind)
    layer.levels = 2
    x = torch.randn(13, 512) * torch.logspace(-1, 1, 512)
    y = layer(x).double()
    q, d, _, q2, d2 = kernels.load().q4_int8_quantize(x, 2, GROUP)
    x_hat = sum((c.double().view(13, -1, GROUP) * f.double()[..., None]).view(13, 512) for c, f in ((q, d), (q2, d2)))
    w = layer.dequantized().double()
    expected = x_hat @ w.t()
    assert ((y - expected).abs() <= 1e-5 * expected.abs().max()).all()
    from_float = x.double() @ w.t()
    assert ((y - from_float).pow(2).mean().sqrt() / from_float.pow(2).mean().sqrt()) < 2e-4
    layer.levels = 1
    assert ((layer(x).double() - from_float).pow(2).mean().sqrt() / from_float.pow(2).mean().sqrt()) > 2e-3


def test_super_block_activations_are_quantized_by_the_stated_rule():
    """k_block 256 (model.activations=int8_256): per row and super-block of 256 inputs d = max|x| / 127
    and q = x * (127 / max|x|) rounded half to even, each block's code sum beside it; two levels
    quantize the first level's residual by the same rule."""
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 2, 768)
    x[1, :256] = 0  # an all-zero super-block: scale 0, codes 0
    q, d, n = kernels.load().q4_int8_quantize(x, 1, 256)
    b = x.numpy().reshape(5, 3, 256)
    amax = np.abs(b).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    rq = np.rint(b * inv[..., None]).astype(np.int8).reshape(5, 768)
    assert np.array_equal(q.numpy(), rq)
    assert np.array_equal(d.numpy(), (amax / np.float32(127)).astype(np.float32))
    assert np.array_equal(n.numpy(), rq.astype(np.int32).reshape(5, -1, GROUP).sum(-1))
    assert d[1, 0] == 0 and (q[1, :256] == 0).all()
    q, d, _, q2, _, _ = kernels.load().q4_int8_quantize(x, 2, 256)
    # the kernel's fma(-d, q, x): exact in float64, then one rounding
    residual = (x.double() - (q.double().view(5, 3, 256) * d.double()[..., None]).view(5, 768)).float()
    assert torch.equal(q2, kernels.load().q4_int8_quantize(residual, 1, 256)[0])
    with pytest.raises(RuntimeError, match="a scale per 32 or 256 inputs dividing the 768 features, not 64"):
        kernels.load().q4_int8_quantize(x, 1, 64)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("levels", [1, 2])
def test_super_blocks_compute_the_blocks_against_the_quantized_rows(kind, levels):
    """k_block 256: the super-block's integer sums and one float epilogue give the blocks against the
    rows as quantized per 256 (float64 of the same blocks), exact up to float32's rounding of the
    result (1e-5 of the outputs' scale); against the float rows, about twice int8's error per 32
    at one level (the scale spans 8 blocks)."""
    layer = gguf_layer(96, 512, kind)
    layer.levels = levels
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(levels)) * torch.logspace(-1, 1, 512)
    w = layer.dequantized().double()
    parts = kernels.load().q4_int8_quantize(x, levels, 256)
    x_hat = sum(
        (c.double().view(13, -1, 256) * f.double()[..., None]).view(13, 512) for c, f in zip(parts[::3], parts[1::3])
    )
    layer.k_block = 256
    y = layer(x).double()
    expected = x_hat @ w.t()
    assert ((y - expected).abs() <= 1e-5 * expected.abs().max()).all()
    from_float = x.double() @ w.t()
    error_256 = (y - from_float).pow(2).mean().sqrt() / from_float.pow(2).mean().sqrt()
    layer.k_block = GROUP
    error_32 = (layer(x).double() - from_float).pow(2).mean().sqrt() / from_float.pow(2).mean().sqrt()
    assert error_32 < error_256 < (0.03 if levels == 1 else 1e-4)
    for m in range(1, 14):  # every tile size (1 to 8; AVX2: to 4), alone and in a batch
        layer.k_block = 256
        assert torch.equal(layer(x[:m]).double(), y[:m]), m
        assert torch.equal(layer(x[m - 1 : m]).double(), y[m - 1 : m]), m
    with pytest.raises(RuntimeError, match=r"k_block .* 32 or 256, not 64"):
        layer.k_block = 64
        layer(x)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("levels", [1, 2])
def test_a_super_block_columns_bits_do_not_depend_on_the_columns_beside_it(kind, levels):
    """With AVX-512 the super-block kernel takes two groups of 8 columns a tile (super_pair) where a
    panel has 32 rows or more, and a task's last odd group and fewer rows one group a tile: a column's
    bits are the same whichever ran it, for any number of columns beside it and of threads splitting
    them, in a batch of 40 rows (pairs), of 33 and 39 (pairs, then the rest in one tile) and alone (one
    group a tile)."""
    layer = gguf_layer(96, 512, kind)
    call = getattr(kernels.load(), "q8_int8_linear" if kind in Q8_TYPES else "q4_int8_linear")
    x = torch.randn(40, 512)
    every = call(x, layer.packed8, layer.factors, NO_BIAS, levels, 256)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            for groups in (1, 2, 3, 7, 12):
                got = call(x, layer.packed8[:groups], layer.factors[:groups], NO_BIAS, levels, 256)
                assert torch.equal(got, every[:, : 8 * groups]), (n_threads, groups)
                one = call(x[4:5], layer.packed8[:groups], layer.factors[:groups], NO_BIAS, levels, 256)
                assert torch.equal(one, every[4:5, : 8 * groups]), (n_threads, groups)
                for m in (33, 39):  # pairs of 8 rows, then the rest in one tile of 1 or 7
                    got = call(x[:m], layer.packed8[:groups], layer.factors[:groups], NO_BIAS, levels, 256)
                    assert torch.equal(got, every[:m, : 8 * groups]), (n_threads, groups, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "kind, levels", [("Q4_1", 1), ("Q4_1", 2), ("Q8_0", 1), ("Q8_0", 2), ("Q5_0", 2), ("Q6_K", 1), ("Q6_K", 2)]
)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(kind, levels):
    layer = gguf_layer(64, 256, kind)
    layer.levels = levels
    x = torch.randn(150, 256).to(torch.bfloat16)
    every = layer(x)
    for m in (*range(1, 18), 32, 33, 39, 64, 65, 70, 150):  # tiles of 1 to 8 rows (AMX 16), panels 64
        assert torch.equal(layer(x[:m]), every[:m]), m
    assert torch.equal(layer(x[5:6]), every[5:6])  # alone, not only as a prefix
    assert torch.equal(layer(x[100:101]), every[100:101])  # a row of the second panel, alone
    # Fewer columns beside it: the first groups of 8 without the rest, with the same bits.
    if kind in Q8_TYPES:
        fewer = Q8Linear(layer.weight[:56], *(t[:56] for t in layer.codes_scales()), None)
    else:
        fewer = Int4Linear(layer.codes[:56], *(t[:56] for t in layer.scale_minimum()), None, "int8")
    fewer.levels = levels
    assert torch.equal(fewer(x), every[:, :56])
    if kind in Q8_TYPES:
        return
    with_bias = Int4Linear(layer.codes, *layer.scale_minimum(), torch.randn(64), "int8")
    with_bias.levels = levels
    assert torch.equal(with_bias(x[:1]), with_bias(x)[:1])
    with pytest.raises(ValueError, match=r"outputs in groups of 8 and inputs in blocks of 32, not \[63, 256\]"):
        Int4Linear(layer.codes[:63], *(t[:63] for t in layer.scale_minimum()), None, "int8")


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q6_K", "Q4_K"])
def test_the_fused_form_has_the_bits_of_norm_linear_and_residual_add(kind):
    """csrc/layers.cpp's q4_int8_fused (either format, told by the factors): the norm's values
    quantized without its buffer, and the residual added in the kernel's output loop, bitwise what
    the separate modules compute."""
    k = kernels.load()
    layer = gguf_layer(64, 256, kind)
    h, weight, residual = torch.randn(9, 256) * 3, torch.rand(256) + 0.5, torch.randn(9, 64)
    ops = (layer.packed8, layer.factors, torch.empty(0), 1, GROUP)
    normed = k.rms_norm_rows(h, weight, 1e-5)
    assert torch.equal(k.q4_int8_fused(h, *ops, weight, 1e-5, None), layer(normed))
    assert torch.equal(k.q4_int8_fused(normed, *ops, None, 0.0, residual), residual + layer(normed))
    both = k.q4_int8_fused(h.view(3, 3, 256), *ops, weight, 1e-5, residual.view(3, 3, 64))
    assert both.shape == (3, 3, 64) and torch.equal(both.view(9, 64), residual + layer(normed))
    for m in (1, 4, 5):  # a row's bits alone and in any batch
        assert torch.equal(k.q4_int8_fused(h[:m], *ops, weight, 1e-5, residual[:m]), both.view(9, 64)[:m])
    with pytest.raises(RuntimeError, match="a residual"):
        k.q4_int8_fused(h, *ops, weight, 1e-5, residual[:3])
    layer.levels = 2  # q, k and v's case: normalized, then in two levels
    assert torch.equal(k.q4_int8_fused(h, *ops[:3], 2, GROUP, weight, 1e-5, None), layer(normed))
    if layer.factors.dtype == torch.uint8:  # a K-quant's: its input with a scale per super-block too
        layer.k_block = 256
        assert torch.equal(k.q4_int8_fused(h, *ops[:3], 2, 256, weight, 1e-5, None), layer(normed))
        assert not torch.equal(layer(normed), k.q4_int8_fused(h, *ops[:3], 2, GROUP, weight, 1e-5, None))


def test_the_cpp_layers_take_the_int8_kernel(tiny_model):
    """The decoder layers (csrc/layers.cpp) get every projection's int8 operands, not a silent
    fallback to the Python modules (tests/test_llama.py shows their forward has `hf`'s bits)."""
    model = int4_copy(tiny_model, "int8")
    layers = Layers.of(model)
    assert layers is not None
    factors = [w for w in layers.weights if w.dtype == torch.float32 and w.dim() == 4]
    # Per layer q, k, v joined, o, gate and up joined, down: [N / 8, K / 32, 2, 8] scales and minimums each.
    assert len(factors) == 4 * len(model.model.layers)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    joined = [w for w in layers.weights[: 2 + 7 * 3] if w.dim() == 4]
    n = attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features
    assert joined[0].shape[0] * 8 == n and joined[2].shape[0] * 8 == mlp.gate_proj.out_features * 2
    # The modules' buffers are views of the joined weights, not a second copy.
    assert attn.v_proj.factors.untyped_storage().data_ptr() == joined[0].untyped_storage().data_ptr()
    assert mlp.up_proj.packed8.untyped_storage().data_ptr() == layers.weights[2 + 4 * 3].untyped_storage().data_ptr()
    assert type(model.get_output_embeddings()) is Q8Linear  # the head on the int8 path too
    # q, k and v's input in two levels (the load path's), the others' in one; other levels are not run
    assert layers.qkv_levels == 2 and attn.k_proj.levels == 2 and attn.o_proj.levels == 1
    attn.o_proj.levels = 2
    assert Layers.of(model) is None
    attn.o_proj.levels, attn.v_proj.levels = 1, 1
    assert Layers.of(model) is None
    attn.v_proj.levels = 2
    attn.q_proj.k_block = 256  # projections of one input in two activation formats: not one C++ call's
    assert Layers.of(model) is None
    attn.q_proj.k_block = 32
    attn.o_proj.k_block = 256  # each input its own format: o's at index 1 of the layer's four
    assert Layers.of(model).k_blocks[:4] == (32, 256, 32, 32)
    use_k_block(model, 256, ("model.layers.0.mlp.down_proj",))
    assert Layers.of(model).k_blocks[:4] == (256, 256, 256, 32)


def test_int8_is_refused_where_it_cannot_run_and_auto_picks_what_runs():
    with pytest.raises(BackendError, match=r"model\.activations='int4' is not one of float, int8, int8_256, auto"):
        ModelSpec(activations="int4")
    spec = ModelSpec(activations="int8")
    with pytest.raises(BackendError, match=r"the weights are bfloat16; give a \.gguf model\.path") as info:
        resolve_activations(spec, torch.device("cpu"), "bfloat16")
    assert "\n" not in str(info.value)
    with pytest.raises(
        BackendError, match=r"model\.activations=int8 is the CPU's kernel.*use model\.activations=float"
    ):
        resolve_activations(spec, torch.device("cuda"), "gguf")
    assert resolve_activations(spec, torch.device("cpu"), "gguf") == "int8"  # what it runs on
    with pytest.raises(BackendError, match=r"model\.activations=int8_256 is the CPU's kernel"):
        resolve_activations(ModelSpec(activations="int8_256"), torch.device("cuda"), "gguf")
    auto = ModelSpec(activations="auto")
    assert resolve_activations(auto, torch.device("cuda"), "gguf") == "float"
    assert resolve_activations(auto, torch.device("cpu"), "bfloat16") == "float"


def test_auto_runs_int8_only_where_the_files_numerics_are_on_record(tmp_path, monkeypatch):
    """auto: int8 on a vectorized CPU once decoding.activation_error recorded the file's int8 KL no
    worse than llama.cpp's and its perplexity within 1% of float's; float without a record or past either."""
    spec = ModelSpec(activations="auto", cache_dir=str(default_cache_dir()))  # the converted model where it is
    monkeypatch.setenv("TOT_CACHE_DIR", str(tmp_path))  # the records here
    monkeypatch.setattr(numerics, "SHIPPED", tmp_path / "shipped")  # and none shipped
    cpu = torch.device("cpu")
    assert resolve_activations(spec, cpu, "gguf") == "float"  # nothing on record
    gguf = gguf_file(spec)
    vectorized = kernels.load().q4_int8_path() != "portable"
    digest = numerics.file_digest(gguf, tmp_path)
    numerics.write(tmp_path / "numerics", gguf, Numerics(0.0020, 6.25, 6.22, 0.0026), digest)
    assert resolve_activations(spec, cpu, "gguf") == ("int8" if vectorized else "float")
    for worse, why in (
        (Numerics(0.0039, 6.26, 6.22, 0.0026), r"int8's mean KL 0\.00390 is above llama\.cpp's 0\.00260"),
        (Numerics(0.0020, 6.40, 6.22, 0.0026), r"int8's perplexity is 2\.9% above float's \(at most 1%\)"),
        (Numerics(0.0020, 6.25, 6.22, None), r"no llama\.cpp figure"),
    ):
        numerics.write(tmp_path / "numerics", gguf, worse, digest)
        assert resolve_activations(spec, cpu, "gguf") == "float"
        assert re.search(why, worse.choice(tiles=False)[1])


def test_auto_runs_a_scale_per_super_block_where_its_numerics_pass_and_no_tiles_run_the_other():
    """A record with int8_256's figures: auto runs it where its KL and perplexity are no worse than
    llama.cpp's and the kernel has no AMX tiles (they run the scale per 32); int8 otherwise, saying why."""
    passing = Numerics(0.0014, 3.53, 3.53, 0.031, 3.59, 0.0090, 3.54)
    assert passing.choice(tiles=False) == ("int8_256", passing.ok("int8_256", 0.0090, 3.54)[1])
    assert passing.choice(tiles=True)[0] == "int8" and "AMX tiles" in passing.choice(tiles=True)[1]
    worse = Numerics(0.0014, 3.53, 3.53, 0.031, 3.59, 0.0400, 3.60)
    choice, why = worse.choice(tiles=False)
    assert choice == "int8" and re.search(
        r"int8_256 not: int8_256's mean KL 0\.04000 is above llama\.cpp's 0\.03100", why
    )
    higher = Numerics(0.0014, 3.53, 3.53, 0.031, 3.59, 0.0300, 3.60)
    assert higher.choice(tiles=False)[0] == "int8"
    assert "int8_256's perplexity 3.6000 is above llama.cpp's 3.59" in higher.choice(tiles=False)[1]
    assert Numerics(0.0014, 3.53, 3.53, 0.031).choice(tiles=False)[0] == "int8"  # no K-quant layer to change
    assert Numerics(0.0500, 3.53, 3.53, 0.031, 3.59, 0.0090, 3.54).choice(tiles=False)[0] == "float"


def test_shipped_records_are_of_this_arithmetic():
    """A kernel change that alters int8's outputs changes `arithmetic()`: the records shipped for the
    installed files must then be measured again (python -m decoding.activation_error model=NAME
    ship=true), or auto would silently run float on them."""
    records = sorted(numerics.SHIPPED.glob("*.json"))
    assert records, "no shipped records"
    for path in records:
        data = json.loads(path.read_text())
        assert data["arithmetic"] == numerics.arithmetic(), f"{path.name} ({data['gguf']}): measured on other kernels"
        assert path == numerics.record_path(numerics.SHIPPED, data["sha256"])
        record = Numerics(**{k: data[k] for k in Numerics.__dataclass_fields__})
        assert record.choice(tiles=False)[0] != "float", path.name


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_every_path_gives_the_same_bits(build):
    """The kernel built for `build` gives the bits of this machine's own path (AVX2, VNNI, or AMX
    tiles for each 16 rows with VNNI for the rest), for rows in tiles of 16 and 4 and alone, with
    activation scales per 32 and, on the K-quants, per super-block of 256."""
    native = kernels.load().q4_int8_path()  # checked here, not at collection: no build then
    if native == "portable" or native == build:
        pytest.skip(f"this machine's own path is {native}: nothing to compare the {build} build with")
    text = (
        f'#include <torch/extension.h>\n#include "{kernels.CSRC / "q4_int8.cpp"}"\n'
        "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n"
        '  m.def("q4_int8_linear", &q4_int8_linear);\n  m.def("q8_int8_linear", &q8_int8_linear);\n'
        '  m.def("q4_int8_path", &q4_int8_path);\n}\n'
    )
    other = other_build("tot_q4_int8", build, text)
    assert other.q4_int8_path() == build
    for kind in ("Q4_1", "Q4_K", "Q8_0", "Q6_K"):
        layer = gguf_layer(80, 512, kind)
        x = torch.randn(37, 512).to(torch.bfloat16)
        bias = torch.randn(80).to(torch.bfloat16)
        for levels, k_block in ((1, GROUP), (2, GROUP), (1, 256), (2, 256)):  # 256: super-blocks on a K-quant
            call = "q8_int8_linear" if kind in Q8_TYPES else "q4_int8_linear"
            expected = getattr(kernels.load(), call)(x, layer.packed8, layer.factors, bias, levels, k_block)
            got = getattr(other, call)(x, layer.packed8, layer.factors, bias, levels, k_block)
            assert torch.equal(got, expected), (kind, levels, k_block)


def test_activation_error_measures_each_way_against_float32(tiny_model):
    """decoding.activation_error's comparison: the reference against itself is 0 nats with the
    perplexity of its own log-probabilities; both ways of running the 4-bit layers (int8, float)
    differ from their float32 dequantization, by a little."""
    import math

    from decoding.activation_error import float32_reference, float_activations, log_probs, measure

    model = int4_copy(tiny_model, "int8")
    texts = [[5, 17, 3, 99, 42, 7, 11, 64], [9, 8, 7, 6, 5, 4]]
    ref_model = float32_reference(model)
    assert not any(isinstance(m, Int4Linear) for m in ref_model.modules())
    as_float = float_activations(model)
    rows = measure(
        lambda t: log_probs(ref_model, t),
        {"int8": lambda t: log_probs(model, t), "float": lambda t: log_probs(as_float, t)},
        texts,
    )
    same, int8 = rows["reference"], rows["int8"]
    assert same.kl == pytest.approx(0, abs=1e-12) and same.tokens == 7 + 5
    reference = [log_probs(ref_model, t) for t in texts]
    nll = -sum(float(r[range(len(t) - 1), t[1:]].sum()) for r, t in zip(reference, texts))
    assert same.perplexity == pytest.approx(math.exp(nll / 12))
    assert 0 < int8.kl < 0.05 and 0 < rows["float"].kl < 0.05
    assert int8.perplexity != same.perplexity and int8.tokens == same.tokens
    assert all(m.activations == "float" for m in float_activations(model).modules() if isinstance(m, Int4Linear))


def test_the_search_for_heavy_inputs_finds_the_few_that_carry_int8_256s_error():
    """heavy_inputs, by halving: on an additive excess the inputs that carry a quarter or more of the
    whole are found in a few measurements each; an error spread thin, or none, finds none."""
    from decoding.activation_error import heavy_inputs

    inputs = [(f"model.layers.{i}.mlp.down_proj",) for i in range(40)]

    def excess_of(weights: list[float], calls: list[int]):
        def excess(part):
            calls.append(len(part))
            return sum(weights[inputs.index(p)] for p in part)

        return excess

    weights, calls = [0.0001] * 40, []
    weights[26], weights[7] = 0.02, 0.01
    assert heavy_inputs(inputs, excess_of(weights, calls)) == [inputs[7], inputs[26]]
    assert calls[0] == 40 and len(calls) <= 1 + 2 * 2 * 6  # the whole, then two halves a level to each
    assert heavy_inputs(inputs, excess_of([0.0001] * 40, [])) == []
    assert heavy_inputs(inputs, excess_of([0.0] * 40, [])) == []


def test_the_inputs_kept_per_32_are_named_as_the_loader_gives_them(tiny_model):
    """The search's units are the K-quant layers reading one input, named as use_k_block and the
    record take them; the search leaves its model as int8_256 then runs."""
    from conftest import build_model
    from test_quant import k_quant_blocks

    from decoding.activation_error import float32_reference, k_quant_inputs, kept_per_32, log_probs

    torch.manual_seed(0)
    model = k_quant_blocks(build_model(tiny_model.config.vocab_size, arch="qwen2", hidden=256))
    inputs = k_quant_inputs(model)
    modules = dict(model.named_modules())
    assert ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj") in inputs
    assert (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    ) in inputs
    assert all(type(modules[n]) in (Int4Linear, Q8Linear) for names in inputs for n in names)
    ref = float32_reference(model)
    kept = kept_per_32(model, lambda t: log_probs(ref, t), [[5, 17, 3, 99, 42, 7, 11, 64]])
    assert set(kept) <= {n for names in inputs for n in names}
    for name, module in modules.items():  # left as int8_256 runs: the kept layers per 32, the rest per 256
        if type(module) in (Int4Linear, Q8Linear):
            assert module.k_block == (GROUP if name in kept else 256), name


def test_int8_256_keeps_per_32_the_layers_the_files_record_names(tmp_path, monkeypatch):
    """The load path reads the layers int8_256 keeps per 32 from the file's numerics record."""
    from decoding.runtime.models import _kept_per_32

    monkeypatch.setenv("TOT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(numerics, "SHIPPED", tmp_path / "shipped")
    gguf = gguf_file(ModelSpec(cache_dir=str(default_cache_dir())))
    assert _kept_per_32(gguf) == ()  # no record
    kept = ("model.layers.26.mlp.gate_proj", "model.layers.26.mlp.up_proj")
    record = Numerics(0.0014, 3.53, 3.53, 0.031, 3.59, 0.0018, 3.53, kept)
    numerics.write(tmp_path / "numerics", gguf, record, numerics.file_digest(gguf, tmp_path))
    assert _kept_per_32(gguf) == kept and numerics.read(tmp_path, gguf) == record


def test_the_loader_gives_the_embedded_models_head_its_q8_0_blocks():
    """The embedded GGUF ties its LM head to a Q8_0 embedding: with int8 activations the head runs on
    those blocks (the matrix gguf-py dequantizes, exactly), keeping the bfloat16 weight for readers."""
    from types import SimpleNamespace

    from gguf import dequantize

    from decoding.runtime.gguf_tensors import file_tensors, tensor_bytes
    from decoding.runtime.models import embedded_file
    from decoding.runtime.quant import q8_head_from_gguf

    class Model(torch.nn.Module):  # what the loader reads of a causal LM
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(tie_word_embeddings=True)
            self.lm_head = torch.nn.Linear(576, 49152, bias=False, dtype=torch.bfloat16)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm_head

        def set_output_embeddings(self, head: torch.nn.Module) -> None:
            self.lm_head = head

    path = embedded_file("smollm2-135m")
    model = Model()
    weight = model.lm_head.weight
    assert q8_head_from_gguf(model, path)
    head = model.lm_head
    assert type(head) is Q8Linear and head.weight is weight
    raw = next(t for t in file_tensors(path) if t.name == "token_embd.weight")
    expected = dequantize(tensor_bytes(path, raw).reshape(49152, -1), GGMLQuantizationType.Q8_0)
    assert torch.equal(head.dequantized(), torch.from_numpy(expected))


def test_the_peak_loops_measure_the_paths_instructions():
    """profile_forward reads the kernel's rate against tight loops of its dot products: the vector
    one everywhere, the tile one only where the kernel runs AMX tiles."""
    k = kernels.load()
    assert k.q4_int8_peak(100_000) > 0
    tiles = k.q4_int8_tile_peak(10_000)
    assert (tiles > 0) == (k.q4_int8_path() == "amx-int8")
