"""`python -m tot.vote_curve BEST_OF_N_RUN [--baseline RUN] [--runs RUN ...] [--curves RUN ...]`: accuracy
against tokens for every way of voting over one best-of-N run's solutions, and beside it other runs (a
chain, tree searches) and other best-of-N runs' majority curves (another `task.thoughts`, another
temperature), each paired with the baseline problem by problem.

Solution i of a problem is sampled from the same seed whatever the budget, so the first k solutions
of a run of n are what best-of-k would have drawn: one run of n gives the whole curve for k = 1..n,
for the plain majority and for each confidence reading the solutions kept (vote.weight=READING; the
run asked for log-probabilities where it had a vote.weight reading), and the early stops
(search.stop=decided in waves of 1, 2 and 4, agree in waves of 2, 3 and 4): the budget each spends.
Tokens are the solutions' own (no evaluator is asked under these votes); a run that valued its solutions
(search.aggregate=weighted: a judge, reward.kind=consistency) adds the vote by those values, its tokens
the solutions' and their valuations' (`eval_tokens`). A rollout-valued BFS run given
with --runs is also read level by level (`level_points`). Nothing is decoded.

Writes `vote_curve.md`, `vote_curve.json` and `vote_curve.png` into the best-of-N run's folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import networkx as nx

from decoding import OutputError
from tasks.base import DataError
from tot.collect import paired, wilson
from tot.rescore import read_problems
from tot.runs.output import pyplot, save_figure, write_atomic
from tot.runs.saved import ShowError, read_json, read_records
from tot.search.base import choose, path_confidence
from tot.search.best_of_n import solution_leaves
from tot.search.confidence import READINGS
from tot.search.tree import ReasoningTree
from tot.search.vote import Ballot, VoteRule, settled, tally

# The early stops drawn, each at these waves (agree needs two at least: one always agrees with itself).
STOPS_DRAWN = {"decided": (1, 2, 4), "agree": (2, 3, 4)}


@dataclass(frozen=True)
class Drawn:
    """One problem's solutions in the order they were sampled."""

    id: str
    ballots: list[Ballot]
    correct: list[bool]
    tokens: list[int]
    eval_tokens: list[float]  # what valuing each solution generated (a reward model's completions, a judge)

    def answer_right(self, k: int, rule: VoteRule) -> bool:
        """Whether the vote over the first k solutions names a right answer (the plurality where every
        ballot weighs 0: what a weighted vote falls back to)."""
        winner = tally(rule, self.ballots[:k], "one").winner
        return any(c for b, c in zip(self.ballots[:k], self.correct[:k]) if b.answer == winner)

    def stop(self, stop: str, wave: int) -> int:
        """How many solutions a run with search.wave=wave and search.stop=stop draws."""
        n, drawn = len(self.ballots), 0
        while drawn < n:
            drawn = min(n, drawn + wave)
            if settled(VoteRule(), self.ballots[:drawn], "one", n - drawn, stop, wave):
                break
        return drawn


def drawn(run_dir: Path) -> list[Drawn]:
    """Every problem's solutions, with their answers, correctness, readings and tokens."""
    task, read = read_problems(run_dir)
    out = []
    for one in read:
        saved, problem, tree = one.saved, one.problem, one.tree
        leaves = solution_leaves(tree)
        if not leaves:
            raise ShowError(f"{saved.tree_path} holds no best-of-N solution; give a run of search=best_of_n")
        ballots, correct, tokens = [], [], []
        for leaf in leaves:
            answer = task.answer(problem, tree.steps(leaf))
            ballots.append(Ballot(answer, tree[leaf].value, path_confidence(tree, leaf)))
            correct.append(task.is_correct(problem, answer))
            first = nx.shortest_path(tree.graph, tree.root, leaf)[1]  # a solution's tokens sit on its first step
            tokens.append(tree[first].tokens or 0)
        out.append(Drawn(saved.id, ballots, correct, tokens, valuation_tokens(tree, leaves, saved.record)))
    return out


def valuation_tokens(tree: ReasoningTree, leaves: list[int], record: dict[str, Any] | None) -> list[float]:
    """Each solution's valuation tokens as its node records them; a tree saved before nodes recorded
    them shares the problem's `evaluate` phase evenly among its solutions."""
    recorded = [tree[leaf].eval_tokens for leaf in leaves]
    if all(t is not None for t in recorded):
        return [float(t) for t in recorded]  # type: ignore[arg-type]
    spent = ((record or {}).get("phases") or {}).get("evaluate", {}).get("tokens", 0)
    return [spent / len(leaves)] * len(leaves)


