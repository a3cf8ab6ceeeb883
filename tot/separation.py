"""`python -m tot.separation RUN_DIR [RUN_DIR ...]`: how well a run's values tell right answers from wrong.

Over every finished state in a run's trees (a path that stated an answer or reached the depth), the
answer is read with the task's rules and checked against the gold; the values of the right ones are
compared with those of the wrong ones by the AUC: the chance that a right answer's state is valued
above a wrong one's (ties count half). 1.0: the values rank every right answer first, so a search
choosing by them can only gain; 0.5: they know nothing of correctness, and choosing by them is a coin.
It also counts the problems each choice among the finished states answers right: the run's own, the
value-weighted vote (what search.aggregate=vote would have answered from the same tree: BFS and MCTS grow
it the same under either) and the plain majority of their answers.
Nothing is decoded: the trees are read as they were saved.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tasks.base import DataError
from tot.rescore import run_task
from tot.runs.saved import ShowError, problems, read_tree
from tot.search.base import choose, finished_states

RULES = ("vote", "majority")  # choices recomputed over a tree's finished states, beside the run's own


@dataclass(frozen=True)
class Separation:
    right: list[float]  # values of the finished states whose answer is right
    wrong: list[float]
    problems: int = 0  # problems read
    reachable: int = 0  # of them, those with a right answer among their finished states (what a choice can reach)
    solved: dict[str, int] = field(default_factory=dict)  # problems answered right: "run" (recorded), and by RULES

    @property
    def auc(self) -> float | None:
        if not self.right or not self.wrong:
            return None
        above = sum((r > w) + 0.5 * (r == w) for r in self.right for w in self.wrong)
        return above / (len(self.right) * len(self.wrong))

    def line(self, name: str) -> str:
        auc = "n/a (one kind of answer only)" if self.auc is None else f"{self.auc:.3f}"
        return (
            f"{name}: {len(self.right)} finished states right, {len(self.wrong)} wrong; mean value "
            f"{mean(self.right):.3f} against {mean(self.wrong):.3f}; AUC {auc}; a right answer among the finished "
            f"states of {self.reachable} of {self.problems} problems; answered right by the run "
            f"{self.solved.get('run', 0)}, by a value-weighted vote over them {self.solved.get('vote', 0)}, by their "
            f"majority {self.solved.get('majority', 0)}"
        )


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def separation(run_dir: Path) -> Separation:
    summary = run_dir / "summary.json"
    if not summary.is_file():
        raise ShowError(f"{run_dir} has no summary.json; give an output directory of python -m tot.solve")
    task, by_id = run_task(summary)
    right, wrong = [], []
    read = reachable = 0
    solved = dict.fromkeys(("run", *RULES), 0)
    for saved in problems(run_dir):
        problem = by_id.get(saved.id)
        if problem is None:
            continue
        tree = read_tree(saved.tree_path)
        states = finished_states(tree)
        answers = {s: task.answer(problem, tree.steps(s)) for s in states}
        correct = {s: task.is_correct(problem, a) for s, a in answers.items()}
        for state in states:
            value = tree[state].value
            if value is not None:
                (right if correct[state] else wrong).append(float(value))
        solved["run"] += bool(saved.record and saved.record.get("correct"))
        if states and all(tree[s].value is not None for s in states):
            for rule in RULES:
                solved[rule] += correct[choose(tree, states, answers.__getitem__, rule)]
        read, reachable = read + 1, reachable + any(correct.values())
    return Separation(right, wrong, read, reachable, solved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="output directories of python -m tot.solve")
    args = parser.parse_args(argv)
    try:
        for run_dir in args.runs:
            print(separation(run_dir).line(str(run_dir)))
    except (ShowError, DataError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
