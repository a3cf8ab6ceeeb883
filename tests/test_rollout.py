"""Rollout values (task.value=rollout) on a scripted engine: a state valued by the share of its
completions that reach the problem's plurality, every completion a ballot of the vote, the values read
against one plurality, MCTS's simulation as the rollouts, and trees that do not depend on the order
requests finish in."""

from __future__ import annotations

import asyncio
import math

import pytest
from helpers import reply

from decoding.base.values import Completion, DecodeStats, GenRequest, GenResult, Group, TokenLogprob
from tasks.base import DataError, Problem, Values
from tasks.creative_writing import CreativeWriting
from tasks.gsm8k import GSM8K
from tot.search.base import GenSettings, path_confidence, run_sync
from tot.search.bfs import BFS, BFSSettings
from tot.search.mcts import MCTS, MCTSSettings
from tot.search.vote import PLAIN_VOTE, VoteRule

PROBLEM = Problem(id="p", question="How many?", gold="5")
# A state's path (its thoughts) -> the thoughts sampled from it, and the answers its completions state.
THOUGHTS = {(): ["A", "B"], ("A",): ["A1 The answer is 7.", "A2 The answer is 7."]}
COMPLETIONS = {("A",): [5, 5], ("B",): [5, 9]}


def path_of(r: GenRequest) -> tuple[str, ...]:
    return tuple(s for s in r.prefix.split("\n\n") if s)


class RolloutEngine:
    """Thoughts as THOUGHTS lists them (the i-th request of a state the i-th), completions stating
    COMPLETIONS' answers; with `scramble`, each request waits a seed-given number of turns. Each reply's
    tokens have log-probability -0.1 a token, the completions' j-th -0.1 * (j + 1)."""

    def __init__(self, scramble: bool = False, thoughts: dict | None = None, completions: dict | None = None) -> None:
        self.scramble = scramble
        self.thoughts = THOUGHTS if thoughts is None else thoughts
        self.completions = COMPLETIONS if completions is None else completions
        self.requests: list[GenRequest] = []
        self.asked: dict[tuple, int] = {}

    async def agenerate(self, requests: list[GenRequest]) -> Completion:
        self.requests += requests
        out = [self.answer(r) for r in requests]  # in the order asked: the i-th thought of a state the i-th
        for _ in range(requests[0].seed % 5 if self.scramble else 1):
            await asyncio.sleep(0)
        return Completion(out, DecodeStats(generated_tokens=sum(len(o.token_ids) for o in out)))

    def answer(self, r: GenRequest) -> GenResult:
        path = path_of(r)
        key = (path, r.stop == ())
        i = self.asked.get(key, 0)
        self.asked[key] = i + 1
        if r.stop == ():  # a completion to the answer
            answers = self.completions.get(path, [5, 5])
            text, lp = f"Then more. The answer is {answers[i % len(answers)]}.", -0.1 * (i % 2 + 1)
        else:
            listed = self.thoughts.get(path)
            text, lp = (listed[i % len(listed)] if listed else f"{path[-1]}.{i}"), -0.1
        out = reply(text, [1, 2, 3])
        if r.logprobs:
            top = ((1, lp), (2, lp - 2.0)) if r.top_logprobs else ()
            out.logprobs = [TokenLogprob(t, lp, top) for t in (1, 2, 3)]
        return out


def bfs(vote: VoteRule = PLAIN_VOTE, scramble: bool = False, **task):
    engine = RolloutEngine(scramble)
    search = BFS.over(GSM8K(value="rollout", depth=2, **task), BFSSettings(n_thoughts=2), GenSettings(), 0, vote=vote)
    return run_sync(search.solve(PROBLEM, engine)), engine


def by_text(tree) -> dict[str, int]:
    return {tree[n].text: n for n in tree.graph.nodes}


