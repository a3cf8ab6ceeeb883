"""Real shapes without their weights: `python -m decoding.shapes` and `model.init=random`."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from test_cli import REPO, subprocess_env
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from decoding.base.errors import BackendError
from decoding.generate import read_prompts
from decoding.runtime.models import ModelSpec, load_model
from decoding.shapes import SHAPES, write_shape


@pytest.mark.parametrize(("name", "billions"), [("llama-3.2-1b", 1.24), ("llama-3.1-8b", 8.03)])
def test_shapes_have_their_models_parameter_counts(tmp_path, tokenizer, name, billions):
    folder = write_shape(name, tmp_path / name, tokenizer)
    assert (folder / "tokenizer.json").is_file() and not list(folder.glob("*.safetensors"))
    with torch.device("meta"):  # the architecture alone, no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    params = sum(p.numel() for p in model.parameters()) / 1e9
    assert params == pytest.approx(billions, abs=0.01)
    assert json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    # The timing prompts beside it, as decoding.generate reads them: one per row of a 32-row batch.
    rows = read_prompts(folder / "prompts.jsonl")
    assert len(rows) == len({r.id for r in rows}) == len({r.prompt for r in rows}) == 32


def test_random_init_builds_the_folders_config_on_the_device(tmp_path, tokenizer):
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    spec = ModelSpec(path=str(tmp_path), init="random", device="cpu", weights="float32", attention="sdpa")
    a, b = load_model(spec), load_model(spec)
    assert a.model.config.hidden_size == 32 and a.model.device.type == "cpu"
    # seeded: two loads are one model, so runs on random weights repeat
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    with pytest.raises(BackendError, match=r"missing does not exist \(and is not a Hugging Face id\)"):
        load_model(ModelSpec(path=str(tmp_path / "missing"), init="random", device="cpu"))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"init": "zeros"}, "model.init='zeros' is not one of checkpoint, random"),
        ({"init": "random"}, "model.init=random builds a checkpoint folder's config.json, not smollm2-135m"),
    ],
)
def test_init_errors(options, message):
    with pytest.raises(BackendError, match=re.escape(message)):
        ModelSpec(**options)


def test_shapes_command(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "decoding.shapes", "llama-9", str(tmp_path)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.strip() == f"error: shape 'llama-9' is not one of {', '.join(SHAPES)}"
