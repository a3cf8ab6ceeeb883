"""`python -m tot.rescore RUN_DIR`: a run's answers, correctness and metrics recomputed from its saved
outputs with the current parsers, without decoding anything.

Every node's thought is parsed again from the model's saved reply (`raw`), the answer is read from the
path the search chose with the task's current rules, and the code-computed metrics are recomputed (a
judge model's scores are kept: they need decoding). results.jsonl, the trees and summary.json are
rewritten and what changed is printed, so that a parser fix applies to runs already made. The chosen
path itself is kept (the search chose it by the values it had), except where DVTS voted on answers
(search.aggregate=vote): the vote over the subtrees' final states is taken again on the re-read answers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decoding import OutputError
from tasks import DataSpec, FullTask, Problem, make_task
from tasks.base import DataError
from tot.runs.folder import read_record
from tot.runs.lock import run_lock
from tot.runs.output import write_atomic
from tot.runs.results import ResultsError, TreeFiles, answer_fields, read_results, summarize
from tot.runs.saved import SavedTree, ShowError, problems, read_json, read_tree, save_tree
from tot.search import SEARCHES
from tot.search.base import choose
from tot.search.tree import ReasoningTree
from tot.search.vote import PLAIN_VOTE, VoteRule


@dataclass(frozen=True)
class Rescored:
    before: dict[str, Any]  # summary.json as it was
    after: dict[str, Any]  # as rewritten
    changes: list[Change]
    without_tree: int  # problems kept as recorded: their tree is not there to read


@dataclass(frozen=True)
class Change:
    id: str
    before: dict[str, Any]  # answer, correct, correct_by as the run recorded them
    after: dict[str, Any]

    def line(self) -> str:
        b, a = self.before, self.after
        text = f"{self.id}: answer {b.get('answer')!r} -> {a['answer']!r}"
        if b.get("correct") != a["correct"]:
            text += f", correct {b.get('correct')} -> {a['correct']}"
        return text


def reparse(task: FullTask, problem: Problem, tree: ReasoningTree) -> None:
    """Every node's thought parsed again from its saved reply, parents first."""
    for node in sorted(tree.graph.nodes, key=lambda n: tree[n].depth):
        raw = tree[node].raw
        if node == tree.root or raw is None:
            continue
        parent = next(iter(tree.graph.predecessors(node)))
        before = tree.steps(parent) if parent != tree.root else []
        tree[node].text = task.parse_thought(problem, before, raw)


def answer_steps(tree: ReasoningTree) -> list[str]:
    """The thoughts of the path marked as the answer."""
    path = [n for n in tree.graph.nodes if tree[n].answer and n != tree.root]
    if not path:
        return []
    return tree.steps(max(path, key=lambda n: tree[n].depth))


def revote(
    task: FullTask, problem: Problem, tree: ReasoningTree, leaves: list[int], vote: VoteRule = PLAIN_VOTE
) -> None:
    """A vote (DVTS's aggregate=vote over its subtrees' final states, best-of-N's majority or weighted
    vote over its solutions) again under the run's vote.* rule, on the answers the current parsers read,
    and the answer path marked anew."""
    if not leaves:
        return
    best = choose(tree, leaves, lambda s: task.answer(problem, tree.steps(s)), "vote", vote)
    for thought in tree.thoughts.values():
        thought.answer = False
    tree.mark_answer(best)


def voted_leaves(search: str | None, config: dict[str, Any]) -> Callable[[ReasoningTree], list[int]] | None:
    """Where the run's answer is a vote, what it voted over (the search declares it from its recorded
    settings: DVTS's subtrees' final states under aggregate=vote, best-of-N's solutions under majority
    or weighted); None where a value chose it."""
    if search is None or search not in SEARCHES:
        return None
    return SEARCHES[search].voted(config.get(search) or {})


def rescore(run_dir: Path) -> Rescored:
    """Rescore a run in place: the summaries before and after, the problems that changed and how many
    had no tree to read. Where no problem has its tree, nothing is rewritten (ShowError). The folder is
    held as a run holds it (tot/runs/lock.py): a run still writing it is not raced."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise ShowError(f"{run_dir} has no summary.json; give an output directory of python -m tot.solve")
    with run_lock(run_dir):
        return _rescore(run_dir, summary_path)


def run_task(summary_path: Path) -> tuple[FullTask, dict[str, Problem]]:
    """The task a run's summary.json says it ran, and every problem of its data file by id."""
    old = read_json(summary_path)
    config = old.get("config") or {}
    try:
        depth = None if config.get("depth") is None else int(config["depth"])  # None: the task's default
        task = make_task(old["task"], depth, dict(config.get("task_options") or {}))
        # The whole file: the folder's records may come from several selections of it.
        whole = {**config["data"], "limit": None, "offset": 0, "shard": 0, "num_shards": 1}
        return task, {p.id: p for p in task.load(DataSpec(**whole))}
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise ShowError(
            f"{summary_path} does not say which task and problems it ran ({e}); give a run of tot.solve"
        ) from None