def valued(solutions: list[Drawn]) -> bool:
    """Whether the run valued its solutions (search.aggregate=weighted or best: a judge, a reward model)."""
    return any(d.eval_tokens and sum(d.eval_tokens) for d in solutions)


def curve(solutions: list[Drawn]) -> list[dict[str, Any]]:
    """One point per (vote, budget): its problems' correctness and tokens (a problem's `correct` list in
    the problems' order, for pairing)."""
    n = min(len(d.ballots) for d in solutions)
    rules = {"majority": VoteRule()}
    for reading in READINGS:
        if all(b.confidence and reading in b.confidence for d in solutions for b in d.ballots):
            rules[reading] = VoteRule(weight=reading)
    if valued(solutions):  # the values' own vote, its tokens the solutions' and their valuations'
        rules["value"] = VoteRule(weight="value")
    points = [p for name, rule in rules.items() for p in budgets(solutions, rule, name, n)]
    for stop, waves in STOPS_DRAWN.items():
        for wave in waves:
            if wave < n:
                spent = [(k, d.answer_right(k, VoteRule())) for d in solutions for k in [d.stop(stop, wave)]]
                points.append(point(f"best-of-{n}, majority, stop={stop}, wave={wave}", solutions, spent))
    return points


def budgets(solutions: list[Drawn], rule: VoteRule, name: str, n: int) -> list[dict[str, Any]]:
    """The vote by `rule` over the first k solutions, k = 1..n: one point each."""
    return [
        point(f"best-of-{k}, {name}", solutions, [(k, d.answer_right(k, rule)) for d in solutions], name == "value")
        for k in range(1, n + 1)
    ]


def majority_curve(run_dir: Path) -> list[dict[str, Any]]:
    """Another best-of-N run's plain majority at every budget, named after its folder."""
    solutions = drawn(run_dir)
    return budgets(solutions, VoteRule(), f"majority ({run_dir.name})", min(len(d.ballots) for d in solutions))


def as_point(name: str, records: list[dict[str, Any]], tokens: int, samples: int | None = None) -> dict[str, Any]:
    """A point of the curve: its problems' correctness (id, correct: for pairing) and its cost."""
    return {
        "name": name,
        "problems": len(records),
        "correct": sum(r["correct"] for r in records),
        "tokens_per_problem": tokens / len(records),
        "samples_per_problem": None if samples is None else samples / len(records),
        "records": records,
    }


def point(name: str, solutions: list[Drawn], spent: list[tuple[int, bool]], valuing: bool = False) -> dict[str, Any]:
    """The point of drawing the first k solutions of each problem (with `valuing`, and valuing them)."""
    records = [{"id": d.id, "correct": ok} for d, (_, ok) in zip(solutions, spent)]
    tokens = sum(sum(d.tokens[:k]) + (sum(d.eval_tokens[:k]) if valuing else 0) for d, (k, _) in zip(solutions, spent))
    return as_point(name, records, round(tokens), sum(k for k, _ in spent))


def run_point(run_dir: Path) -> dict[str, Any]:
    """A whole run as one point: its recorded correctness and tokens."""
    records = read_records(run_dir)
    if not records:
        raise ShowError(f"{run_dir} has no finished problem; give a tot.solve run folder")
    kept = [{"id": r["id"], "correct": bool(r["correct"])} for r in records]
    return as_point(str(run_dir), kept, sum(r["tokens"] for r in records))


def level_points(run_dir: Path) -> list[dict[str, Any]]:
    """A rollout-valued BFS run (task.value=rollout) read level by level: the tree up to level L is what
    the run grew had `search.token_budget` stopped it after L (a level's choices read only the tree
    before it), so the majority over the ballots of levels <= L, and the tokens of those levels (every
    token of such a run is a thought's or a completion's), give its curve. Other runs give no levels."""
    summary = read_json(run_dir / "summary.json")
    config = summary.get("config") or {}
    if summary.get("search") != "bfs" or (config.get("task_options") or {}).get("value") != "rollout":
        return []
    task, read = read_problems(run_dir)
    trees = [(one.problem, one.tree) for one in read]

    def level(tree: ReasoningTree, node: int) -> int:  # a completion belongs to the level of its state
        return tree[node].depth - 1 if tree[node].rollout else tree[node].depth

    deepest = max((level(t, n) for _, t in trees for n in t.graph.nodes), default=0)
    points = []
    for top in range(1, deepest + 1):
        records, tokens = [], 0
        for problem, tree in trees:
            kept = [n for n in tree.graph.nodes if n != tree.root and level(tree, n) <= top]
            tokens += sum(tree[n].tokens or 0 for n in kept)
            ballots = [n for n in kept if tree[n].terminal]
            right = False
            if ballots:
                answer_of = partial(lambda t, p, s: task.answer(p, t.steps(s)), tree, problem)
                right = task.is_correct(problem, answer_of(choose(tree, ballots, answer_of, "majority")))
            records.append({"id": problem.id, "correct": right})
        points.append(as_point(f"{run_dir.name}, levels <= {top}", records, tokens))
    return points


