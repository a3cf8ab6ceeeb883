"""`python -m tot.separation RUN_DIR [RUN_DIR ...]`: how well a run's values tell right answers from wrong.

Over every finished state in a run's trees (a path that stated an answer or reached the depth), the
answer is read with the task's rules and checked against the gold; the values of the right ones are
compared with those of the wrong ones by the AUC: the chance that a right answer's state is valued
above a wrong one's (ties count half). 1.0: the values rank every right answer first, so a search
choosing by them can only gain; 0.5: they know nothing of correctness, and choosing by them is a coin.
Nothing is decoded: the trees are read as they were saved.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from tasks.base import DataError
from tot.rescore import run_task
from tot.runs.saved import ShowError, problems, read_tree
from tot.search.base import finished_states


@dataclass(frozen=True)
class Separation:
    right: list[float]  # values of the finished states whose answer is right
    wrong: list[float]
    problems: int = 0  # problems read
    reachable: int = 0  # of them, those with a right answer among their finished states (what a choice can reach)

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
            f"states of {self.reachable} of {self.problems} problems"
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
    for saved in problems(run_dir):
        problem = by_id.get(saved.id)
        if problem is None:
            continue
        tree = read_tree(saved.tree_path)
        found = False
        for state in finished_states(tree):
            ok = task.is_correct(problem, task.answer(problem, tree.steps(state)))
            found |= ok
            value = tree[state].value
            if value is not None:
                (right if ok else wrong).append(float(value))
        read, reachable = read + 1, reachable + found
    return Separation(right, wrong, read, reachable)


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
