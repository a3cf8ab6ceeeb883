"""`python -m tot.separation RUN_DIR [RUN_DIR ...]`: how well a run's values tell right answers from wrong.

Over every finished state in a run's trees (a path that stated an answer or reached the depth), the
answer is read with the task's rules and checked against the gold; the values of the right ones are
compared with those of the wrong ones by the AUC: the chance that a right answer's state is valued
above a wrong one's (ties count half). 1.0: the values rank every right answer first; 0.5: they know
nothing of correctness. Two of them: within problems (a right and a wrong state of the same problem:
what a search choosing among a problem's states faces, so a search choosing by them gains only where
this one is above 0.5) and pooled over all problems (it also rewards values that are merely higher on
easy problems, which a search cannot use).
It also counts the problems each choice among the finished states answers right: the run's own, the
best-valued state, the value-weighted vote (what search.aggregate=vote would have answered from the same
tree: BFS and MCTS grow it the same under either) and the plain majority of their answers.

Where the finished states' replies kept their log-probabilities (a vote.weight reading, or
task.value=confidence), each confidence reading (tot/search/confidence.py) is scored the same way, one
line each: its AUC within problems, and the problems its weighted vote (vote.weight=READING) answers
right; so a user sees which reading separates before choosing one.
Nothing is decoded: the trees are read as they were saved.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tasks.base import DataError
from tot.rescore import read_problems
from tot.runs.saved import ShowError
from tot.search.base import choose, finished_states, path_confidence
from tot.search.confidence import READINGS
from tot.search.vote import VoteRule

RULES = ("best", "vote", "majority")  # choices recomputed over a tree's finished states, beside the run's own


@dataclass(frozen=True)
class Values:
    """One problem's finished states' values, by whether their answer is right."""

    right: list[float]
    wrong: list[float]


def auc(groups: list[Values]) -> float | None:
    """The chance that a right state's value is above a wrong one's of the same group (ties half)."""
    above = sum((r > w) + 0.5 * (r == w) for v in groups for r in v.right for w in v.wrong)
    n = sum(len(v.right) * len(v.wrong) for v in groups)
    return above / n if n else None


@dataclass(frozen=True)
class Separation:
    by_problem: list[Values]
    reachable: int = 0  # problems with a right answer among their finished states (what a choice can reach)
    solved: dict[str, int] = field(default_factory=dict)  # problems answered right: "run" (recorded), and by RULES
    # Per confidence reading that every finished state of a problem has: its values and its vote's hits.
    readings: dict[str, Separation] = field(default_factory=dict)

    @property
    def problems(self) -> int:
        return len(self.by_problem)

    @property
    def right(self) -> list[float]:
        return [r for v in self.by_problem for r in v.right]

    @property
    def wrong(self) -> list[float]:
        return [w for v in self.by_problem for w in v.wrong]

    @property
    def within_auc(self) -> float | None:
        """A right and a wrong state of one problem: what a search choosing among its states faces."""
        return auc(self.by_problem)

    @property
    def pooled_auc(self) -> float | None:
        return auc([Values(self.right, self.wrong)])

    def lines(self, name: str) -> list[str]:
        """The values' line, then one per confidence reading."""
        out = [self.line(name)]
        for reading, sep in self.readings.items():
            out.append(
                f"  {reading}: {len(sep.right)} right, {len(sep.wrong)} wrong over {sep.problems} problems; mean "
                f"{mean(sep.right):.3f} against {mean(sep.wrong):.3f}; AUC within problems {shown(sep.within_auc)}, "
                f"pooled {shown(sep.pooled_auc)}; its weighted vote answers {sep.solved.get('vote', 0)} right"
            )
        return out

    def line(self, name: str) -> str:
        pairs = sum(len(v.right) * len(v.wrong) for v in self.by_problem)
        chosen = ", ".join(f"{rule} {self.solved.get(rule, 0)}" for rule in ("run", *RULES))
        return (
            f"{name}: {len(self.right)} finished states right, {len(self.wrong)} wrong; mean value "
            f"{mean(self.right):.3f} against {mean(self.wrong):.3f}; AUC within problems {shown(self.within_auc)} "
            f"({pairs} pairs), pooled {shown(self.pooled_auc)}; a right answer among the finished states of "
            f"{self.reachable} of {self.problems} problems; answered right by {chosen}"
        )


def shown(value: float | None) -> str:
    return "n/a (no right and wrong state to compare)" if value is None else f"{value:.3f}"


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def separation(run_dir: Path) -> Separation:
    summary = run_dir / "summary.json"
    if not summary.is_file():
        raise ShowError(f"{run_dir} has no summary.json; give an output directory of python -m tot.solve")
    task, read = read_problems(run_dir)
    by_problem: list[Values] = []
    reachable = 0
    solved = dict.fromkeys(("run", *RULES), 0)
    by_reading: dict[str, list[Values]] = {r: [] for r in READINGS}
    read_solved = dict.fromkeys(READINGS, 0)
    for one in read:
        saved, problem, tree = one.saved, one.problem, one.tree
        states = finished_states(tree)
        answers = {s: task.answer(problem, tree.steps(s)) for s in states}
        correct = {s: task.is_correct(problem, a) for s, a in answers.items()}
        valued = [(s, v) for s in states if (v := tree[s].value) is not None]
        by_problem.append(
            Values(
                [float(v) for s, v in valued if correct[s]],
                [float(v) for s, v in valued if not correct[s]],
            )
        )
        solved["run"] += bool(saved.record and saved.record.get("correct"))
        if states and len(valued) == len(states):
            for rule in RULES:
                solved[rule] += correct[choose(tree, states, answers.__getitem__, rule)]
        reachable += any(correct.values())
        sure = {s: path_confidence(tree, s) or {} for s in states}
        for reading in READINGS:
            if states and all(reading in sure[s] for s in states):
                by_reading[reading].append(
                    Values(
                        [sure[s][reading] for s in states if correct[s]],
                        [sure[s][reading] for s in states if not correct[s]],
                    )
                )
                by_reading_rule = VoteRule(weight=reading)
                read_solved[reading] += correct[choose(tree, states, answers.__getitem__, "vote", by_reading_rule)]
    kept = {r: Separation(v, solved={"vote": read_solved[r]}) for r, v in by_reading.items() if v}
    return Separation(by_problem, reachable, solved, kept)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="output directories of python -m tot.solve")
    args = parser.parse_args(argv)
    try:
        for run_dir in args.runs:
            print("\n".join(separation(run_dir).lines(str(run_dir))))
    except (ShowError, DataError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
