"""A Hydra sweep over two tasks and two decoders with the joblib launcher (parallel jobs), gathered by
tot.collect: the sweep the README documents, on the embedded model with tiny settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_joblib_sweep_over_tasks_and_decoders(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="the sweeps extra (hydra-joblib-launcher)")
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable, "-m", "tot.solve", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
        "model=smollm2-135m", "task=gsm8k,blocksworld", "decoder=ar,seed_stand", "data.limit=1", "task.depth=1",
        "search=bfs", "search.n_thoughts=2", "gen.max_thought_tokens=8", "gen.max_eval_tokens=4", "gen.temperature=0",
        f"hydra.sweep.dir={sweep}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    runs = sorted(p.parent.name for p in sweep.rglob("summary.json"))
    assert runs == ["0_gsm8k_ar", "1_gsm8k_seed_stand", "2_blocksworld_ar", "3_blocksworld_seed_stand"]
    collected = subprocess.run(
        [sys.executable, "-m", "tot.collect", str(sweep)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert collected.returncode == 0, collected.stderr
    combined = json.loads((sweep / "collected.json").read_text())["combined"]
    assert {(r["task"], r["decoder"]) for r in combined} == {
        (t, d) for t in ("gsm8k", "blocksworld") for d in ("ar", "seed_stand")
    }
    # Lossless at temperature 0: both decoders generated the same tokens for each task.
    tokens = {(r["task"], r["decoder"]): r["generated_tokens"] for r in combined}
    assert tokens["gsm8k", "ar"] == tokens["gsm8k", "seed_stand"]
    assert tokens["blocksworld", "ar"] == tokens["blocksworld", "seed_stand"]
