"""Confidence readings against values worked out by hand, the vote's weights, filter and ties, and
the early stop: on a scripted stream of answers it stops exactly when the vote is decided and never
changes the answer the whole budget gives; best-of-N in waves on a scripted engine."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from helpers import reply

from decoding import ConfigError
from decoding.base.values import Completion, DecodeStats, GenRequest, TokenLogprob
from tasks.base import Problem
from tasks.gsm8k import GSM8K
from tot.search.base import GenSettings, run_sync
from tot.search.best_of_n import BestOfN, BestOfNSettings
from tot.search.confidence import lowest_window, readings
from tot.search.vote import Ballot, VoteRule, check_stop, settled, tally, weights


def tokens(logprobs: list[float], top: list[tuple[float, float]] | None = None) -> list[TokenLogprob]:
    return [TokenLogprob(i, lp, ((0, top[i][0]), (1, top[i][1])) if top else ()) for i, lp in enumerate(logprobs)]


def test_readings_by_hand():
    # Twenty tokens: sixteen sure ones (log p -0.1), then four unsure ones (-2.0).
    lps = [-0.1] * 16 + [-2.0] * 4
    read = readings(tokens(lps), window=16)
    assert read["mean"] == pytest.approx(math.exp((16 * -0.1 + 4 * -2.0) / 20))
    # The least sure window of 16 is the last: twelve at -0.1 and four at -2.0.
    assert read["lowest_window"] == pytest.approx(math.exp((12 * -0.1 + 4 * -2.0) / 16))
    assert read["tail"] == read["lowest_window"]
    assert "tail_margin" not in read  # no top tokens came with the reply
    assert readings(tokens(lps), window=4)["tail"] == pytest.approx(math.exp(-2.0))
    assert lowest_window([-1.0, -3.0], window=16) == pytest.approx(math.exp(-2.0))  # shorter: the whole reply
    assert readings([])["mean"] == 1.0
    # The margin: the top token's probability less the second's, averaged over the last window.
    top = [(math.log(0.9), math.log(0.05))] * 2 + [(math.log(0.6), math.log(0.3))] * 2
    assert readings(tokens([-0.1] * 4, top), window=2)["tail_margin"] == pytest.approx(0.3)
    assert readings(tokens([-0.1] * 4, top), window=4)["tail_margin"] == pytest.approx((0.85 * 2 + 0.3 * 2) / 4)


def ballots(*spec: tuple[str, float]) -> list[Ballot]:
    return [Ballot(a, None, {"mean": c}) for a, c in spec]


def test_weights_filter_and_ties():
    b = ballots(("7", 0.9), ("5", 0.5), ("5", 0.4), ("7", 0.2))
    assert weights(VoteRule(), b, "one") == [1.0] * 4
    # Majority ties 2-2: more ballots (equal), then the earlier answer: 7.
    assert tally(VoteRule(), b, "one").winner == "7"
    assert tally(VoteRule(weight="mean"), b, "one").weight == pytest.approx({"7": 1.1, "5": 0.9})
    # Keep the surest half: 0.9 (7) and 0.5 (5); the weights are then 1 each, the earlier wins.
    assert weights(VoteRule(keep=0.5), b, "one") == [1.0, 1.0, None, None]
    assert weights(VoteRule(weight="mean", keep=0.5), b, "one") == [0.9, 0.5, None, None]
    # CISC's softmax: exp(r / T), relative to the largest; a low temperature lets the surest decide.
    soft = weights(VoteRule(weight="mean", temperature=0.1), b, "one")
    assert soft == pytest.approx([1.0, math.exp(-4), math.exp(-5), math.exp(-7)])
    assert (
        tally(VoteRule(weight="mean", temperature=0.1), ballots(("5", 0.5), ("5", 0.5), ("7", 0.9)), "one").winner
        == "7"
    )
    with pytest.raises(ValueError, match=r"no tail reading"):
        weights(VoteRule(weight="tail"), b, "one")


def test_the_rule_is_checked():
    with pytest.raises(ConfigError, match=r"vote\.weight='sure'"):
        VoteRule(weight="sure")
    with pytest.raises(ConfigError, match=r"vote\.keep=0"):
        VoteRule(keep=0)
    with pytest.raises(ConfigError, match=r"vote\.temperature=-1"):
        VoteRule(temperature=-1)
    with pytest.raises(ConfigError, match=r"search\.stop=decided stops when"):
        check_stop("decided", VoteRule(temperature=0.5), "one")
    with pytest.raises(ConfigError, match=r"search\.stop=decided stops when"):
        check_stop("decided", VoteRule(), "value")
    check_stop("decided", VoteRule(weight="tail"), "value")


def stop_point(answers: list[str], rule: VoteRule, stop: str, wave: int = 1) -> int:
    """How many of the stream's answers are drawn before `settled` stops it, `wave` at a time."""
    drawn = 0
    while drawn < len(answers):
        drawn = min(len(answers), drawn + wave)
        if settled(rule, ballots(*((a, 1.0) for a in answers[:drawn])), "one", len(answers) - drawn, stop, wave):
            break
    return drawn


