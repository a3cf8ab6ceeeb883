"""`tot.vote_curve` on a best-of-N run whose solutions are scripted: each budget's vote, the early
stops' budgets and tokens, the weighted votes, the pairing with a baseline, the files written."""

from __future__ import annotations

import json

from helpers import AwaitableFake, reply
from test_run import make_config

from decoding.base.values import DecodeStats, GenRequest, GenResult, TokenLogprob
from tot.runs.run import run
from tot.vote_curve import main

# Solution j of a problem states ANSWERS[problem][j] (bundled-1's gold is 12, bundled-2's 110), its
# tokens' log-probability SURE[j] each; solution j has j + 1 tokens.
ANSWERS = {"bundled-1": ["5", "12", "12", "12"], "bundled-2": ["110", "110", "3", "3"]}
SURE = [-0.05, -2.0, -2.0, -2.0]


class SolutionEngine(AwaitableFake):
    def __init__(self) -> None:
        self.asked: dict[str, int] = {}
        self.last_stats = DecodeStats()

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        out = []
        for r in requests:
            pid = r.group.problem
            j = self.asked.get(pid, 0)
            self.asked[pid] = j + 1
            result = reply(f"So. The answer is {ANSWERS[pid][j]}.", list(range(j + 1)))
            result.logprobs = [TokenLogprob(t, SURE[j]) for t in range(j + 1)]
            out.append(result)
        self.last_stats = DecodeStats(generated_tokens=sum(len(o.token_ids) for o in out))
        return out


def test_the_curve_votes_again_over_the_first_k_solutions(tmp_path, capsys):
    out = tmp_path / "bo4"
    config = make_config(
        "task.solutions=same", "search=best_of_n", "search.n=4", "data.limit=2", "vote.weight=mean", "run.concurrency=1"
    )
    run(config, out, engine=SolutionEngine(), progress=False)
    assert main([str(out), "--baseline", str(out)]) == 0
    rows = {line.split(" | ")[0][2:]: line for line in capsys.readouterr().out.splitlines()[2:]}
    points = {p["name"]: p for p in json.loads((out / "vote_curve.json").read_text())["points"]}
    # Majority: bundled-2 always 110 (at k=4 a 2-2 tie goes to the earlier answer); bundled-1 5 at k=1
    # and at k=2 (a tie), 12 from k=3.
    assert [points[f"best-of-{k}, majority"]["correct"] for k in (1, 2, 3, 4)] == [1, 1, 2, 2]
    # Weighted by the mean probability, the one sure solution (0.95) outweighs three unsure ones (0.14 each).
    assert [r["correct"] for r in points["best-of-4, mean"]["records"]] == [False, True]
    # Tokens: solution j has j + 1 tokens.
    assert points["best-of-4, majority"]["tokens_per_problem"] == 10
    # decided, one at a time: neither is decided before the fourth (a lead of 1 with 1 to come is not).
    decided = points["best-of-4, majority, stop=decided, wave=1"]
    assert decided["samples_per_problem"] == 4
    # agree, two at a time: bundled-2's first wave agrees (2), bundled-1 draws all four.
    assert points["best-of-4, majority, stop=agree, wave=2"]["samples_per_problem"] == 3
    # Paired with the run's own answers (its vote weighted by the mean, as best-of-4, mean is).
    assert rows["best-of-4, mean"].endswith("| 0 / 0 (1.000) |")
    assert rows["best-of-4, majority"].endswith("| 1 / 0 (1.000) |")
    assert (out / "vote_curve.md").is_file() and (out / "vote_curve.png").is_file()
    assert main([str(tmp_path / "none")]) == 2 and "no summary.json" in capsys.readouterr().err


