"""Mutual consistency (reward.kind=consistency, rStar's discriminator) on scripted engines: the reward
model is shown a path's first paragraphs with the rest masked, its completions' agreement with the path's
answer is the path's value, and a weighted vote so counts the consistent solutions alone."""

from __future__ import annotations

import pytest
from helpers import reply

from decoding import ConfigError, ModelSpec
from decoding.base.values import Completion, DecodeStats, GenRequest
from tasks.base import Problem
from tasks.gsm8k import GSM8K
from tot.search.base import GenSettings, run_sync
from tot.search.best_of_n import BestOfN, BestOfNSettings
from tot.search.bfs import BFS, BFSSettings
from tot.search.reward import Discriminator, RewardSpec

PROBLEM = Problem(id="p", question="How many?", gold="5")
# Four solutions of three paragraphs: three answer 7, one 5; the discriminator, shown a first paragraph,
# reaches 5 from "Count the apples." and 9 from anything else.
SOLUTIONS = [
    "Count the pears.\n\nThere are 7.\n\nThe answer is 7.",
    "Count the pears.\n\nSeven of them.\n\nThe answer is 7.",
    "Count the apples.\n\nThat is 7.\n\nThe answer is 7.",
    "Count the apples.\n\nThere are 5.\n\nThe answer is 5.",
]


class Solver:
    """The target: solution i for the i-th request (by seed order of asking), thoughts for BFS."""

    def __init__(self, thoughts: list[str] | None = None) -> None:
        self.thoughts, self.asked = thoughts, 0

    async def agenerate(self, requests: list[GenRequest]) -> Completion:
        out = []
        for _ in requests:
            texts = self.thoughts or SOLUTIONS
            out.append(reply(texts[self.asked % len(texts)], [1, 2, 3]))
            self.asked += 1
        return Completion(out, DecodeStats(generated_tokens=3 * len(out)))


class Completer:
    """The discriminator: from "Count the apples." 5; otherwise the j-th completion of a prompt answers
    ANSWERS[j]."""

    ANSWERS = ("9", "9", "4")

    def __init__(self) -> None:
        self.requests: list[GenRequest] = []
        self.seen: dict[str, int] = {}

    async def agenerate(self, requests: list[GenRequest]) -> Completion:
        self.requests += requests
        out = []
        for r in requests:
            j = self.seen.get(r.prefix, 0)
            self.seen[r.prefix] = j + 1
            said = "5" if r.prefix.startswith("Count the apples.") else self.ANSWERS[j % 3]
            out.append(reply(f"So it is {said}.\n\nThe answer is {said}.", [4, 5]))
        return Completion(out, DecodeStats(generated_tokens=2 * len(out)))


def discriminator(**options: object) -> tuple[Discriminator, Completer]:
    engine = Completer()
    return Discriminator(RewardSpec(ModelSpec(path="judge"), kind="consistency", **options), engine), engine


def best_of_4(aggregate: str, **options: object):
    reward, engine = discriminator(**options)
    search = BestOfN.over(
        GSM8K(solutions="same"), BestOfNSettings(n=4, aggregate=aggregate), GenSettings(), 0, reward=reward
    )
    return run_sync(search.solve(PROBLEM, Solver())), engine


def test_a_solution_is_valued_by_the_reward_models_completion_of_its_masked_tail():
    sol, engine = best_of_4("weighted")
    leaves = sorted((n for n in sol.tree.graph.nodes if sol.tree[n].terminal), key=lambda n: sol.tree[n].solution)
    # Shown the first of three paragraphs (hint 0.5, rounded down), the rest masked.
    assert sorted(r.prefix for r in engine.requests) == sorted(
        ["Count the pears.\n\n"] * 2 + ["Count the apples.\n\n"] * 2
    )
    assert all(r.stop == () and r.max_new_tokens == 384 for r in engine.requests)
    assert [sol.tree[n].value for n in leaves] == [0.0, 0.0, 0.0, 1.0]
    assert sol.tree[leaves[3]].evaluation == "1 of 1 completions from paragraph 2 answer 5"
    # The weighted vote counts the one consistent solution; the majority of the same four answers 7.
    assert sol.answer == "5"
    majority, _ = best_of_4("majority")
    assert majority.answer == "7"
    # What the reward model generated is the evaluation phase's.
    assert sol.phases["evaluate"].decode.generated_tokens == 8


