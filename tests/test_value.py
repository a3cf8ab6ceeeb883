"""Values read from the evaluator's answer probabilities (task.value=expected / yes), and answers voted
over a tree's finished states (search.aggregate=vote)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from helpers import AwaitableFake, reply
from test_logprobs import plain_choice

from decoding.api.engine import Engine
from decoding.base.values import DecodeStats, GenRequest, GenResult, TokenLogprob
from tasks.base import DataError, Problem
from tasks.blocksworld.task import Blocksworld
from tasks.creative_writing import CreativeWriting
from tasks.gsm8k import GSM8K, SCORE_PREFIX, YES_PREFIX
from tot.search.base import GenSettings, choose, finished_states, run_sync
from tot.search.bfs import BFS, BFSSettings
from tot.search.mcts import MCTS, MCTSSettings
from tot.search.tree import ReasoningTree
from tot.search.value import answer_distribution, read_value

SCALE = GSM8K(value="expected").value_answers()
PROBLEM = Problem(id="p", question="A shop sells 3 boxes of 4 pens. How many pens does it sell?", gold="12")
GEN = GenSettings(temperature=0.6, max_thought_tokens=12, max_eval_tokens=8)


def logprobs_of(p: dict[str, float], answers: list[str]) -> list[float]:
    return [math.log(p[a]) for a in answers]


def test_an_expected_score_counts_each_answer_once():
    """P(" 1") as scored holds P(" 10"): the exact " 1" is what is left once " 10" is taken off; the
    value is the expectation over the renormalised exact answers."""
    answers = list(SCALE)
    scored = {a: 0.01 for a in answers} | {" 1": 0.3, " 10": 0.1, " 7": 0.4}
    dist = answer_distribution(answers, logprobs_of(scored, answers))
    exact = {a: 0.01 for a in answers} | {" 1": 0.2, " 10": 0.1, " 7": 0.4}
    total = sum(exact.values())
    assert dist == pytest.approx({a: q / total for a, q in exact.items()})
    read = read_value(SCALE, logprobs_of(scored, answers))
    assert read.value == pytest.approx(sum(SCALE[a] * exact[a] for a in answers) / total)
    # Nested answers: each takes off only the answers extending it directly.
    nested = {" 5": 0.5, " 56": 0.3, " 567": 0.1}
    assert answer_distribution(list(nested), logprobs_of(nested, list(nested))) == pytest.approx(
        {" 5": 0.4, " 56": 0.4, " 567": 0.2}
    )


def test_yes_is_p_yes_against_no():
    worth = GSM8K(value="yes").value_answers()
    read = read_value(worth, [math.log(0.06), math.log(0.02)])
    assert read.value == pytest.approx(0.75) and read.distribution == pytest.approx({" Yes": 0.75, " No": 0.25})
    assert Blocksworld(value="expected").value_answers() == {" good": 1.0, " bad": 0.0}
    assert CreativeWriting(value="expected").value_answers() == SCALE
    with pytest.raises(
        DataError, match=r"task.value=.yes. is not one of sampled, expected, confidence \(task=blocksworld\)"
    ):
        Blocksworld(value="yes")
    with pytest.raises(DataError, match=r"task.value=.likely. is not one of sampled, expected, yes, confidence"):
        GSM8K(value="likely")


class ChoiceEngine(AwaitableFake):
    """Thought k is " #k" (" k." after the final answer's prefix); an evaluation is a choice whose
    answers get the constructed distribution `dist(k)` of the thought k it values."""

    def __init__(self, dist) -> None:
        self.dist, self.thoughts, self.evaluations = dist, 0, []
        self.last_stats = DecodeStats()

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        results = []
        for r in requests:
            if r.choices:
                self.evaluations.append(r)
                k = int(re.findall(r"#(\d+)", r.prompt.split("\n\n")[-2])[-1])
                p = self.dist(k)
                results.append(GenResult("", [], "stop", choice_logprobs=logprobs_of(p, list(r.choices))))
            else:
                results.append(reply(f" #{self.thoughts}", [5] * 3))
                self.thoughts += 1
        self.last_stats = DecodeStats(generated_tokens=sum(len(r.token_ids) for r in results))
        return results


def peaked(k: int, answers: list[str], at: str) -> dict[str, float]:
    return {a: (0.5 if a == at else 0.5 / (len(answers) - 1)) for a in answers}


@pytest.mark.parametrize("mode", ["expected", "yes"])
def test_each_mode_values_a_state_by_its_definition(mode):
    """BFS with task.value=expected / yes: every evaluation is one choice request over the task's
    answers (task.n_evaluate ignored: nothing is sampled), nothing is generated for it, and each
    node's value is its definition's over the constructed distribution, kept in the tree."""
    task = GSM8K(thoughts="subquestions", depth=2, value=mode, n_evaluate=3)
    answers = list(task.value_answers())
    at = {k: answers[k % len(answers)] for k in range(20)}
    engine = ChoiceEngine(lambda k: peaked(k, answers, at[k]))
    sol = run_sync(BFS.over(task, BFSSettings(n_thoughts=3, breadth=1), GEN, 0).solve(PROBLEM, engine))
    tree = sol.tree
    assert len(engine.evaluations) == tree.graph.number_of_nodes() - 1  # one request per state
    assert {r.prefix for r in engine.evaluations} == {YES_PREFIX if mode == "yes" else SCORE_PREFIX}
    assert all(r.choices == tuple(answers) for r in engine.evaluations)
    assert sol.phases["evaluate"].decode.generated_tokens == 0
    worth = task.value_answers()
    for node in list(tree.graph.nodes)[1:]:
        k = int(re.findall(r"#(\d+)", tree[node].text)[-1])
        dist = peaked(k, answers, at[k])
        if mode == "yes":
            expected = dist[" Yes"] / (dist[" Yes"] + dist[" No"])
        else:
            exact = {a: dist[a] - (dist[" 10"] if a == " 1" else 0.0) for a in answers}
            expected = sum(worth[a] * exact[a] for a in answers) / sum(exact.values())
        assert tree[node].value == pytest.approx(expected)
        assert tree[node].distribution is not None and sum(tree[node].distribution.values()) == pytest.approx(1)
        assert tree[node].evaluation is None  # nothing was written


def test_a_real_engine_reads_the_values_of_a_plain_forward(long_context, tokenizer):
    """On the tiny model through the engine: each state's value is read_value of the answers'
    probabilities a plain forward of its evaluator prompt gives (for each of the rows batched)."""
    task = GSM8K(thoughts="subquestions", depth=1, value="expected")
    engine = Engine(long_context, "ar")
    sol = run_sync(BFS.over(task, BFSSettings(n_thoughts=2, breadth=1), GEN, 0).solve(PROBLEM, engine))
    worth = task.value_answers()
    for node in list(sol.tree.graph.nodes)[1:]:
        steps = sol.tree.steps(node)
        asked = task.evaluator_prompt(PROBLEM, steps)
        request = GenRequest(asked.text, prefix=asked.prefix, choices=tuple(worth))
        prompt = engine.encode(asked.text, asked.prefix)
        with torch.inference_mode():
            lps = [plain_choice(long_context.model, prompt, engine._answer(request, prompt, a)) for a in worth]
        assert sol.tree[node].value == pytest.approx(read_value(worth, lps).value, abs=1e-4)


class SureEngine(AwaitableFake):
    """Thought k is " #k", its tokens' probabilities 1 / (k + 2) each (asked with logprobs); any
    evaluation request is recorded."""

    def __init__(self) -> None:
        self.k, self.evaluations, self.asked = 0, [], []
        self.last_stats = DecodeStats()

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        out = []
        for r in requests:
            if r.prefix == SCORE_PREFIX:
                self.evaluations.append(r)
                out.append(reply(" 5", [7]))
                continue
            self.asked.append(r.logprobs and not r.keep)  # kept for no follow-up: none is asked
            result = reply(f" #{self.k}", [5] * 3)
            result.logprobs = [TokenLogprob(5, -math.log(self.k + 2))] * 3
            out.append(result)
            self.k += 1
        self.last_stats = DecodeStats(generated_tokens=sum(len(o.token_ids) for o in out))
        return out


def test_confidence_values_a_thought_by_its_own_tokens():
    """task.value=confidence: thoughts are asked with their log-probabilities (and, with no evaluator to
    follow them up, not kept for one), no evaluator is asked, and a node's value is its thought's
    geometric-mean token probability."""
    engine = SureEngine()
    task = GSM8K(thoughts="subquestions", depth=2, value="confidence", evaluator="in_context")
    sol = run_sync(BFS.over(task, BFSSettings(n_thoughts=3, breadth=1), GEN, 0).solve(PROBLEM, engine))
    assert engine.asked and all(engine.asked) and not engine.evaluations
    for node in list(sol.tree.graph.nodes)[1:]:
        k = int(re.findall(r"#(\d+)", sol.tree[node].text)[-1])
        assert sol.tree[node].value == pytest.approx(1 / (k + 2))
    assert sol.tree[1].value > sol.tree[2].value  # the surer thought ranks first
    # A reward model values the states in its place (here a judge: the task's evaluator replies, read as written).
    judge, task = SureEngine(), GSM8K(thoughts="subquestions", depth=2, value="confidence")
    run_sync(BFS.over(task, BFSSettings(n_thoughts=2, breadth=1), GEN, 0, reward=judge).solve(PROBLEM, SureEngine()))
    assert judge.evaluations and not any(r.choices for r in judge.evaluations)


def hand_built() -> tuple[ReasoningTree, dict[int, str]]:
    """Finished states answering 5 (values 9), 7 (4 + 4 + 3) and 7 again deeper; one unfinished."""
    tree = ReasoningTree("q")
    a = tree.add(0, "a", value=9.0, terminal=True)
    b = tree.add(0, "b", value=4.0, terminal=False)
    c = tree.add(b, "c", value=4.0, terminal=True)
    d = tree.add(b, "d", value=4.0, terminal=True)
    e = tree.add(0, "e", value=3.0, terminal=True)
    return tree, {a: "5", c: "7", d: "7", e: "7", b: "9"}


def test_the_weighted_vote_on_a_hand_built_tree():
    tree, answer = hand_built()
    finished = finished_states(tree)
    assert finished == [1, 3, 4, 5]  # b is not finished
    assert answer[choose(tree, finished, answer.get, "vote")] == "7"  # 11 against 9
    assert answer[choose(tree, finished, answer.get, "best")] == "5"
    tree[1].value = 12.0
    assert answer[choose(tree, finished, answer.get, "vote")] == "5"


class VoteEngine(AwaitableFake):
    """Every thought states an answer: thought k says "The answer is A" with A = answers[k] and is
    scored scores[k] (sampled values: "Score: s")."""

    def __init__(self, answers: list[str], scores: list[float]) -> None:
        self.answers, self.scores, self.k = answers, scores, 0
        self.last_stats = DecodeStats()

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        out = []
        for r in requests:
            if r.prefix == SCORE_PREFIX:
                k = int(re.findall(r"\[(\d+)\]", r.prompt)[-1])
                out.append(reply(f" {self.scores[k]:g}", [7]))
            else:
                out.append(reply(f"[{self.k}] The answer is {self.answers[self.k]}.", [5] * 3))
                self.k += 1
        self.last_stats = DecodeStats(generated_tokens=sum(len(o.token_ids) for o in out))
        return out


@pytest.mark.parametrize("search", ["bfs", "mcts"])
def test_bfs_and_mcts_vote_over_their_finished_states(search):
    """Four thoughts state 8, 3, 3, 3 valued 9, 5, 5, 5: best takes 8, the vote 3 (15 against 9)."""
    task = GSM8K(depth=2, value="sampled")
    answers, scores = ["8", "3", "3", "3"], [9, 5, 5, 5]
    for aggregate, expected in (("best", "8"), ("vote", "3")):
        if search == "bfs":
            searcher = BFS.over(task, BFSSettings(n_thoughts=4, breadth=1, aggregate=aggregate), GEN, 0)
        else:
            settings = MCTSSettings(iterations=1, n_thoughts=4, simulation_depth=0, parallel=1, aggregate=aggregate)
            searcher = MCTS.over(task, settings, GEN, 0)
        sol = run_sync(searcher.solve(PROBLEM, VoteEngine(answers, scores)))
        assert sol.answer == expected, aggregate


def test_choose_weighs_answers_by_value_or_counts_them():
    """Answers 8, 8, 3 valued 1, 1, 9: the vote takes 3 (9 against 2), the majority 8, best 3."""
    tree = ReasoningTree("q")
    leaves = [tree.add(tree.root, a) for a in ("8", "8", "3")]
    for s, v in zip(leaves, (1.0, 1.0, 9.0)):
        tree[s].value = v
    answer = {s: tree[s].text for s in leaves}.__getitem__
    assert [answer(choose(tree, leaves, answer, rule)) for rule in ("vote", "majority", "best")] == ["3", "8", "3"]


def test_the_auc_within_problems_is_not_fooled_by_values_that_follow_difficulty():
    """Values higher on the easy problems, but each problem's wrong state above its right one: pooled
    over problems the AUC says 0.667; within problems, where a search chooses, 0."""
    from tot.separation import Separation, Values

    easy, hard = Values([0.8], [0.9]), Values([0.3], [0.4])
    sep = Separation([easy, hard, Values([0.85], []), Values([], [0.1, 0.1])])
    assert sep.within_auc == 0.0 and sep.pooled_auc == 8 / 12
    assert "AUC within problems 0.000 (2 pairs), pooled 0.667" in sep.line("r")


def test_separation_reads_how_well_values_tell_right_from_wrong(tmp_path, capsys):
    """tot.separation over a run's finished states: values that know nothing give 0.5; values that put
    every right answer above every wrong one give 1."""
    from test_run import FakeEngine, make_config

    from tot.runs.run import run
    from tot.separation import main, separation

    out = tmp_path / "run"
    run(make_config("data.limit=2"), out, engine=FakeEngine(), progress=False)  # answers 12: one problem right
    even = separation(out)
    assert even.right and even.wrong and even.pooled_auc == 0.5  # every state scored 7
    assert even.within_auc is None  # no problem has both a right and a wrong state
    assert (even.problems, even.reachable) == (2, 1)
    right = out / "trees" / "bundled-1.json"  # gold 12
    saved = json.loads(right.read_text())
    for n in saved["nodes"]:
        n["value"] = 9.0 if n["id"] else n["value"]
    right.write_text(json.dumps(saved))
    assert even.solved == {"run": 1, "best": 1, "vote": 1, "majority": 1}
    assert separation(out).pooled_auc == 1.0
    assert main([str(out)]) == 0
    assert "pooled 1.000; a right answer among the finished states of 1 of 2 problems" in capsys.readouterr().out
    assert main([str(tmp_path / "none")]) == 2 and "no summary.json" in capsys.readouterr().err


def test_separation_scores_each_confidence_reading_the_trees_kept(tmp_path, capsys):
    """Finished states whose replies kept their readings: one line per reading, its AUC and its vote."""
    from test_run import FakeEngine, make_config

    from tot.runs.run import run
    from tot.separation import main, separation

    out = tmp_path / "run"
    run(make_config("data.limit=2"), out, engine=FakeEngine(), progress=False)  # bundled-1 right, bundled-2 wrong
    assert separation(out).readings == {}  # nothing asked for log-probabilities
    for name, sure in (("bundled-2", 0.2), ("bundled-1", 0.9)):
        path = out / "trees" / f"{name}.json"
        saved = json.loads(path.read_text())
        for n in saved["nodes"]:
            n["confidence"] = {"mean": sure, "lowest_window": sure / 2, "tail": 1 - sure}
        path.write_text(json.dumps(saved))
    sep = separation(out)
    assert list(sep.readings) == ["mean", "lowest_window", "tail"]
    assert sep.readings["mean"].pooled_auc == 1.0 and sep.readings["tail"].pooled_auc == 0.0
    assert sep.readings["mean"].solved == {"vote": 1}
    assert main([str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 4 and printed[3].startswith("  tail: ") and "pooled 0.000" in printed[3]
