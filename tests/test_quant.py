"""decoding/runtime/quant.py: GGUF 4-bit blocks decoded as gguf-py dequantizes them, the stated rounding
of their scales for torch's int4 kernel, a row's output independent of the number of rows, and an
unsupported tensor type named in one line."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, dequantize, quantize
from helpers import UNCAPPED

from decoding.base.errors import BackendError
from decoding.runtime.activation import use_fixed_silu
from decoding.runtime.quant import (
    GROUP,
    INT8_HIDDEN,
    Int4Linear,
    Q8Linear,
    check_types,
    decode_int4,
    decode_q8,
    decode_q8_0,
    kernel_fits,
    q6_k_scales,
    two_level_inputs,
)

RNG = np.random.default_rng(0)


def _gguf_bytes(weights: np.ndarray, kind: str) -> np.ndarray:
    return quantize(weights.astype(np.float32), GGMLQuantizationType[kind])


def int4_linear(linear: torch.nn.Linear, kind: str = "Q4_1", activations: str = "float") -> Int4Linear:
    """The layer as a GGUF file would ship it in `kind`, its input multiplied as `activations`."""
    w = linear.weight.detach().float().numpy()
    blocks = decode_int4(_gguf_bytes(w, kind), kind, *w.shape)
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (blocks.codes, blocks.scale, blocks.minimum)]
    return Int4Linear(*t, linear.bias, activations)


def q8_linear(linear: torch.nn.Module, kind: str) -> Q8Linear:
    """A decoder projection as a GGUF file ships it in `kind` (Q8_0 or Q5_0), on the int8 path."""
    w = linear.weight.detach().float().numpy() if isinstance(linear, torch.nn.Linear) else linear.dequantized().numpy()
    codes, scale = decode_q8(_gguf_bytes(w, kind), kind, *w.shape)
    return Q8Linear(None, torch.from_numpy(codes), torch.from_numpy(scale), linear.bias)


def mixed_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """An int8 copy of a tiny model whose projections are in the block types of a real file (the
    Qwen2.5-Coder 0.5B's Q5_0 and Q8_0 beside Q4): layer 0's q, k, v and gate Q5_0, o and up Q4_1 (a
    pair of two formats, run apart), down Q8_0; every later layer's projections Q8_0."""
    model = int4_copy(model, "int8")
    for i, layer in enumerate(model.model.layers):
        kinds = {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q5_0", "gate_proj": "Q5_0", "down_proj": "Q8_0"}
        for name, module in list(layer.named_modules()):
            kind = kinds.get(name.rpartition(".")[2]) if i == 0 else "Q8_0" if name.endswith("_proj") else None
            if kind:
                parent, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent), child, q8_linear(module, kind))
    two_level_inputs(model)
    return model


def k_quant_layer(
    raw: np.ndarray, kind: str, n_out: int, n_in: int, file_factors: bool = True, bias: torch.Tensor | None = None
) -> torch.nn.Module:
    """A Q4_K or Q6_K layer on the int8 path, its factors as the loader keeps them (the file's
    super-block floats and bytes: `file_factors`) or as float32 products."""
    if kind == "Q6_K":
        codes, scale = (torch.from_numpy(a) for a in decode_q8(raw, kind, n_out, n_in))
        k = q6_k_scales(raw, n_out, n_in).rows(torch.from_numpy) if file_factors else None
        return Q8Linear(None, codes, scale, bias, k)
    blocks = decode_int4(raw, kind, n_out, n_in)
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (blocks.codes, blocks.scale, blocks.minimum)]
    return Int4Linear(*t, bias, "int8", blocks.k.rows(torch.from_numpy) if file_factors else None)


def k_quant_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """An int8 copy of a model 256 or more wide in a Q4_K_M file's types (the Qwen2.5-Coder 1.5B's):
    random Q4_K projections, v and down Q6_K, each with its factors as the loader keeps them, and the
    model's biases."""
    model = int4_copy(model, "int8")
    for name, module in list(model.named_modules()):
        if not name.endswith("_proj"):
            continue
        kind = "Q6_K" if name.endswith(("v_proj", "down_proj")) else "Q4_K"
        shape = (module.out_features, module.in_features)
        raw = q6_k_bytes(*shape, (2e-5, 6e-5)) if kind == "Q6_K" else q4_k_bytes(*shape, (1e-4, 3e-4))
        layer = k_quant_layer(raw, kind, *shape, bias=module.bias)
        layer.levels = module.levels
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return model


