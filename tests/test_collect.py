"""`tot.collect`: accuracy intervals, cost per problem, and the paired comparison with a baseline run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_run import FakeEngine, make_config

from tot.collect import main as collect_main
from tot.collect import paired, wilson
from tot.runs.run import run


def set_correct(run_dir: Path, correct: list[bool]) -> None:
    lines = (run_dir / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(correct)
    records = [{**json.loads(line), "correct": ok} for line, ok in zip(lines, correct)]
    (run_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_wilson_and_the_exact_paired_test():
    assert wilson(3, 4) == pytest.approx((0.3006, 0.9544), abs=1e-4)  # the textbook 95% interval
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
    rows = [{"id": str(i), "correct": i < 7} for i in range(10)]
    base = [{"id": str(i), "correct": i in (0, 8)} for i in range(10)]
    got = paired(rows, base)
    # Discordant: 1-6 only this (6), 8 only the baseline (1): P(X <= 1 | 7 fair coins) x 2 = 16 / 128.
    assert got == {"paired_problems": 10, "only_this": 6, "only_baseline": 1, "paired_p": pytest.approx(0.125)}
    assert paired(rows, rows)["paired_p"] == 1.0


def test_collect_compares_each_run_with_a_baseline(tmp_path, capsys):
    root = tmp_path / "runs"
    run(make_config("data.limit=4"), root / "search", engine=FakeEngine(), progress=False)
    set_correct(root / "search", [True, True, True, False])
    baseline = tmp_path / "chain"
    shutil.copytree(root / "search", baseline)
    set_correct(baseline, [False, False, True, False])
    assert collect_main([str(root), "--baseline", str(baseline)]) == 0
    (row,) = json.loads((root / "collected.json").read_text())["runs"]
    assert row["accuracy_95"] == "[0.301, 0.954]" and row["n_correct"] == 3
    assert row["tokens_per_problem"] == row["generated_tokens"] / 4
    assert (row["only_this"], row["only_baseline"], row["paired_p"]) == (2, 0, 0.5)
    assert "only_baseline" in capsys.readouterr().out
    assert collect_main([str(root), "--baseline", str(tmp_path / "none")]) == 2
    assert "--baseline" in capsys.readouterr().err


def test_a_baseline_of_another_task_or_no_shared_problem_gives_no_pairing(tmp_path, capsys):
    """A baseline of another task is refused in one line; one over other problems pairs nothing and
    prints no p-value (n/a), saying why."""
    root = tmp_path / "runs"
    run(make_config("data.limit=4"), root / "search", engine=FakeEngine(), progress=False)
    other_task = tmp_path / "other_task"
    shutil.copytree(root / "search", other_task)
    summary = json.loads((other_task / "summary.json").read_text())
    (other_task / "summary.json").write_text(json.dumps({**summary, "task": "blocksworld"}))
    assert collect_main([str(root), "--baseline", str(other_task)]) == 2
    err = capsys.readouterr().err
    assert "run search is task=gsm8k, the baseline" in err and "task=blocksworld" in err and err.count("\n") == 1

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(root / "search", elsewhere)
    lines = (elsewhere / "results.jsonl").read_text().splitlines()
    moved = [json.dumps({**json.loads(line), "id": f"train-{i}"}) for i, line in enumerate(lines)]
    (elsewhere / "results.jsonl").write_text("\n".join(moved) + "\n")
    assert collect_main([str(root), "--baseline", str(elsewhere)]) == 0
    out = capsys.readouterr().out
    assert "run search shares no problem with the baseline" in out
    (row,) = json.loads((root / "collected.json").read_text())["runs"]
    assert row["paired_problems"] == 0 and row["paired_p"] is None
    assert "| 0 | 0 | 0 | n/a |" in out
