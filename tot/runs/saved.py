"""A finished (or running) run's saved outputs, read only: its records and each problem's tree.

Read by `tot.show`, its HTML page and `tot.rescore`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tot.runs.folder import RECORD
from tot.runs.output import make_dirs, write_atomic
from tot.runs.results import TreeFiles, problem_of, read_results
from tot.search.tree import ReasoningTree

log = logging.getLogger(__name__)


class ShowError(Exception):
    """Bad input (run directory, problem id, --out): one line naming the value and the fix."""


@dataclass(frozen=True)
class SavedTree:
    """One problem of a run: its results.jsonl record (None when only the tree was saved) and tree file."""

    id: str
    record: dict[str, Any] | None
    tree_path: Path

    def header(self, tree: ReasoningTree) -> str:
        if self.record is None:
            return f"problem {self.id}: not in results.jsonl nodes={tree.graph.number_of_nodes()}"
        answer, correct = self.record.get("answer", "?"), self.record.get("correct", "?")
        return f"problem {self.id}: answer={answer} correct={correct} nodes={tree.graph.number_of_nodes()}"


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The latest record of each problem in results.jsonl, read only (tot/runs/results.py): a last line cut
    short (a run still writing it) is skipped with a warning, damage in the middle is a ResultsError."""
    record = run_dir / RECORD
    fingerprint = read_json(record).get("fingerprint") if record.is_file() else None
    results = read_results(run_dir / "results.jsonl", fingerprint if isinstance(fingerprint, str) else None)
    if results.torn_line is not None:
        log.warning("%s:%d is cut short (a run writing it, or one stopped): skipped", results.path, results.torn_line)
    return list(results.latest.values())


def problems(run_dir: Path) -> list[SavedTree]:
    """Every problem with a tree, in results.jsonl order; trees without a record (a run killed between
    saving the tree and appending the record) come last, named by file."""
    if not run_dir.is_dir():
        raise ShowError(f"run directory {run_dir} does not exist; give an output directory of python -m tot.solve")
    trees = sorted((run_dir / "trees").glob("*.json"))
    if not trees:
        raise ShowError(f"{run_dir} has no trees/*.json; give an output directory of python -m tot.solve")
    records = read_records(run_dir)
    files = TreeFiles.of(run_dir, [str(rec["id"]) for rec in records])
    found = []
    for rec in records:
        path = files.find(str(rec["id"]))
        if path is not None:
            found.append(SavedTree(str(rec["id"]), rec, path))
    named = {p.tree_path for p in found}
    found += [SavedTree(problem_of(path.stem), None, path) for path in trees if path not in named]
    return found


def find_problem(run_dir: Path, problem_id: str) -> SavedTree:
    available = problems(run_dir)
    for p in available:
        if p.id == problem_id:
            return p
    ids = ", ".join(p.id for p in available[:5]) + (f" ... ({len(available)} in all)" if len(available) > 5 else "")
    raise ShowError(f"no tree for problem id {problem_id!r} in {run_dir}; give --id one of: {ids}")


def load_tree(run_dir: Path, problem_id: str) -> ReasoningTree:
    """The reasoning tree a run saved for one problem (ShowError naming the available ids if none)."""
    return read_tree(find_problem(Path(run_dir), problem_id).tree_path)


def save_tree(tree: ReasoningTree, path: Path) -> None:
    """The tree as node-link JSON, written whole (tot/runs/output.py) or not at all."""
    make_dirs(path.parent)
    write_atomic(path, json.dumps(tree.to_dict(), indent=1))


def read_tree(path: Path) -> ReasoningTree:
    """A saved tree, or ShowError naming the file where it cannot be read as one."""
    data = read_json(path)
    try:
        return ReasoningTree.from_dict(data)
    except Exception as e:  # networkx's own errors for a JSON object that is not a node-link graph
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise ShowError(
            f"{path} is not a saved tree ({reason}); rerun python -m tot.solve in its folder to solve that "
            "problem again"
        ) from None


def read_json(path: Path) -> dict[str, Any]:
    """A run's JSON file, or ShowError naming it when it cannot be read."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShowError(
            f"{path} cannot be read ({str(e).splitlines()[0][:120]}); was it written by tot.solve?"
        ) from None
    if not isinstance(data, dict):
        raise ShowError(f"{path} holds no JSON object; was it written by tot.solve?")
    return data