def test_a_state_is_valued_by_the_share_of_its_completions_that_reach_the_plurality():
    sol, engine = bfs()
    tree = sol.tree
    node = by_text(tree)
    a, b = node["A"], node["B"]
    # Ballots: A's completions 5, 5, B's 5, 9, the finished thoughts A1 and A2 7, 7: the plurality is 5.
    assert tree[a].value == 1.0 and tree[b].value == 0.5
    assert tree[a].chosen and not tree[b].chosen  # BFS went on from A alone
    assert [tree[c].value for c in tree.rollouts(b)] == [1.0, 0.0]
    assert tree[node["A1 The answer is 7."]].value == 0.0
    # The completions count in the vote: the finished thoughts alone would answer 7.
    assert sol.answer == "5" and tree[b].evaluation == "1 of 2 completions answer 5"
    # Completions hang below their state, outside its thoughts.
    assert tree.children(a) == [node["A1 The answer is 7."], node["A2 The answer is 7."]]
    assert len(tree.rollouts(a)) == 2 and all(tree[c].terminal for c in tree.rollouts(a))
    # Finished thoughts are not completed; a state's completions continue its children's prompt in their group.
    completions = [r for r in engine.requests if r.stop == ()]
    assert len(completions) == 4
    assert {(r.prefix, r.group) for r in completions} == {("A\n\n", Group("p", str(a))), ("B\n\n", Group("p", str(b)))}
    assert {r.max_new_tokens for r in completions} == {384}
    assert all(not r.logprobs for r in engine.requests)  # nothing reads them under the plain vote


def test_completions_are_weighted_by_their_confidence_where_the_vote_is():
    """vote.weight=mean: a completion weighs its whole path's mean token probability: B's three tokens
    at -0.1 and its own three at -0.1 (answering 5) or -0.2 (answering 9); B's value is the share of
    that weight that reaches 5."""
    sol, engine = bfs(VoteRule(weight="mean"))
    tree = sol.tree
    b = by_text(tree)["B"]
    five, nine = tree.rollouts(b)
    assert path_confidence(tree, five)["mean"] == pytest.approx(math.exp(-0.1))
    assert path_confidence(tree, nine)["mean"] == pytest.approx(math.exp(-0.15))
    assert tree[b].value == pytest.approx(math.exp(-0.1) / (math.exp(-0.1) + math.exp(-0.15)))
    assert all(r.logprobs for r in engine.requests)


def test_the_tree_does_not_depend_on_the_order_replies_finish_in():
    plain, _ = bfs()
    scrambled, _ = bfs(scramble=True)
    assert plain.tree.to_dict() == scrambled.tree.to_dict()


def test_mcts_simulates_by_its_completions_and_returns_their_agreement():
    engine = RolloutEngine()
    task = GSM8K(value="rollout", depth=3)
    settings = MCTSSettings(iterations=1, n_thoughts=2, simulation_depth=2, parallel=1)
    sol = run_sync(MCTS.over(task, settings, GenSettings(), 0).solve(PROBLEM, engine))
    tree = sol.tree
    # One iteration: the root expanded, its children completed, no simulation level below them.
    assert [tree[n].depth for n in tree.graph.nodes if not tree[n].rollout] == [0, 1, 1]
    a = by_text(tree)["A"]
    assert tree[a].visits == 1 and tree[a].q == 1.0  # its return: its completions' agreement
    scrambled = run_sync(MCTS.over(task, settings, GenSettings(), 0).solve(PROBLEM, RolloutEngine(scramble=True)))
    assert scrambled.tree.to_dict() == tree.to_dict()


def stopped_bfs(stop: str, completions: dict, depth: int = 2, **settings) -> tuple:
    engine = RolloutEngine(thoughts={(): ["A", "B", "C", "D"]}, completions=completions)
    task = GSM8K(value="rollout", depth=depth, rollouts=2)
    search = BFS.over(task, BFSSettings(stop=stop, **settings), GenSettings(), 0, vote=VoteRule(weight="one"))
    return run_sync(search.solve(PROBLEM, engine)), engine


def thought_depth(tree) -> int:
    return max(tree[n].depth for n in tree.graph.nodes if not tree[n].rollout)


def test_bfs_stops_once_no_level_to_come_can_change_the_vote():
    """Four first thoughts, two completions each: 8 ballots for 5 after level 1, where level 2 (one
    state, one thought, finished at the depth limit) can add 1: decided stops there, with the answer
    every level gives. Where level 1 splits 5 against 9 (lead 0), it grows level 2."""
    shape = {"root_thoughts": 4, "n_thoughts": 1}
    agreed = {}  # every completion answers 5
    full, full_engine = stopped_bfs("never", agreed, **shape)
    early, early_engine = stopped_bfs("decided", agreed, **shape)
    assert early.answer == full.answer == "5"
    assert thought_depth(early.tree) == 1 < thought_depth(full.tree) == 2
    assert len(early_engine.requests) == 12 < len(full_engine.requests) == 13
    assert early.budget == {"levels": 1, "budget": 2} and full.budget == {}
    split = {(t,): [5, 9] for t in "ABCD"}
    grown, _ = stopped_bfs("decided", split, **shape)
    assert grown.budget == {"levels": 2, "budget": 2}  # it ran to its end: no level saved