def q8_head(model: torch.nn.Module) -> None:
    """The model's LM head as a GGUF file ships it in Q8_0, on the int8 path (what the loader does
    for model.activations=int8)."""
    head = model.get_output_embeddings()
    w = head.weight.detach().float().numpy()
    codes, scale = decode_q8_0(_gguf_bytes(w, "Q8_0"), *w.shape)
    model.set_output_embeddings(Q8Linear(head.weight, torch.from_numpy(codes), torch.from_numpy(scale), head.bias))


def int4_copy(model: torch.nn.Module, activations: str = "float") -> torch.nn.Module:
    """A copy of a tiny model whose decoder linear layers are Q4_1 GGUF blocks, their input
    multiplied as `activations` (model.activations); with int8 the LM head is Q8_0 blocks too and the
    rest of the model float32 with FixedSiLU and q, k, v's input in two levels, as the load path makes it."""
    model = copy.deepcopy(model)
    if activations == "int8":
        model.to(INT8_HIDDEN)
    for name, module in list(model.named_modules()):
        if name != "lm_head" and kernel_fits(module):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, int4_linear(module, activations=activations))
    if activations == "int8":
        q8_head(model)
        use_fixed_silu(model)
        two_level_inputs(model)
    return model


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_decoded_blocks_equal_gguf_dequantization(kind):
    w = RNG.normal(size=(48, 256)).astype(np.float32)
    raw = _gguf_bytes(w, kind)
    blocks = decode_int4(raw, kind, 48, 256)
    assert blocks.codes.min() >= 0 and blocks.codes.max() <= 15
    assert np.array_equal(blocks.weights(), dequantize(raw, GGMLQuantizationType[kind]).reshape(48, 256))


