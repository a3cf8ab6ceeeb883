"""Bad input to the backend ends in a clear error that names the value, not in a traceback deep inside."""

from __future__ import annotations

import pytest
import torch

from decoding.base.errors import BackendError, ConfigError
from decoding.base.values import GenRequest
from decoding.runtime.models import LoadedModel, ModelSpec, load_model


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_new_tokens": -3}, "max_new_tokens=-3"),
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_p": -0.1}, "top_p=-0.1"),
        ({"top_k": -1}, "top_k=-1"),
    ],
)
def test_gen_request_validation(kwargs, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        GenRequest("hi", **kwargs)


def test_gen_request_accepts_edge_values():
    r = GenRequest([5, 6], max_new_tokens=1, temperature=0.0, top_p=1.0, top_k=0, stop="END")
    assert r.prompt == (5, 6)
    assert r.stop == ("END",)
    assert GenRequest("x", stop=["a", "b"]).stop == ("a", "b")


def test_prompt_longer_than_context(make_engine):
    engine = make_engine("ar")
    limit = engine.target.max_length
    assert limit == 512
    with pytest.raises(BackendError, match=r"510 tokens.*max_new_tokens=10.*512") as info:
        engine.generate([GenRequest((5,) * 510, max_new_tokens=10)])
    assert "\n" not in str(info.value)
    # One bad request fails the whole call before any decoding.
    with pytest.raises(BackendError, match="600 tokens"):
        engine.generate([GenRequest("a", max_new_tokens=3), GenRequest((5,) * 600, max_new_tokens=1)])
    # Exactly filling the context is fine.
    (result,) = engine.generate([GenRequest((5,) * 500, max_new_tokens=12)])
    assert len(result.token_ids) == 12


def test_text_prompt_longer_than_context(make_engine):
    engine = make_engine("hf")
    with pytest.raises(BackendError, match="exceeds the model's context of 512 tokens"):
        engine.generate([GenRequest("x" * 600, max_new_tokens=5)])


def test_unknown_decoder(loaded):
    from decoding.api.engine import Engine

    with pytest.raises(ConfigError, match=r"decoder=nope is not one of hf, ar, sd"):
        Engine(loaded, "nope")


def test_sd_without_draft_model_names_the_fix(loaded):
    from decoding.api.engine import Engine

    with pytest.raises(ConfigError, match=r"decoder=sd drafts with a draft model: set draft.path="):
        Engine(loaded, "sd")


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"device": "tpu"}, "model.device='tpu'"),
        ({"weights": "float8"}, "model.weights='float8'"),
        ({"attention": "flash"}, "model.attention='flash'"),
        ({"chat_template": "maybe"}, "model.chat_template='maybe'"),
    ],
)
def test_model_spec_validation(kwargs, named):
    with pytest.raises(BackendError, match=named):
        ModelSpec(**kwargs)


def test_model_spec_accepts_devices():
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert ModelSpec(device=device).device == device


def test_load_model_missing_directory():
    with pytest.raises(BackendError, match="/nonexistent/dir") as info:
        load_model(ModelSpec(path="/nonexistent/dir", device="cpu"))
    assert "\n" not in str(info.value)


def test_load_model_empty_directory(tmp_path):
    with pytest.raises(BackendError, match=str(tmp_path)) as info:
        load_model(ModelSpec(path=str(tmp_path), device="cpu"))
    assert "\n" not in str(info.value)


def test_load_model_missing_gguf(tmp_path):
    missing = tmp_path / "model.gguf"
    with pytest.raises(BackendError, match="does not exist"):
        load_model(ModelSpec(path=str(missing), device="cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda():
    with pytest.raises(BackendError, match="no CUDA device"):
        load_model(ModelSpec(path="/nonexistent/dir", device="cuda"))


def test_loaded_model_fixture_is_usable(loaded):
    assert isinstance(loaded, LoadedModel)
    assert loaded.tokenizer.eos_token_id == 2
    assert loaded.tokenizer.decode(loaded.tokenizer("the end")["input_ids"]) == "the end"