def test_bfs_agree_stops_once_a_levels_ballots_all_name_the_leader():
    """Depth 3, two thoughts a level, two completions each: after level 1 (4 ballots for 5) the levels
    to come could add 6 + 2: decided grows level 2 (8 for 5 against the last level's 2) and stops there;
    agree stops once level 1's completions all answer the leader's 5, and not where one dissents."""
    shape = {"n_thoughts": 2, "depth": 3}
    decided, _ = stopped_bfs("decided", {}, **shape)
    agreed, _ = stopped_bfs("agree", {}, **shape)
    dissent, _ = stopped_bfs("agree", {("B",): [5, 9]}, **shape)
    assert decided.budget == {"levels": 2, "budget": 3}
    assert agreed.budget == {"levels": 1, "budget": 3} and agreed.answer == "5"
    assert dissent.budget["levels"] > 1


def test_bfs_stop_needs_a_vote_of_weights_known_as_they_come():
    from decoding import ConfigError
    from tot.search.bfs import check_config

    with pytest.raises(ConfigError, match=r"search\.aggregate=vote"):
        BFSSettings(stop="decided", aggregate="best")
    with pytest.raises(ConfigError, match="not one of"):
        BFSSettings(stop="soon")
    with pytest.raises(ConfigError, match="weight=value"):
        check_config(BFSSettings(stop="decided"), PLAIN_VOTE, {"value": "rollout"})
    check_config(BFSSettings(stop="decided"), VoteRule(weight="one"), {"value": "rollout"})


def test_rollout_values_need_paragraphs():
    with pytest.raises(DataError, match=r"task\.thoughts=paragraphs"):
        GSM8K(value="rollout", thoughts="subquestions")
    with pytest.raises(DataError, match=r"task\.rollouts=0"):
        GSM8K(value="rollout", rollouts=0)


def test_values_read_a_tasks_options_once_and_complete_only_what_can_be():
    """`Values.of` carries task.value and its options to a search; a task without `rollout_prompt`
    (Creative Writing) is one whose paths no completion continues: asked to, one DataError naming the fix."""
    task = GSM8K(value="rollout", rollouts=3, rollout_tokens=50, evaluator="in_context")
    values = Values.of(task)
    assert (values.mode, values.rollouts, values.rollout_tokens, values.in_context) == ("rollout", 3, 50, True)
    assert values.rollout_prompt(PROBLEM, ["A"]) == task.rollout_prompt(PROBLEM, ["A"])
    plan = Values.of(CreativeWriting())
    assert plan.completes is None and plan.prompts.value_answers()
    with pytest.raises(DataError, match=r"no rollout_prompt.*\(gsm8k\)"):
        plan.rollout_prompt(PROBLEM, ["a plan"])


# search.foresight: completions from a state (by its path), in request order.
FORESIGHT = {
    (): ["A\n\nSo 5. The answer is 5.", "B\n\nThe answer is 9.", "A\n\nThe answer is 5."],
    ("A",): ["A1 The answer is 5.", "A2\n\nThe answer is 7.", "A3\n\nThe answer is 5."],
}


class ForesightEngine(RolloutEngine):
    def answer(self, r: GenRequest) -> GenResult:
        assert r.stop == (), "foresight asks for completions alone"
        path = path_of(r)
        i = self.asked.get(path, 0)
        self.asked[path] = i + 1
        return reply(FORESIGHT[path][i], [1, 2, 3, 4])


