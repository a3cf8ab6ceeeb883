"""`python -m tot.rescore RUN_DIR`: a saved run re-read with the current parsers, nothing decoded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_run import FakeEngine, make_config

from tasks import Problem, make_task
from tot.rescore import answer_steps, reparse, report, rescore, revote, voted_leaves
from tot.runs.run import run
from tot.search.dvts import final_states
from tot.search.tree import ReasoningTree

REPO = Path(__file__).resolve().parents[1]
# A final step that runs past its answer, as the old parser read it (its last number: 7).
RAMBLING = " 12. Then 3 + 4 = 7 more."


def made_with_the_old_parser(out: Path, problem: str) -> None:
    """Rewrite a finished run's outputs as the parser before strict extraction wrote them: the final
    thought kept whole, the answer its last number, no extraction fields."""
    tree_path = out / "trees" / f"{problem}.json"
    tree = json.loads(tree_path.read_text())
    final = max((n for n in tree["nodes"] if n.get("answer")), key=lambda n: n["id"])
    final.update(raw=RAMBLING, text="The answer is" + RAMBLING)
    tree_path.write_text(json.dumps(tree))
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for r in records:
        r.pop("answers"), r.pop("correct_by")
        if r["id"] == problem:
            r.update(answer="7", correct=False)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = json.loads((out / "summary.json").read_text())
    summary.pop("accuracy_by")
    summary["accuracy"] = sum(r["correct"] for r in records) / len(records)
    (out / "summary.json").write_text(json.dumps(summary))


def test_rescore_applies_the_current_parsers_to_a_saved_run(tmp_path):
    cfg = make_config("data.limit=3")
    run(cfg, tmp_path, engine=FakeEngine(), progress=False)  # gold 12: bundled-1 only
    made_with_the_old_parser(tmp_path, "bundled-1")

    done = rescore(tmp_path)
    old, new, changes = done.before, done.after, done.changes
    assert [c.id for c in changes] == ["bundled-1"]
    assert "answer '7' -> '12', correct False -> True" in changes[0].line()
    assert (old["accuracy"], new["accuracy"]) == (0.0, 1 / 3)
    assert new["accuracy_by"] == {"strict": 1 / 3, "flexible": 0.0}
    record = next(json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines())
    assert record["answers"] == {"strict": "12", "flexible": "7"} and record["correct_by"]["strict"]
    tree = json.loads((tmp_path / "trees" / "bundled-1.json").read_text())
    final = max((n for n in tree["nodes"] if n.get("answer")), key=lambda n: n["id"])
    assert final["text"] == "The answer is" + RAMBLING  # the thought as the model wrote it
    assert json.loads((tmp_path / "summary.json").read_text())["accuracy"] == 1 / 3
    assert rescore(tmp_path).changes == []  # a second pass changes nothing

    proc = subprocess.run(
        [sys.executable, "-m", "tot.rescore", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "0 of 3 problems changed" in proc.stdout


def test_rescore_keeps_what_describes_the_run_and_refuses_a_folder_without_trees(tmp_path):
    cfg = make_config("data.limit=3")
    run(cfg, tmp_path, engine=FakeEngine(), progress=False)
    summary = tmp_path / "summary.json"
    described = {**json.loads(summary.read_text()), "activations": "int8", "memory": {"kv_gb": 1.5}, "custom": [1]}
    summary.write_text(json.dumps(described))
    rescore(tmp_path)
    assert json.loads(summary.read_text()) == described  # nothing changed: every field as it was

    (tmp_path / "trees" / "bundled-2.json").unlink()
    assert "1 of them kept as recorded: no tree" in report(rescore(tmp_path))
    for tree in (tmp_path / "trees").iterdir():
        tree.unlink()
    results = (tmp_path / "results.jsonl").read_bytes()
    command = [sys.executable, "-m", "tot.rescore", str(tmp_path)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: none of the 3 problems in ") and "nothing rewritten" in lines[0]
    assert (tmp_path / "results.jsonl").read_bytes() == results and json.loads(summary.read_text()) == described


def test_rescore_bad_run_dir_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tot.rescore", str(tmp_path / "nope")], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"error: {tmp_path / 'nope'} has no summary.json; give an output directory of python -m tot.solve"
    )


def test_dvts_vote_is_taken_again_on_the_reread_answers():
    """Three subtrees' final answers; the old parser read the first as 7 (its last number), so 7
    won the vote (2 + 4 against 3); read as stated (12), 12 wins (2 + 3 against 4)."""
    task = make_task("gsm8k", 1, {"thoughts": "subquestions"})  # raw replies after "The answer is"
    problem = Problem("p", "How many?", "12")
    tree = ReasoningTree(problem.question)
    finals = []
    for k, (raw, value) in enumerate([(" 12. Then 7.", 2.0), (" 7.", 4.0), (" 12.", 3.0)]):
        node = tree.add(tree.root, "The answer is" + raw, raw=raw, value=value, subtree=k, chosen=True)
        finals.append(node)
    tree.mark_answer(finals[1])  # the old vote's winner
    reparse(task, problem, tree)
    revote(task, problem, tree, final_states(tree))
    assert [n for n in finals if tree[n].answer] == [finals[2]]
    assert task.answer(problem, answer_steps(tree)) == "12"


def test_best_of_n_votes_are_taken_again_and_value_choices_are_kept():
    """A majority over three whole solutions: the stated answers are 12, 7 and 12 (the first rambles
    on to a 7); the old winner 7 gives way to 12, the first solution that states it."""
    task = make_task("gsm8k", 4, {})
    problem = Problem("p", "How many?", "12")
    tree = ReasoningTree(problem.question)
    leaves = []
    for i, text in enumerate(["3 x 4 = 12. The answer is 12. Then 7.", "The answer is 7.", "So 12. The answer is 12."]):
        leaves.append(tree.add(tree.root, text, solution=i, reply=text, value=1.0, terminal=True, chosen=True))
    tree.mark_answer(leaves[1])
    voted = voted_leaves("best_of_n", {"best_of_n": {"aggregate": "majority"}})
    assert voted is not None and voted(tree) == leaves
    revote(task, problem, tree, voted(tree))
    assert [n for n in leaves if tree[n].answer] == [leaves[0]]
    assert voted_leaves("best_of_n", {"best_of_n": {"aggregate": "best"}}) is None
    assert voted_leaves("bfs", {}) is None