def test_a_rollout_bfs_run_is_read_level_by_level(tmp_path, capsys):
    """The levels of a rollout-valued BFS run: its last level is the run itself (tokens and answers)."""
    from test_rollout import RolloutEngine

    from tot.runs.saved import read_records
    from tot.vote_curve import level_points

    bo = tmp_path / "bo4"
    run(
        make_config("task.solutions=same", "search=best_of_n", "search.n=4", "data.limit=2"),
        bo,
        engine=SolutionEngine(),
        progress=False,
    )
    bfs = tmp_path / "bfs"
    overrides = [
        "task.thoughts=paragraphs",
        "task.value=rollout",
        "task.depth=2",
        "search.n_thoughts=2",
        "data.limit=2",
    ]
    run(make_config(*overrides), bfs, engine=RolloutEngine(), progress=False)
    levels = level_points(bfs)
    records = read_records(bfs)
    assert [p["name"] for p in levels] == ["bfs, levels <= 1", "bfs, levels <= 2"]
    assert levels[-1]["tokens_per_problem"] == sum(r["tokens"] for r in records) / 2
    assert levels[0]["tokens_per_problem"] < levels[-1]["tokens_per_problem"]
    assert [r["correct"] for r in levels[-1]["records"]] == [bool(r["correct"]) for r in records]
    assert level_points(bo) == []  # not a rollout BFS
    assert main([str(bo), "--runs", str(bfs)]) == 0
    assert "| bfs, levels <= 1 | 2 |" in capsys.readouterr().out


def test_a_valued_run_adds_the_vote_by_its_values_at_the_cost_of_valuing():
    """Solutions valued (a reward model's consistency: 1 or 0): the value curve counts the consistent
    ones, falls back to the plurality where none is, and its tokens add what valuing them generated."""
    from tot.search.tree import ReasoningTree
    from tot.search.vote import Ballot
    from tot.vote_curve import Drawn, curve, valuation_tokens

    def problem(pid, answers, values, gold):
        ballots = [Ballot(a, v) for a, v in zip(answers, values)]
        return Drawn(pid, ballots, [a == gold for a in answers], [10] * len(answers), [4.0] * len(answers))

    solutions = [
        problem("p1", ["7", "7", "5"], [0.0, 0.0, 1.0], "5"),  # the consistent minority wins
        problem("p2", ["3", "3", "9"], [0.0, 0.0, 0.0], "3"),  # no consistent one: the plurality
    ]
    points = {p["name"]: p for p in curve(solutions)}
    assert [r["correct"] for r in points["best-of-3, value"]["records"]] == [True, True]
    assert [r["correct"] for r in points["best-of-3, majority"]["records"]] == [False, True]
    assert (
        points["best-of-3, value"]["tokens_per_problem"] == 42
        and points["best-of-3, majority"]["tokens_per_problem"] == 30
    )
    assert points["best-of-1, value"]["tokens_per_problem"] == 14
    # A tree saved before nodes recorded their valuation's tokens shares the evaluate phase evenly.
    tree = ReasoningTree("q")
    leaves = [tree.add(tree.root, "a"), tree.add(tree.root, "b")]
    assert valuation_tokens(tree, leaves, {"phases": {"evaluate": {"tokens": 30}}}) == [15.0, 15.0]
    tree[leaves[0]].eval_tokens, tree[leaves[1]].eval_tokens = 10, 20
    assert valuation_tokens(tree, leaves, None) == [10.0, 20.0]


def test_other_best_of_n_runs_are_drawn_as_their_majority_curves(tmp_path):
    runs = {}
    for name, n in (("bo4", 4), ("bo2", 2)):
        config = make_config(
            "task.solutions=same", "search=best_of_n", f"search.n={n}", "data.limit=2", "run.concurrency=1"
        )
        run(config, tmp_path / name, engine=SolutionEngine(), progress=False)
        runs[name] = tmp_path / name
    assert main([str(runs["bo4"]), "--curves", str(runs["bo2"])]) == 0
    points = {p["name"]: p for p in json.loads((runs["bo4"] / "vote_curve.json").read_text())["points"]}
    # bo2's first two solutions: bundled-1 5 then a tie that goes to the earlier 5; bundled-2 110 right.
    assert [points[f"best-of-{k}, majority (bo2)"]["correct"] for k in (1, 2)] == [1, 1]
    assert "best-of-3, majority (bo2)" not in points
