"""decoding/prepack.py: prepacked linear layers give the plain layers' logits and the decoders' greedy
outputs stay generate's; training still gets gradients; model.prepack reaches load_model."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import UNCAPPED, with_linear_kernel
from test_decoders import BUDGETS, EOS_ID, PROMPTS, encode, reference_greedy

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine
from decoding.base.errors import BackendError
from decoding.base.values import GenRequest
from decoding.runtime.models import LoadedModel, ModelSpec, load_model
from decoding.runtime.prepack import PrepackedLinear, prepack_linears, prepack_supported
from decoding.schedules.rounds import RoundsOptions
from decoding.trees.policies import DraftTreeOptions

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


@pytest.fixture(scope="module")
def float32_model(tiny_model):
    """Prepacking serves model.weights=float32 (the tiny model is prepared as the bfloat16 default)."""
    return with_linear_kernel(tiny_model, "aten").float()


@pytest.fixture(scope="module")
def packed_model(float32_model):
    model = copy.deepcopy(float32_model)
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert prepack_linears(model) == n_linear > 0
    return model


def test_prepacked_logits_equal_the_plain_ones(float32_model, packed_model):
    assert sum(isinstance(m, PrepackedLinear) for m in packed_model.modules()) > 0
    assert packed_model.state_dict().keys() == float32_model.state_dict().keys()
    ids = torch.randint(3, 100, (3, 17))
    with torch.inference_mode():
        for x in (ids, ids[:1, :1], ids[:, :1]):  # many rows, one row (the plain path), a batch of one token
            torch.testing.assert_close(packed_model(x).logits, float32_model(x).logits, atol=1e-4, rtol=1e-4)


def test_the_packed_path_is_taken_only_for_inference_over_several_rows(packed_model, monkeypatch):
    layer = next(m for m in packed_model.modules() if isinstance(m, PrepackedLinear))
    calls = []
    real = torch.ops.aten.mkldnn_linear

    class Spy:
        @staticmethod
        def mkldnn_linear(x, *rest):
            calls.append(x.shape[0])
            return real(x, *rest)

    monkeypatch.setattr(torch.ops, "aten", Spy)
    try:
        with torch.inference_mode():
            layer(torch.randn(1, 1, layer.in_features))
            layer(torch.randn(2, 3, layer.in_features))
        x = torch.randn(2, 3, layer.in_features, requires_grad=True)
        out = layer(x)
    finally:
        monkeypatch.undo()
    assert calls == [6]  # one row: plain; 6 rows at inference: packed; with gradients: plain
    out.sum().backward()  # EDD training backpropagates through the target's frozen LM head
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_decoders_on_a_prepacked_target_return_generates_greedy_output(packed_model, tokenizer):
    loaded = LoadedModel(packed_model, tokenizer, torch.device("cpu"), use_chat_template=False, source="packed")
    refs = [reference_greedy(packed_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in zip(PROMPTS, BUDGETS)]
    requests = [GenRequest(p, max_new_tokens=m) for p, m in zip(PROMPTS, BUDGETS)]
    sd = DecoderConfig(
        "sd", DraftTreeOptions((2, 2, 1)), RoundsOptions(2), draft=ModelSpec("self", key="draft"), verify=UNCAPPED
    )
    configs = ["ar", "stand", "seed_stand", sd]
    for config in configs:
        engine = Engine(loaded, config, loaded)  # sd drafts with the target itself
        assert [r.token_ids for r in engine.generate(requests)] == refs, config


def test_model_prepack_option(tmp_path, tiny_model, tokenizer):
    from test_cli import save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / "tiny", tiny_model, tokenizer)
    on = load_model(ModelSpec(str(path), device="cpu", weights="float32")).model
    off = load_model(ModelSpec(str(path), device="cpu", weights="float32", prepack=False)).model
    assert any(isinstance(m, PrepackedLinear) for m in on.modules())
    assert not any(isinstance(m, PrepackedLinear) for m in off.modules())
    assert prepack_supported(on) and not prepack_supported(on.to(torch.bfloat16))
    with pytest.raises(BackendError, match=r"model\.prepack='maybe' must be true or false"):
        ModelSpec(prepack="maybe")
