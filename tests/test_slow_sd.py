"""decoder=sd on the embedded model through the ToT CLI: greedy trees equal decoder=ar's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_sd_trees_equal_ar_trees(tmp_path):
    common = ["model=smollm2-135m", "task=gsm8k", "search=bfs", "task.depth=2", "data.limit=1", "gen.temperature=0"]
    common += ["gen.max_thought_tokens=32", "gen.max_eval_tokens=16"]
    runs = {}
    for name, extra in {
        "ar": ["decoder=ar"],
        "sd": ["decoder=sd", "draft.path=self", "draft_tree.k_config=[2,2,1]", "verify.plan=fixed"],
    }.items():
        run_dir = tmp_path / name
        cmd = [sys.executable, "-m", "tot.solve", *common, *extra, f"hydra.run.dir={run_dir}"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = run_dir
    proc = subprocess.run(
        [sys.executable, "-m", "tot.compare", str(runs["ar"]), str(runs["sd"])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1/1 trees identical" in proc.stdout
    summary = json.loads((runs["sd"] / "summary.json").read_text())
    # The target drafting for itself at temperature 0 accepts nearly every draft (whole trees: the
    # fixed plan; the goodput plan would rightly refuse drafts that cost a target forward per level).
    assert summary["acceptance_length"] > 3.0
    assert summary["decoder"] == "sd"