def test_the_early_stop_stops_exactly_when_the_vote_is_decided():
    rule = VoteRule()
    # 8 ballots: after 5, "3" leads 5-0 and 3 remain: decided. After 4 it leads 4-0 with 4 to come: a tie
    # is still possible (and a tie goes to more ballots, then the earlier answer: still 3, but not by the lead).
    assert stop_point(["3"] * 8, rule, "decided") == 5
    assert stop_point(["3", "4", "3", "3", "3", "3", "4", "4"], rule, "decided") == 6
    assert stop_point(["3", "4"] * 4, rule, "decided") == 8  # never decided before the end
    assert stop_point(["3"] * 8, rule, "never") == 8
    # agree: a whole wave naming the leader stops it.
    assert stop_point(["3", "3", "4", "4", "4", "4", "3", "3"], rule, "agree", wave=2) == 2
    assert stop_point(["3", "4", "4", "4", "3", "3", "3", "3"], rule, "agree", wave=2) == 4
    # Over every stream of three answers in 8 draws: the decided stop never changes the answer.
    random.seed(0)
    streams = [list(s) for s in itertools.product("ab", repeat=8)] + [
        [random.choice("abc") for _ in range(8)] for _ in range(300)
    ]
    for stream in streams:
        for wave in (1, 2, 3):
            k = stop_point(stream, rule, "decided", wave)
            whole = tally(rule, ballots(*((a, 1.0) for a in stream)), "one").winner
            assert tally(rule, ballots(*((a, 1.0) for a in stream[:k])), "one").winner == whole, (stream, wave)
            # ... and stops no later than the first wave after which it is decided.
            for j in range(wave, k, wave):
                lead = tally(rule, ballots(*((a, 1.0) for a in stream[:j])), "one").lead()
                assert lead <= len(stream) - j, (stream, wave, j)


class StreamEngine:
    """Solution i states ANSWERS[i] (from its seed's place in the request order of its problem)."""

    def __init__(self, answers: list[str]) -> None:
        self.answers, self.asked = answers, 0

    async def agenerate(self, requests: list[GenRequest]) -> Completion:
        out = []
        for _ in requests:
            out.append(reply(f"So it is. The answer is {self.answers[self.asked]}.", [1] * 10))
            self.asked += 1
        return Completion(out, DecodeStats(generated_tokens=10 * len(requests)))