def q4_k_bytes(
    n_out: int, n_in: int, d: tuple[float, float] = (0.0005, 0.003), rng: np.random.Generator | None = None
) -> np.ndarray:
    """Random Q4_K blocks (gguf-py has no Q4_K quantizer): any codes and 6-bit scales and minimums, with
    finite fp16 d and dmin in range `d`, drawn from `rng` (this module's by default)."""
    rng = RNG if rng is None else rng
    raw = rng.integers(0, 256, size=(n_out, n_in // 256, 144), dtype=np.uint8)
    for offset in (0, 2):
        factors = rng.uniform(*d, size=(n_out, n_in // 256)).astype(np.float16)
        raw[..., offset : offset + 2] = factors.view(np.uint8).reshape(n_out, -1, 2)
    return raw.reshape(n_out, -1)


def q6_k_bytes(n_out: int, n_in: int, d_range: tuple[float, float] = (0.0005, 0.003)) -> np.ndarray:
    """Random Q6_K blocks (gguf-py has no Q6_K quantizer) with a finite fp16 d in `d_range`."""
    raw = RNG.integers(0, 256, size=(n_out, n_in // 256, 210), dtype=np.uint8)
    d = RNG.uniform(*d_range, size=(n_out, n_in // 256)).astype(np.float16)
    raw[..., 208:210] = d.view(np.uint8).reshape(n_out, -1, 2)
    return raw.reshape(n_out, -1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q6_K"])
def test_q8_form_blocks_equal_gguf_dequantization(kind):
    """Q8_0, Q5_0 and Q6_K decoded to signed codes and a scale per block of 32 (Q6_K: per 16),
    Q8Linear's form, give gguf-py's dequantization exactly; Q5_0's codes keep to -16..15, Q6_K's to
    -32..31."""
    w = RNG.normal(size=(24, 256)).astype(np.float32)
    raw = q6_k_bytes(24, 256) if kind == "Q6_K" else _gguf_bytes(w, kind)
    codes, scale = decode_q8(raw, kind, 24, 256)
    bound = {"Q5_0": 16, "Q6_K": 32}.get(kind)
    if bound:
        assert codes.min() == -bound and codes.max() == bound - 1
    weights = codes.astype(np.float32) * np.repeat(scale, 256 // scale.shape[1], 1)
    assert np.array_equal(weights, dequantize(raw, GGMLQuantizationType[kind]).reshape(24, 256))


def test_q4_k_blocks_equal_gguf_dequantization():
    """Q4_K (super-blocks of 256 with 6-bit sub-block scales and minimums), from random bytes."""
    n_out, n_in = 8, 512
    raw = RNG.integers(0, 256, size=(n_out, n_in // 256, 144), dtype=np.uint8)
    for offset in (0, 2):  # d and dmin: finite fp16 values
        raw[..., offset : offset + 2] = (
            RNG.uniform(0.001, 0.05, size=(n_out, n_in // 256)).astype(np.float16).view(np.uint8).reshape(n_out, -1, 2)
        )
    raw = raw.reshape(n_out, -1)
    blocks = decode_int4(raw, "Q4_K", n_out, n_in)
    expected = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(n_out, n_in)
    np.testing.assert_allclose(blocks.weights(), expected, rtol=0, atol=1e-6)


def test_kernel_weights_are_the_files_with_bfloat16_scales():
    """What is rounded: scale and zero (= minimum + 8 scale) to bfloat16; the codes are the file's."""
    linear = torch.nn.Linear(128, 48, bias=False)
    layer = int4_linear(linear)
    w = linear.weight.detach().numpy()
    blocks = decode_int4(_gguf_bytes(w, "Q4_1"), "Q4_1", 48, 128)
    scale = torch.from_numpy(blocks.scale).to(torch.bfloat16).float().repeat_interleave(GROUP, 1)
    zero = torch.from_numpy(blocks.minimum + 8 * blocks.scale).to(torch.bfloat16).float().repeat_interleave(GROUP, 1)
    codes = torch.from_numpy(blocks.codes.astype(np.float32))
    assert torch.equal(layer.dequantized(), (codes - 8) * scale + zero)
    # bfloat16 keeps 8 significant bits: each weight is within 2^-8 of |scale| * 15 + |zero| of the file's.
    bound = (scale.abs() * 15 + zero.abs()) * 2**-8
    assert ((layer.dequantized() - torch.from_numpy(blocks.weights())).abs() <= bound).all()
    x = torch.randn(5, 128).to(torch.bfloat16)
    expected = x.float() @ layer.dequantized().t()
    torch.testing.assert_close(layer(x).float(), expected, atol=0.05, rtol=0.02)


def test_a_rows_output_does_not_depend_on_the_number_of_rows():
    layer = int4_linear(torch.nn.Linear(256, 96))
    x = torch.randn(300, 256).to(torch.bfloat16)
    alone = layer(x[:1])
    for m in (2, 3, 7, 8, 16, 31, 32, 33, 64, 100, 300):
        assert torch.equal(layer(x[:m])[:1], alone), m


def test_unsupported_gguf_type_is_named(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 66), dtype=np.uint8), raw_dtype=GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(BackendError, match=r"tensor blk\.0\.attn_q\.weight has GGUF type IQ2_XXS") as info:
        check_types(path, "model")
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def int4_loaded(tiny_model, tokenizer):
    from decoding.runtime.models import LoadedModel

    return LoadedModel(int4_copy(tiny_model), tokenizer, torch.device("cpu"), use_chat_template=False, source="int4")


@pytest.fixture(scope="module")
def int8_loaded(tiny_model, tokenizer):
    """The same blocks multiplied by int8 activations (model.activations=int8)."""
    from decoding.runtime.models import LoadedModel

    model = int4_copy(tiny_model, "int8")
    return LoadedModel(model, tokenizer, torch.device("cpu"), use_chat_template=False, source="int4 x int8")


@pytest.fixture(scope="module")
def qwen2_blocks_loaded(tiny_qwen2, tokenizer):
    """A tiny Qwen2 (q, k and v biases) in a real file's mix of blocks (Q5_0, Q8_0, Q4_1) on int8."""
    from decoding.runtime.models import LoadedModel

    return LoadedModel(mixed_blocks(tiny_qwen2), tokenizer, torch.device("cpu"), False, "qwen2 blocks x int8")


@pytest.mark.parametrize("loaded", ["int4_loaded", "int8_loaded", "qwen2_blocks_loaded"])
@pytest.mark.parametrize("decoder", ["hf", "ar", "stand", "seed_stand", "pld", "recycling", "aded", "sd", "seed"])
def test_every_decoder_on_int4_weights_returns_generates_greedy_output(request, loaded, tokenizer, decoder):
    from test_decoders import BUDGETS, PROMPTS, encode, reference_greedy

    from decoding.api.config import DecoderConfig
    from decoding.api.engine import Engine
    from decoding.base.values import GenRequest
    from decoding.runtime.models import ModelSpec
    from decoding.schedules.rounds import RoundsOptions
    from decoding.trees.policies import DraftTreeOptions

    int4_loaded = request.getfixturevalue(loaded)
    model = int4_loaded.model
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) > 0
    refs = [reference_greedy(model, encode(tokenizer, p), m, {2}) for p, m in zip(PROMPTS, BUDGETS)]
    config = decoder
    if decoder in ("sd", "seed"):  # draft with the target itself
        tree = DraftTreeOptions((2, 2, 1), key=decoder)
        config = DecoderConfig(decoder, tree, RoundsOptions(2), draft=ModelSpec("self", key="draft"), verify=UNCAPPED)
    engine = Engine(int4_loaded, config, int4_loaded if decoder in ("sd", "seed") else None)
    results = engine.generate([GenRequest(p, max_new_tokens=m) for p, m in zip(PROMPTS, BUDGETS)])
    assert [r.token_ids for r in results] == refs


def test_an_int4_layer_loads_into_a_plain_copy(tiny_model):
    """EDD starts its layer from a target layer: an int4 target's layer loads as its dequantized matrices."""
    from decoding.runtime.quant import dense_state_dict

    layer = int4_copy(tiny_model).model.layers[0]
    plain = copy.deepcopy(tiny_model.model.layers[0])
    plain.load_state_dict(dense_state_dict(layer))
    expected = layer.self_attn.q_proj.dequantized().to(torch.bfloat16)  # a bfloat16 layer rounds it once
    assert torch.equal(plain.self_attn.q_proj.weight, expected)
    # A fixed input: bfloat16 rounds the two paths apart by up to ~0.06 on an unlucky draw (1 of 320 elements).
    x = torch.randn(1, 5, tiny_model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    torch.testing.assert_close(plain.mlp(x), layer.mlp(x), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("loaded", ["int4_loaded", "qwen2_blocks_loaded"])
@pytest.mark.parametrize("decoder", ["ar", "seed_stand"])
def test_sampling_on_int4_weights_follows_the_targets_distribution(request, loaded, tokenizer, decoder):
    """8,000 seeded first tokens at temperature 1.0 match the quantized model's own distribution (the
    tolerance is test_decoders' total-variation bound); a 0.8 temperature is rejected by it. Also on a
    tiny Qwen2 in a real file's block mix (Q5_0, Q8_0, Q4_1) on int8."""
    from test_decoders import empirical, encode, target_probs, tvd, tvd_tolerance

    from decoding.api.engine import Engine
    from decoding.base.values import GenRequest
    from decoding.speculation.sampling import SamplingParams

    int4_loaded = request.getfixturevalue(loaded)

    n, prompt, params = 8000, encode(tokenizer, "once upon a time"), SamplingParams(temperature=1.0)
    engine = Engine(int4_loaded, decoder)
    requests = [GenRequest(tuple(prompt), max_new_tokens=3, temperature=1.0, seed=s) for s in range(n)]
    first = [r.token_ids[0] for r in engine.generate(requests)]
    emp, p = empirical(first, len(tokenizer)), target_probs(int4_loaded.model, prompt, params)
    tol = tvd_tolerance(p, n)
    assert tvd(emp, p) < tol
    assert tvd(emp, target_probs(int4_loaded.model, prompt, SamplingParams(temperature=0.8))) > tol
