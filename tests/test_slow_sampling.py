"""Sampling on the embedded model through `python -m decoding.generate`: every decoder returns `hf`'s
samples under each matched rule, and coupled drafts of the target itself are all accepted until each
sequence ends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Solve it step by step.",
    "Write one sentence about the sea.",
    "List three prime numbers and explain why each is prime.",
]
COMMON = ["gen.temperature=0.6", "gen.max_new_tokens=40"]


def generate(
    tmp_path: Path, name: str, *overrides: str, common: list[str] = COMMON
) -> tuple[list[list[int]], dict, list[dict]]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": q}) + "\n" for i, q in enumerate(QUESTIONS)))
    out = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "decoding.generate", f"prompts={prompts}", f"out={out}", *common, *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (tmp_path / f"{name}.log").write_text(proc.stdout + proc.stderr)
    rows = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])
    return [r["token_ids"] for r in rows], json.loads(Path(f"{out}.summary.json").read_text()), rows


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["match_gumbel", "match_multinomial"])
def test_every_decoder_samples_what_hf_samples_on_the_embedded_model(tmp_path, rule):
    hf, _, _ = generate(tmp_path, "hf", "decoder=hf", f"verify.rule={rule}")
    assert len({tuple(t) for t in hf}) == len(QUESTIONS)
    for name in ("ar", "seed_stand", "pld"):
        tokens, _, _ = generate(tmp_path, name, f"decoder={name}", f"verify.rule={rule}")
        assert tokens == hf, name
    # The target drafting for itself, chains of 4, every tree verified whole.
    k = 4
    extra = ["decoder=sd", "draft.path=self", f"draft_tree.k_config=[{','.join(['1'] * k)}]", "verify.plan=fixed"]
    tokens, stats, rows = generate(tmp_path, "self", *extra, "verify.max_tokens=null", f"verify.rule={rule}")
    assert tokens == hf
    if rule == "match_gumbel":
        # Coupled, each draft is the target's own sample: every step but a sequence's last keeps its
        # whole chain, and the last loses only drafts past the sequence's end of text.
        for row in rows:
            s = row["stats"]
            assert s["accepted_tokens"] >= (s["verify_steps"] - 1) * k, row["id"]
            lost = s["drafted_tokens"] - s["accepted_tokens"]
            assert lost == 0 if row["finish_reason"] == "length" else lost < k, row["id"]
    else:
        # Blind to the target's stream, a draft is kept about p(x) of the time.
        assert stats["accepted_tokens"] / stats["drafted_tokens"] < 0.8


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_every_decoder_returns_hfs_tokens_with_int8_activations_on_the_embedded_model(tmp_path, temperature):
    """model.activations=int8 (the 4-bit layers and the Q8_0 head on csrc/q4_int8.cpp): greedy and
    sampled (match_gumbel), each decoder's tokens are `hf`'s on the same loaded model."""
    common = [f"gen.temperature={temperature}", "gen.max_new_tokens=40"]
    hf, _, _ = generate(tmp_path, "hf", "decoder=hf", "model.activations=int8", common=common)
    assert "x int8 activations" in (tmp_path / "hf.log").read_text()  # the load took the setting
    for name in ("ar", "seed_stand", "pld"):
        tokens, _, _ = generate(tmp_path, name, f"decoder={name}", "model.activations=int8", common=common)
        assert tokens == hf, name