@pytest.mark.parametrize("wave", [1, 2, 3])
def test_best_of_n_in_waves_stops_when_decided_with_the_whole_budgets_answer(wave):
    answers = ["4", "6", "6", "6", "6", "6", "4", "4"]
    task, problem = GSM8K(solutions="same"), Problem("p", "q", "6")
    whole = run_sync(BestOfN.over(task, BestOfNSettings(n=8), GenSettings(), 0).solve(problem, StreamEngine(answers)))
    engine = StreamEngine(answers)
    early = run_sync(
        BestOfN.over(task, BestOfNSettings(n=8, wave=wave, stop="decided"), GenSettings(), 0).solve(problem, engine)
    )
    assert early.answer == whole.answer == "6"
    # "6" leads 5-1 after six with two to come: decided there (or at the wave's end past it).
    drawn = -(-6 // wave) * wave
    assert engine.asked == drawn and early.budget == {"samples": drawn, "budget": 8}
    assert early.phases["generate"].decode.generated_tokens == 10 * drawn
    assert whole.budget == {}


def test_a_ballot_with_no_answer_neither_wins_nor_agrees():
    """A path that stated no answer (or a program that failed) names nothing: three of them do not
    outvote one "7", and a wave of two of them is no agreement to stop on."""
    rule = VoteRule()
    assert tally(rule, ballots(("", 1.0), ("", 1.0), ("7", 1.0), ("", 1.0)), "one").winner == "7"
    assert tally(rule, ballots(("", 1.0), ("", 1.0)), "one").winner is None
    assert stop_point(["", "", "5", "5", "6", "6"], rule, "agree", wave=2) == 4
    assert stop_point(["", "", "", ""], rule, "agree", wave=2) == 4
    # Best-of-N end to end: the first wave states nothing, the second agrees on 9.
    task, problem = GSM8K(solutions="same"), Problem("p", "q", "9")
    engine = StreamEngine(["", "", "9", "9", "8", "8"])
    settings = BestOfNSettings(n=6, wave=2, stop="agree")
    solution = run_sync(BestOfN.over(task, settings, GenSettings(), 0).solve(problem, engine))
    assert solution.answer == "9" and engine.asked == 4
    engine = StreamEngine([""] * 4)
    assert run_sync(BestOfN.over(task, BestOfNSettings(n=4), GenSettings(), 0).solve(problem, engine)).answer == ""


def test_agree_needs_a_wave_of_two():
    with pytest.raises(ConfigError, match=r"search\.stop=agree stops once a whole wave agrees"):
        BestOfNSettings(stop="agree")
    with pytest.raises(ConfigError, match=r"search\.stop stops a vote"):
        BestOfNSettings(stop="decided", aggregate="best")
    assert BestOfNSettings(stop="agree", wave=2).stop == "agree"


def test_a_token_budget_ends_the_waves():
    """search.token_budget: no wave more once the problem's tokens reach it (10 tokens a solution here)."""
    task, problem = GSM8K(solutions="same"), Problem("p", "q", "6")
    engine = StreamEngine(["4", "6", "6", "6", "6", "6", "4", "4"])
    settings = BestOfNSettings(n=8, wave=2, token_budget=35)
    sol = run_sync(BestOfN.over(task, settings, GenSettings(), 0).solve(problem, engine))
    assert engine.asked == 4 and sol.budget == {"samples": 4, "budget": 8} and sol.answer == "6"
    with pytest.raises(ConfigError, match=r"search\.token_budget=35 stops between waves"):
        BestOfNSettings(token_budget=35)


def test_a_token_budget_ends_bfs_levels():
    from test_rollout import PROBLEM, RolloutEngine

    from tot.search.bfs import BFS, BFSSettings

    task = GSM8K(value="rollout", depth=2)
    full = run_sync(BFS.over(task, BFSSettings(n_thoughts=2), GenSettings(), 0).solve(PROBLEM, RolloutEngine()))
    cut = run_sync(
        BFS.over(task, BFSSettings(n_thoughts=2, token_budget=1), GenSettings(), 0).solve(PROBLEM, RolloutEngine())
    )
    assert {full.tree[n].depth for n in full.tree.graph.nodes if not full.tree[n].rollout} == {0, 1, 2}
    depths = {cut.tree[n].depth for n in cut.tree.graph.nodes if not cut.tree[n].rollout}
    assert depths == {0, 1} and cut.answer == "5"  # one level, then the vote over its completions