def test_the_hint_and_the_number_of_completions_are_options():
    sol, engine = best_of_4("weighted", hint=0.0, completions=3)
    assert {r.prefix for r in engine.requests} == {""}  # shown nothing: the reward model solves alone
    assert len(engine.requests) == 12 and len({r.seed for r in engine.requests}) == 12
    # Alone, its completions answer 9, 9, 4 for each: no solution agrees, and every weight is 0.
    assert all(sol.tree[n].value == 0.0 for n in sol.tree.graph.nodes if sol.tree[n].terminal)
    sol, _ = best_of_4("weighted", hint=0.7, completions=2)
    assert {r.prefix.count("\n\n") for r in _.requests} == {2}  # 0.7 of 3 paragraphs: 2


def test_a_state_with_no_answer_yet_is_valued_by_the_completions_agreement():
    """BFS: an unfinished state is completed from all its paragraphs (nothing of it masked), and valued
    by the share of its completions reaching their own most frequent answer (9, 9, 4: 2 of 3); a finished
    one, shown none of its one paragraph (hint 0), by the share reaching its answer."""
    reward, engine = discriminator(completions=3, hint=0.0)
    thoughts = ["Count the pears.", "The answer is 9."]
    task = GSM8K(depth=2)
    search = BFS.over(task, BFSSettings(n_thoughts=2, breadth=1), GenSettings(), 0, reward=reward)
    sol = run_sync(search.solve(PROBLEM, Solver(thoughts)))
    tree = sol.tree
    by_text = {tree[n].text: n for n in tree.children(tree.root)}
    assert tree[by_text["Count the pears."]].value == pytest.approx(2 / 3)
    assert tree[by_text["Count the pears."]].evaluation == "2 of 3 completions from paragraph 2 answer 9"
    assert tree[by_text["The answer is 9."]].value == pytest.approx(2 / 3)  # its own answer, 9, by 2 of 3
    assert sorted({r.prefix for r in engine.requests}) == ["", "Count the pears.\n\n"]


@pytest.mark.parametrize(
    ("options", "named"),
    [({"hint": 1.0}, "reward.hint=1.0"), ({"hint": -0.1}, "reward.hint"), ({"completions": 0}, "reward.completions")],
)
def test_bad_consistency_options_are_one_line(options, named):
    with pytest.raises(ConfigError, match=named):
        RewardSpec(ModelSpec(path="judge"), kind="consistency", **options)


def test_a_task_without_rollouts_is_refused_at_load():
    from test_run import make_config

    with pytest.raises(ConfigError, match=r"reward\.kind=consistency .* task=creative_writing"):
        make_config("task=creative_writing", "reward.path=somewhere", "reward.kind=consistency")
    weighted = ("search=best_of_n", "search.aggregate=weighted")
    with pytest.raises(ConfigError, match=r"task\.solutions=same"):
        make_config("task=gsm8k", *weighted, "reward.path=somewhere", "reward.kind=consistency")
    make_config("task=gsm8k", "reward.path=somewhere", "reward.kind=consistency")  # loads nothing yet
    make_config("task=gsm8k", *weighted, "task.solutions=same", "reward.path=somewhere", "reward.kind=consistency")
    # The majority vote (GSM8K's default search) reads no value: a reward model there would load for nothing.
    with pytest.raises(ConfigError, match=r"search\.aggregate=majority never reads"):
        make_config("task=gsm8k", "search=best_of_n", "task.solutions=same", "reward.path=somewhere")