def test_foresight_takes_a_states_thoughts_from_the_completions_that_value_them():
    engine = ForesightEngine()
    task = GSM8K(value="rollout", depth=3)
    sol = run_sync(BFS.over(task, BFSSettings(n_thoughts=3, foresight=True), GenSettings(), 0).solve(PROBLEM, engine))
    tree = sol.tree
    texts = [(tree[n].text, tree[n].rollout, tree[n].value) for n in tree.graph.nodes if n]
    # Depth 1: A (5), B (9), A again (5): the plurality 5; BFS goes on from the first A. Depth 2: A1 states 5
    # itself (a finished thought, no completion below it), A2's completion 7, A3's 5.
    assert texts == [
        ("A", None, 1.0), ("B", None, 0.0), ("A", None, 1.0),
        ("So 5. The answer is 5.", True, 1.0), ("The answer is 9.", True, 0.0), ("The answer is 5.", True, 1.0),
        ("A1 The answer is 5.", None, 1.0), ("A2", None, 0.0), ("A3", None, 1.0),
        ("The answer is 7.", True, 0.0), ("The answer is 5.", True, 1.0),
    ]  # fmt: skip
    assert sol.answer == "5" and tree[7].terminal and not tree.rollouts(7)
    assert len(engine.requests) == 6 and {r.group for r in engine.requests} == {Group("p", "0"), Group("p", "1")}
    assert sol.phases["rollout"].calls == 6 and sol.phases["generate"].calls == 0


def test_foresight_needs_rollout_values():
    from test_run import make_config

    from tot.runs.config import ConfigError

    with pytest.raises(ConfigError, match=r"search\.foresight=true .* needs task\.value=rollout"):
        make_config("search.foresight=true", "task.value=confidence")
    assert make_config(
        "search.foresight=true", "task.value=rollout", "task.thoughts=paragraphs"
    ).search_settings.foresight


def test_the_summary_counts_the_levels_a_stop_saved():
    from tot.runs.results import _budget

    records = [
        {"tokens": 300, "budget": {"levels": 1, "budget": 3}},  # stopped after one level of three
        {"tokens": 500, "budget": {"levels": 2, "budget": 2}},  # ran to its end
        {"tokens": 100},
    ]
    # A BFS's depth limit bounds it, not what its full run would grow: no tokens claimed as saved.
    assert _budget(records) == {"levels_drawn": 3, "levels_budget": 5}
    iterations = [{"tokens": 300, "budget": {"iterations": 3, "budget": 4}}]
    assert _budget(iterations) == {"iterations_drawn": 3, "iterations_budget": 4, "tokens_saved_estimate": 100}
    assert _budget([{"tokens": 80, "budget": {"samples": 2, "budget": 4}}])["samples_drawn"] == 2


def stopped_mcts(stop: str, completions: dict, iterations: int) -> tuple:
    engine = RolloutEngine(thoughts={(): ["A", "B"]}, completions=completions)
    settings = MCTSSettings(iterations=iterations, n_thoughts=2, parallel=1, aggregate="vote", stop=stop)
    search = MCTS.over(
        GSM8K(value="rollout", depth=6, rollouts=2), settings, GenSettings(), 0, vote=VoteRule(weight="one")
    )
    return run_sync(search.solve(PROBLEM, engine)), engine


def test_mcts_stops_once_the_iterations_left_cannot_change_the_vote():
    """Each iteration expands a leaf into two thoughts with two completions each (4 ballots, at most 6
    by the bound: two thoughts, each a ballot with two completions). Every completion answers 5: after
    4 of 5 iterations the lead (16) passes what one more could add (6), so decided stops there with the
    full run's answer; agree stops after the first wave, whose 4 ballots all name the leader."""
    full, full_engine = stopped_mcts("never", {}, 5)
    early, early_engine = stopped_mcts("decided", {}, 5)
    assert early.answer == full.answer == "5"
    assert early.budget == {"iterations": 4, "budget": 5} and full.budget == {}
    assert len(early_engine.requests) < len(full_engine.requests)
    agreed, _ = stopped_mcts("agree", {}, 5)
    assert agreed.budget == {"iterations": 1, "budget": 5} and agreed.answer == "5"
    split = {(t,): [5, 9] for t in ("A", "B")}  # level 1 splits: agree does not stop on it
    assert stopped_mcts("agree", split, 2)[0].budget["iterations"] == 2


def test_mcts_stop_needs_the_vote():
    from decoding import ConfigError
    from tot.search.mcts import check_stop_rule

    with pytest.raises(ConfigError, match=r"search\.aggregate=vote"):
        MCTSSettings(stop="decided")
    with pytest.raises(ConfigError, match="weight=value"):
        check_stop_rule(MCTSSettings(stop="agree", aggregate="vote"), PLAIN_VOTE, {"value": "rollout"})
