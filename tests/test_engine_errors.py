"""Bad input to the backend ends in a clear error that names the value, not in a traceback deep inside."""

from __future__ import annotations

import asyncio

import pytest
import torch

from decoding.base.errors import BackendError, ConfigError
from decoding.base.values import GenRequest, Group
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


# --- every field of a request checked for its type and value, named --------------------------------


@pytest.mark.parametrize(
    "kwargs, error, named",
    [
        ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens=2.5 must be an integer"),
        ({"max_new_tokens": "8"}, TypeError, "max_new_tokens='8'"),
        ({"max_new_tokens": True}, TypeError, "max_new_tokens=True"),
        ({"temperature": float("nan")}, ValueError, "temperature=nan must be a finite"),
        ({"temperature": "0.5"}, TypeError, "temperature='0.5' must be a number"),
        ({"temperature": 1e-30}, ValueError, "temperature=1e-30 is too small"),
        ({"top_p": float("inf")}, ValueError, "top_p=inf"),
        ({"top_k": 1.0}, TypeError, "top_k=1.0"),
        ({"seed": -1}, ValueError, "seed=-1"),
        ({"seed": 2**64}, ValueError, "seed="),
        ({"stop": [1]}, TypeError, "stop=.* holds 1"),
        ({"stop": b"x"}, TypeError, "stop must be a string"),
        ({"stop": [""]}, ValueError, "empty string"),
        ({"choices": ["a", None]}, TypeError, "choices=.* holds None"),
        ({"group": "g"}, TypeError, "group='g' must be a Group"),
        ({"prefix": 3}, TypeError, "prefix=3"),
        ({"logprobs": 1}, TypeError, "logprobs=1 must be True or False"),
        ({"keep": "yes"}, TypeError, "keep='yes'"),
        ({"top_logprobs": 2.0, "logprobs": True}, TypeError, "top_logprobs=2.0"),
        ({"context": [1.5]}, TypeError, r"context\[0\]=1.5"),
    ],
)
def test_every_field_is_checked_by_type_and_value(kwargs, error, named):
    with pytest.raises(error, match=named):
        GenRequest("hi", **kwargs)


@pytest.mark.parametrize(
    "prompt, error, named",
    [
        ([5, "a"], TypeError, r"prompt\[1\]='a' is not a token id"),
        ([5, -1], ValueError, r"prompt\[1\]=-1 is a negative token id"),
        (None, TypeError, "prompt is a NoneType"),
        (5, TypeError, "prompt is a int"),
    ],
)
def test_a_prompt_is_text_or_token_ids(prompt, error, named):
    with pytest.raises(error, match=named):
        GenRequest(prompt)


def test_numbers_of_other_integer_and_real_types_are_taken_as_python_numbers():
    import numpy as np

    r = GenRequest(np.array([5, 6]).tolist(), max_new_tokens=np.int64(3), temperature=np.float32(0.5), seed=np.int32(7))
    assert (r.max_new_tokens, r.seed) == (3, 7) and type(r.max_new_tokens) is int and type(r.temperature) is float
    assert GenRequest((np.int64(5),)).prompt == (5,)


# --- what the engine checks against the model, and what it guarantees after a failure ---------------


def test_token_ids_outside_the_vocabulary_are_refused_and_the_engine_serves_on(make_engine):
    engine = make_engine("ar")
    vocab = engine.target.vocab_size
    with pytest.raises(ValueError, match=rf"prompt\[1\]={vocab} is outside the model's vocabulary of {vocab}"):
        engine.generate([GenRequest([5, vocab], max_new_tokens=3)])
    with pytest.raises(ValueError, match=r"context\[0\]"):
        engine.generate([GenRequest("next", context=(vocab + 7,), max_new_tokens=3)])
    fresh = make_engine("ar").generate([GenRequest("the cat", max_new_tokens=9)])
    assert [r.token_ids for r in engine.generate([GenRequest("the cat", max_new_tokens=9)])] == [fresh[0].token_ids]


def test_choices_longer_than_the_context_are_refused_not_left_hanging(make_engine):
    engine = make_engine("ar")
    with pytest.raises(BackendError, match=r"its choices' .* tokens exceeds the model's context of 512"):
        engine.generate([GenRequest((5,) * 300, choices=("x y " * 200, "b"))])


