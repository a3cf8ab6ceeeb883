"""decoding.beside_llama_cpp: its prompt from held text, both sides' timed calls (the project's on the
tiny model, llama.cpp's on the embedded GGUF file) and its config checks."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from decoding.api.engine import Engine
from decoding.base.errors import ConfigError
from decoding.base.options import held_rows
from decoding.beside_llama_cpp import (
    BesideConfig,
    llama_decode,
    llama_prompt_s,
    project_decode,
    project_prompt_s,
    prompt_ids,
)
from decoding.runtime.models import embedded_file

ROWS = [{"question": "a b c", "answer": "d e"}, {"question": "f g", "answer": "h i j"}]


def test_the_prompt_is_the_held_texts_in_order_cut_to_its_length():
    tokenize = lambda text: [ord(c) for c in text if c.isalpha()]  # noqa: E731
    assert prompt_ids(tokenize, ROWS, 7) == [ord(c) for c in "abcdefg"]
    with pytest.raises(ConfigError, match=r"prompt_tokens=11: the held texts have only 10 tokens"):
        prompt_ids(tokenize, ROWS, 11)


def test_the_projects_side_computes_the_prompt_and_decodes(loaded):
    engine = Engine(loaded)
    assert project_prompt_s(engine.target, list(range(5, 40))) > 0
    n, seconds = project_decode(engine, "one two three", 6)
    assert 1 <= n <= 6 and seconds > 0


def test_llama_cpps_side_evaluates_the_prompt_and_stops_at_the_token_count():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python: make setup installs it")
    llm = llama_cpp.Llama(model_path=str(embedded_file("smollm2-135m")), n_ctx=256, n_threads=2, verbose=False)
    ids = llm.tokenize(b"Natalia sold clips to 48 of her friends in April.", add_bos=False)
    assert llama_prompt_s(llm, ids) > 0 and llm.n_tokens == len(ids)
    n, seconds = llama_decode(llm, ids, 5)
    assert n == 5 and seconds > 0 and llm.n_tokens == len(ids) + 4  # the fifth token is sampled, not evaluated


def test_bad_settings_are_refused_in_one_line(tmp_path):
    base = {"model": {"path": "smollm2-135m"}, "decoder": "ar", "prompt_tokens": 128, "new_tokens": 8, "repeats": 1}
    with pytest.raises(ConfigError, match=r"data=.*missing.jsonl does not exist"):
        BesideConfig.from_omegaconf(OmegaConf.create({**base, "data": str(tmp_path / "missing.jsonl")}))
    held = tmp_path / "held.jsonl"
    held.write_text('{"question": "q", "answer": "a"}\n')
    with pytest.raises(ConfigError, match=r"repeats=0 must be a positive integer"):
        BesideConfig.from_omegaconf(OmegaConf.create({**base, "data": str(held), "repeats": 0}))
    held.write_text('{"question": "q", "answer": "a"}\n{"question": "q"\n')
    with pytest.raises(ConfigError, match=r"held.jsonl line 2 is not a JSON object with question and answer"):
        held_rows(str(held))
