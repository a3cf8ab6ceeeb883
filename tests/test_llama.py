"""The Llama forward of decoding/runtime/llama.py (decoder layers in one C++ call) computes the bits of
the `transformers` forward of the same loaded model: prefill of ragged rows, a decode step, a draft
tree, a subset of rows verified in place, the captured hidden states; and it is used only where it
would. Also the key layout the invariant attention reads (positions contiguous) survives the cache's
row operations."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_model
from helpers import select_rows, with_linear_kernel
from test_quant import int4_copy, k_quant_blocks, mixed_blocks
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from decoding.runtime.kv_cache import RowKVCache
from decoding.runtime.llama import Layers
from decoding.runtime.models import prepare_for_inference
from decoding.runtime.norm import RowsRMSNorm
from decoding.runtime.prefix_cache import PrefixCache
from decoding.runtime.quant import use_k_block
from decoding.runtime.rows_linear import RowsLinear, dense_in_bfloat16
from decoding.runtime.runner import ModelRunner
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.verify import pack

PROMPTS = [[5 + (7 * i + j) % 90 for i in range(n)] for j, n in enumerate((9, 23, 70))]


@pytest.fixture(
    scope="module",
    params=[
        "bfloat16-aten",
        "bfloat16-rows",
        "bfloat16-llama-norms",
        "gguf-int4",
        "gguf-int4-int8",
        "gguf-mixed-int8",
        "qwen2-bfloat16-rows",
        "qwen2-gguf-int4-int8",
        "qwen2-gguf-blocks-int8",
        "qwen2-gguf-kquants-int8",
        "qwen2-gguf-kquants-int8_256",
        "qwen2-gguf-kquants-int8_256-kept",
    ],
)
def model(request, tiny_model, tiny_qwen2) -> torch.nn.Module:
    param = request.param.removeprefix("qwen2-")
    if param != request.param:
        tiny_model = tiny_qwen2
    if param == "gguf-blocks-int8":
        return mixed_blocks(tiny_model)
    if param.startswith("gguf-kquants-int8"):  # K-quants need 256 inputs: a wider model
        model = k_quant_blocks(build_model(tiny_model.config.vocab_size, arch="qwen2", hidden=256))
        if param.endswith("256"):  # their input with a scale per super-block (model.activations=int8_256)
            assert use_k_block(model, 256) > 0
        if param.endswith("kept"):  # ... but one layer's MLP input per 32 (a file's numerics record)
            kept = ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")
            assert use_k_block(model, 256, kept) > 0 and model.model.layers[0].mlp.up_proj.k_block == 32
        return model
    if param == "gguf-mixed-int8":
        return mixed_int8(tiny_model)
    if param.startswith("gguf-int4"):
        return int4_copy(tiny_model, "int8" if param.endswith("int8") else "float")
    if param == "bfloat16-llama-norms":  # transformers' own norms (ATen ops), not RowsRMSNorm
        return llama_norms(tiny_model)
    return with_linear_kernel(tiny_model, param.removeprefix("bfloat16-"))


def mixed_int8(tiny_model: torch.nn.Module) -> torch.nn.Module:
    """int8 activations in a file of mixed types (a Q4_K_M file's Q6_K tensors): each layer's down
    projection dense, as the load path leaves it (bfloat16 on the row-invariant kernel, in a float32 model)."""
    model = int4_copy(tiny_model, "int8")
    for layer, source in zip(model.model.layers, tiny_model.model.layers, strict=True):
        dense = torch.nn.Linear(source.mlp.down_proj.in_features, source.mlp.down_proj.out_features, bias=False)
        dense.weight.data = source.mlp.down_proj.weight.detach().float()
        layer.mlp.down_proj = dense
    assert dense_in_bfloat16(model) == len(model.model.layers)
    assert all(type(layer.mlp.down_proj) is RowsLinear for layer in model.model.layers)
    return model


def llama_norms(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        if type(module) is RowsRMSNorm:
            norm = LlamaRMSNorm(module.weight.shape[0], eps=module.variance_epsilon)
            norm.weight = module.weight
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, norm)
    return model


def _forwards(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits and hidden states of a prefill, a decode step, a tree and an in-place subset verify."""
    runner.capture_hidden(0)
    cache = runner.new_cache(len(PROMPTS), 160)
    fill = pack(PROMPTS, [DraftTree()] * len(PROMPTS))
    first = runner.forward(cache, fill.tokens, fill.see, fill.depth)
    out = [first.logits, first.hidden]
    cache.advance(torch.tensor([len(p) for p in PROMPTS]))
    one = torch.ones(3, 1, 1, dtype=torch.bool)
    out.append(runner.forward(cache, torch.tensor([[4], [5], [6]]), one, torch.zeros(3, 1, dtype=torch.long)).logits)
    cache.advance(torch.ones(3, dtype=torch.long))
    tree = DraftTree()
    a = tree.add(11, ROOT)
    tree.add(12, ROOT)
    tree.add(13, a)
    packed = pack([[7]] * 3, [tree] * 3)
    tree_out = runner.forward(cache, packed.tokens, packed.see, packed.depth)
    out += [tree_out.logits, tree_out.hidden]
    some = pack([[8], [9]], [tree] * 2)
    out.append(runner.forward(cache, some.tokens, some.see, some.depth, rows=[2, 0]).logits)
    return out


def through_transformers(model) -> ModelRunner:
    """A runner of the same model through model(...): KV in rows of their own, which it reads."""
    runner = ModelRunner(model, paged=False)
    runner.layers = None
    return runner


def test_the_layers_compute_the_transformers_forward_bitwise(model):
    runner = ModelRunner(model)
    assert runner.layers is not None
    fast = _forwards(runner)
    reference = _forwards(through_transformers(model))
    for got, want in zip(fast, reference, strict=True):
        assert torch.equal(got, want)


def test_a_ragged_forward_computes_the_padded_forwards_bits(model):
    """Pads skipped (ModelRunner.ragged): rows of different pending lengths and tree sizes give the
    padded forward's logits at every root and tree node, and the same cache entries."""
    ragged = ModelRunner(model)
    assert ragged.ragged
    tree = DraftTree()
    a = tree.add(11, ROOT)
    tree.add(12, ROOT)
    tree.add(13, a)
    pending = [[7], [8, 9, 10], [6]]
    trees = [tree, DraftTree(), tree.prefix(1)]
    outs, caches = [], []
    for runner in (ragged, through_transformers(model)):  # pads skipped, then the padded forward
        cache = runner.new_cache(len(PROMPTS), 160)
        fill = pack(PROMPTS, [DraftTree()] * len(PROMPTS))
        runner.forward(cache, fill.tokens, fill.see, fill.depth)
        cache.advance(torch.tensor([len(p) for p in PROMPTS]))
        packed = pack(pending, trees)
        outs.append(runner.score(cache, packed, rows=[2, 0, 1]).logits)
        for b, row in enumerate([2, 0, 1]):
            cache.commit(row, packed.committed(b, [0] if len(trees[b]) else []))
        caches.append(cache)
    for got, want, t in zip(*outs, trees):
        assert got.shape[0] == 1 + len(t) and torch.equal(got, want)
    for row in range(3):
        n = int(caches[0].lens[row])
        assert n == int(caches[1].lens[row])
        assert torch.equal(caches[0].read(row, 0, n)[0][0], caches[1].read(row, 0, n)[0][0])


def test_other_models_keep_the_transformers_forward(tiny_model):
    sdpa = copy.deepcopy(tiny_model)
    sdpa.config._attn_implementation = "sdpa"
    assert Layers.of(sdpa) is None
    prepacked = with_linear_kernel(tiny_model, "aten").float()
    prepare_for_inference(prepacked, torch.device("cpu"), "float32", "invariant", prepack=True)
    assert Layers.of(prepacked) is None  # PrepackedLinear is not a projection the C++ layers know
    assert Layers.of(tiny_model) is not None


def test_keys_stored_by_position_keep_their_layout_and_values():
    cache = RowKVCache(2, 3, 2, 16, 40, torch.bfloat16, "cpu", keys_by_position=True)
    assert cache.keys[0].shape == (3, 2, 40, 16) and cache.keys[0].stride(2) == 1
    for k in cache.keys:
        k.copy_(torch.randn(k.shape))
    before = [k[[2, 0, 0]].clone() for k in cache.keys]
    select_rows(cache, torch.tensor([2, 0, 0]))
    for k, want in zip(cache.keys, before):
        assert k.stride(2) == 1 and torch.equal(k, want)
    cache.lens[:] = torch.tensor([5, 6, 7])
    src = [k[1, :, 6:9].clone() for k in cache.keys]
    cache.prepare(3)
    cache.commit(1, [0, 2])
    assert all(torch.equal(k[1, :, 6], s[:, 0]) and torch.equal(k[1, :, 7], s[:, 2]) for k, s in zip(cache.keys, src))
    store = PrefixCache()
    store.store((1, 2, 3, 4, 5), cache)
    fresh = RowKVCache(2, 1, 2, 16, 40, torch.bfloat16, "cpu", keys_by_position=True)
    store.restore(store.match((1, 2, 3, 4, 5)), fresh, 0, 0, 5)
    assert all(torch.equal(f[0, :, :5], k[0, :, :5]) for f, k in zip(fresh.keys, cache.keys))