@pytest.mark.parametrize("given", ["the cat", GenRequest("the cat"), [GenRequest("a"), "b"], None])
def test_generate_says_what_it_takes(make_engine, given):
    from tot.search.base import run_sync

    engine = make_engine("ar")
    with pytest.raises(TypeError, match=r"^generate(: requests\[1\] is a str,)? .*GenRequest"):
        engine.generate(given)
    with pytest.raises(TypeError, match=r"^agenerate(: requests\[1\] is a str,)? .*GenRequest"):
        run_sync(engine.agenerate(given))


STAGES = {
    "plan": ("decoding.schedules.step", "plan_drafts"),
    "pack": ("decoding.schedules.step", "pack"),
    "accept": ("decoding.schedules.step", "accept"),
    "commit": ("decoding.schedules.step", "commit"),
    "forward": ("decoding.runtime.runner.ModelRunner", "score"),
}
REQUESTS = [("the cat", 18), ("hello world and more", 6), ("a", 25), ("once upon a time", 12)]


class Injected(RuntimeError):
    pass


def inject(monkeypatch, stage: str, when) -> None:
    """Make `stage` of the decode step raise Injected whenever `when(args)` holds (the stage's own
    arguments); the draft stage is the drafter's `draft` call."""
    import importlib

    module, name = STAGES.get(stage, ("decoding.drafters.stand.StandDrafter", "draft"))
    path, _, cls = module.rpartition(".")
    owner = getattr(importlib.import_module(path), cls) if cls[0].isupper() else importlib.import_module(module)
    real = getattr(owner, name)

    def faulty(*args, **kwargs):
        if when(args):
            raise Injected(f"{stage} failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, faulty)


def requests(seed: int = 0) -> list[GenRequest]:
    return [GenRequest(p, max_new_tokens=m, temperature=0.8, seed=seed + i) for i, (p, m) in enumerate(REQUESTS)]


@pytest.mark.parametrize("stage", ["plan", "draft", "pack", "forward", "accept", "commit"])
def test_a_fault_at_any_stage_of_a_step_leaves_the_engine_as_fresh(stage, loaded, monkeypatch):
    """A fault injected once at each stage fails the call; the engine's rows are empty, its KV blocks
    back (paged: only the prefix store holds any), no pin or queued sequence left, and the next call's
    tokens are a fresh engine's."""
    import dataclasses

    from decoding.api.engine import Engine

    paged = dataclasses.replace(loaded, paged_kv=True)
    expected = [r.token_ids for r in Engine(paged, "seed_stand").generate(requests())]
    engine = Engine(paged, "seed_stand")
    engine.generate([GenRequest("warm up", max_new_tokens=4)])
    fired = []
    inject(monkeypatch, stage, lambda args: not fired and not fired.append(1))
    with pytest.raises(Injected, match=f"{stage} failed"):
        engine.generate(requests())
    assert fired and not engine.decoder.busy
    assert int(engine.decoder.cache.lens.sum()) == 0
    pool = engine.target.pool
    if pool is not None:
        assert pool.used == pool.held_by_store_alone()
    assert engine.target.prefixes.pinned == 0
    assert [r.token_ids for r in engine.generate(requests())] == expected


@pytest.mark.parametrize("transient", [True, False])
def test_a_failed_step_fails_only_the_call_at_fault(transient, loaded, monkeypatch):
    """Two calls decode together; a step fails. Transient (once): both calls run again alone and return
    a fresh engine's tokens. Persistent, whenever one call's sequence is in the forward: that call hears
    of it, the other returns a fresh engine's tokens, and the engine serves on."""
    from decoding.api.engine import Engine
    from tot.search.base import run_sync

    good, bad = requests(), [GenRequest("poison", max_new_tokens=30, temperature=0.8, seed=666)]
    expected = [r.token_ids for r in Engine(loaded, "seed_stand").generate(good)]
    engine = Engine(loaded, "seed_stand")
    fired: list[int] = []

    def at_fault(args) -> bool:
        seeds = {slot.seq.seed for slot in engine.decoder.slots.values()}
        if 666 not in seeds or (transient and (fired or len(seeds) == 1)):  # transient: once, both calls in
            return False
        fired.append(1)
        return True

    inject(monkeypatch, "forward", at_fault)

    async def both():
        return await asyncio.gather(engine.agenerate(good), engine.agenerate(bad), return_exceptions=True)

    done, failed = run_sync(both())
    assert fired
    assert [r.token_ids for r in done.results] == expected
    if transient:
        assert len(failed.results) == 1
    else:
        assert isinstance(failed, Injected)
    assert not engine.decoder.busy
    assert [r.token_ids for r in run_sync(engine.agenerate(good)).results] == expected


def test_a_cancelled_call_among_others_leaves_them_decoding(loaded):
    """A caller gives up while its sequences decode beside another call's: the other call returns a
    fresh engine's tokens, and the engine serves the next call."""
    from decoding.api.engine import Engine
    from tot.search.base import run_sync

    good = requests()
    expected = [r.token_ids for r in Engine(loaded, "seed_stand").generate(good)]
    engine = Engine(loaded, "seed_stand")

    async def scene():
        doomed = asyncio.ensure_future(engine.agenerate([GenRequest("long one", max_new_tokens=60, seed=3)]))
        kept = asyncio.ensure_future(engine.agenerate(good))
        for _ in range(40):  # a few steps in
            await asyncio.sleep(0)
        doomed.cancel()
        return await kept, doomed

    done, doomed = run_sync(scene())
    assert doomed.cancelled()
    assert [r.token_ids for r in done.results] == expected
    assert [r.token_ids for r in run_sync(engine.agenerate(good)).results] == expected


def test_one_caller_at_a_time_the_others_told_so(loaded):
    """A second thread's generate, or an awaited call from another thread's event loop, while the
    engine decodes: a BackendError saying to give each thread an engine; the first call's tokens are a
    fresh engine's."""
    import threading

    from decoding.api.engine import Engine

    long = [GenRequest(f"long {i}", max_new_tokens=200, temperature=0.7, seed=i) for i in range(4)]
    expected = [r.token_ids for r in Engine(loaded, "ar").generate(long)]
    engine = Engine(loaded, "ar")
    # The engine's decoding holds at its first step until the other callers have been answered: no race
    # with how fast the tiny model decodes.
    started, answered = threading.Event(), threading.Event()
    real_step = engine.decoder.step

    def held_step():
        started.set()
        assert answered.wait(30), "the other callers were not answered"
        engine.decoder.step = real_step
        return real_step()

    engine.decoder.step = held_step
    got: list = []
    first = threading.Thread(target=lambda: got.append([r.token_ids for r in engine.generate(long)]))
    first.start()
    assert started.wait(30)
    with pytest.raises(BackendError, match="another thread"):
        engine.generate([GenRequest("hi", max_new_tokens=3)])
    with pytest.raises(BackendError, match="another thread"):
        asyncio.run(engine.agenerate([GenRequest("hi", max_new_tokens=3)]))
    answered.set()
    first.join()
    assert got == [expected]

    refused: list = []
    started.clear()
    answered.clear()
    engine.decoder.step = held_step

    def other_loop() -> None:
        assert started.wait(30)
        try:
            asyncio.run(engine.agenerate([GenRequest("hi", max_new_tokens=3)]))
        except BackendError as e:
            refused.append(str(e))
        finally:
            answered.set()

    thread = threading.Thread(target=other_loop)
    thread.start()
    done = asyncio.run(engine.agenerate(long))  # its first step waits for the other loop's answer
    thread.join()
    assert [r.token_ids for r in done.results] == expected
    assert refused and "another event loop" in refused[0]


@pytest.mark.parametrize(
    "kwargs, error, named",
    [
        ({"temperature": 10**400}, ValueError, "temperature=.* is too large to be a float"),
        ({"group": Group(problem="p")}, None, ""),
    ],
)
def test_odd_numbers_and_groups(kwargs, error, named):
    if error is None:
        GenRequest("x", **kwargs)
    else:
        with pytest.raises(error, match=named):
            GenRequest("x", **kwargs)
    with pytest.raises(TypeError, match=r"Group\.problem=\['p'\] must be text"):
        Group(["p"])


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(make_engine):
    greedy = make_engine("ar").generate([GenRequest("abc", max_new_tokens=6)])[0].token_ids
    (got,) = make_engine("ar").generate([GenRequest("abc", temperature=0.8, top_p=1e-46, max_new_tokens=6, seed=3)])
    assert got.token_ids == greedy


def test_what_the_tokenizer_cannot_spell_and_what_is_not_a_model_are_named(make_engine, loaded):
    from decoding.api.engine import Engine

    with pytest.raises(BackendError, match=r"choices\[1\]='🐱' is no token"):
        make_engine("ar").generate([GenRequest("Pick: ", choices=["yes", "🐱"])])
    with pytest.raises(TypeError, match="Engine's loaded is a str, not a loaded model: give load_model"):
        Engine("meta-llama/Llama-3.2-1B", "ar")