@dataclass(frozen=True)
class ReadProblem:
    """A saved problem of a run, its problem from the run's data and its tree."""

    saved: SavedTree
    problem: Problem
    tree: ReasoningTree


def read_problems(run_dir: Path) -> tuple[FullTask, list[ReadProblem]]:
    """The task a run ran and its saved problems with their trees, in the run's order (a problem its
    data file no longer holds is left out): what the commands that read a run's trees start from."""
    task, by_id = run_task(run_dir / "summary.json")
    read = [
        ReadProblem(saved, by_id[saved.id], read_tree(saved.tree_path))
        for saved in problems(run_dir)
        if saved.id in by_id
    ]
    return task, read


def _rescore(run_dir: Path, summary_path: Path) -> Rescored:
    old = read_json(summary_path)
    config = old.get("config") or {}
    task, problems = run_task(summary_path)
    results_path = run_dir / "results.jsonl"
    if not results_path.is_file():
        raise ShowError(
            f"{results_path} is missing, so there is nothing to rescore and {summary_path} is kept; restore it"
        )
    record = read_record(run_dir)
    results = read_results(results_path, record.fingerprint if record else None)
    voted = voted_leaves(old.get("search"), config)
    vote = VoteRule(**(config.get("vote") or {}))  # a run recorded before vote.* voted by its search's own rule
    latest = {id(rec) for rec in results.latest.values()}
    files = TreeFiles.of(run_dir, [str(rec["id"]) for rec in results.entries])
    lines, records, changes, trees, without_tree = [], [], [], [], 0
    for rec in results.entries:
        if id(rec) not in latest:  # an earlier record of a problem solved again: its tree is gone
            lines.append(rec)
            continue
        path = files.find(str(rec["id"]))
        new, tree = rescored(task, problems.get(str(rec["id"])), rec, path, voted, vote)
        if tree is not None and path is not None:
            trees.append((tree, path))
        else:
            without_tree += 1
        if any(new.get(k) != rec.get(k) for k in ("answer", "correct", "metrics")):
            changes.append(Change(str(rec["id"]), rec, new))
        lines.append(new)
        records.append(new)
    if records and not trees:
        raise ShowError(
            f"none of the {len(records)} problems in {results_path} has its tree (in {run_dir / 'trees'}) or its "
            "problem in the data file: nothing re-read, nothing rewritten; restore the trees tot.solve saved"
        )
    totals = summarize(records, {})  # every problem of the folder, as tot.solve summarizes it
    # What describes the run (its settings, model, memory, activations...) is kept as it was.
    summary = {**{k: v for k, v in old.items() if k not in totals}, **totals}
    if summary["n_problems"] < old.get("n_problems", 0):
        raise ShowError(
            f"{summary_path} counts {old['n_problems']} problems, {results_path} holds {summary['n_problems']} of "
            "them: nothing rewritten; restore the missing records, or rerun python -m tot.solve in that folder"
        )
    torn = results_path.read_bytes()[results.whole_bytes :].decode("utf-8", "replace")  # kept as it was
    for tree, path in trees:
        save_tree(tree, path)
    write_atomic(results_path, "".join(json.dumps(r) + "\n" for r in lines) + torn)
    write_atomic(summary_path, json.dumps(summary, indent=2))
    return Rescored(old, summary, changes, without_tree)


def rescored(
    task: FullTask,
    problem: Problem | None,
    rec: dict[str, Any],
    path: Path | None,
    voted: Callable[[ReasoningTree], list[int]] | None,
    vote: VoteRule = PLAIN_VOTE,
) -> tuple[dict[str, Any], ReasoningTree | None]:
    """The record with its answer and metrics read again from its tree, and the tree reparsed; the
    record as it was (and no tree) where the problem or its tree is not there to read."""
    if problem is None or path is None or not path.is_file():
        return rec, None
    tree = read_tree(path)
    reparse(task, problem, tree)
    if voted is not None:
        revote(task, problem, tree, voted(tree), vote)
    fields = answer_fields(task, problem, answer_steps(tree))
    metrics = {**rec.get("metrics", {}), **task.metrics(problem, fields["answer"])}
    return {**rec, **fields, "metrics": metrics}, tree


def report(done: Rescored) -> str:
    old, new = done.before, done.after
    lines = [c.line() for c in done.changes]
    lines.append(f"{len(done.changes)} of {new['n_problems']} problems changed")
    if done.without_tree:
        lines.append(
            f"{done.without_tree} of them kept as recorded: no tree (or no problem in the data file) to re-read"
        )
    lines.append(f"accuracy {old.get('accuracy', 0.0):.3f} -> {new['accuracy']:.3f}")
    for rule, value in new.get("accuracy_by", {}).items():
        before = old.get("accuracy_by", {}).get(rule)
        lines.append(f"accuracy ({rule}) {'-' if before is None else f'{before:.3f}'} -> {value:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tot.rescore", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="an output directory of python -m tot.solve")
    args = parser.parse_args(argv)
    try:
        done = rescore(args.run_dir)
    except (ShowError, DataError, ResultsError, OutputError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(report(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