def table(points: list[dict[str, Any]], baseline: list[dict[str, Any]] | None) -> str:
    head = "| run / vote | problems | accuracy [95%] | tokens a problem | samples |"
    head += " only it / only baseline (p) |" if baseline else ""
    lines = [head, "|" + "---|" * head.count(" |")]
    for p in points:
        low, high = wilson(p["correct"], p["problems"])
        samples = "" if p["samples_per_problem"] is None else f"{p['samples_per_problem']:.2f}"
        row = (
            f"| {p['name']} | {p['problems']} | {p['correct'] / p['problems']:.3f} [{low:.3f}, {high:.3f}] | "
            f"{p['tokens_per_problem']:,.0f} | {samples} |"
        )
        if baseline:
            pair = paired(p["records"], baseline)
            p_value = "n/a" if pair["paired_p"] is None else f"{pair['paired_p']:.3f}"
            row += f" {pair['only_this']} / {pair['only_baseline']} ({p_value}) |"
        lines.append(row)
    return "\n".join(lines)


def plot(
    points: list[dict[str, Any]], runs: list[dict[str, Any]], path: Path, baseline: dict[str, Any] | None = None
) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        if "stop=" not in p["name"]:
            series.setdefault(p["name"].split(", ", 1)[1], []).append(p)
    for r in runs:
        if ", levels <= " in r["name"]:
            series.setdefault(r["name"].split(", levels")[0] + " by levels", []).append(r)
    runs = [r for r in runs if ", levels <= " not in r["name"]]
    for name, ps in series.items():
        ax.plot([p["tokens_per_problem"] for p in ps], [p["correct"] / p["problems"] for p in ps], "o-", label=name)
    # The other points, one label where several fall on one spot (early stops that drew the same samples).
    labels: dict[tuple[float, float], list[str]] = {}
    marks: dict[tuple[float, float], str] = {}
    named = [(p, p["name"].split("stop=")[1].replace(", wave=", " w"), "k^") for p in points if "stop=" in p["name"]]
    named += [(r, Path(r["name"]).name, "ks") for r in runs]
    named += [(baseline, f"{Path(baseline['name']).name} (baseline)", "rs")] if baseline else []
    for p, label, mark in named:
        xy = (p["tokens_per_problem"], p["correct"] / p["problems"])
        labels.setdefault(xy, []).append(label)
        marks.setdefault(xy, mark)
    for i, (xy, texts) in enumerate(sorted(labels.items())):  # neighbours' labels above and below in turn
        ax.plot(*xy, marks[xy], markersize=4)
        ax.annotate(", ".join(texts), xy, fontsize=6, xytext=(3, 3 if i % 2 else -9), textcoords="offset points")
    ax.set_xlabel("generated tokens a problem")
    ax.set_ylabel("accuracy")
    ax.set_xscale("log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a tot.solve run folder of search=best_of_n")
    parser.add_argument("--baseline", type=Path, help="a run each point is paired with (e.g. the greedy chain)")
    parser.add_argument("--runs", type=Path, nargs="*", default=[], help="other runs shown as points beside the curve")
    parser.add_argument(
        "--curves", type=Path, nargs="*", default=[], help="other best-of-N runs drawn as their majority's curves"
    )
    args = parser.parse_args(argv)
    try:
        for folder in [args.run, *args.runs, *args.curves, *([args.baseline] if args.baseline else [])]:
            if not (folder / "summary.json").is_file():
                raise ShowError(f"{folder} has no summary.json; give an output directory of python -m tot.solve")
        points = curve(drawn(args.run)) + [p for r in args.curves for p in majority_curve(r)]
        runs = [run_point(r) for r in args.runs] + [p for r in args.runs for p in level_points(r)]
        base = run_point(args.baseline) if args.baseline else None
        text = table(runs + points, base["records"] if base else None)
        print(text)
        write_atomic(args.run / "vote_curve.md", text + "\n")
        write_atomic(args.run / "vote_curve.json", json.dumps({"points": points, "runs": runs}, indent=2) + "\n")
        plot(points, runs, args.run / "vote_curve.png", base)
    except (ShowError, DataError, OutputError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
