"""ToT-BFS on a scripted fake engine: batching per step, groups, seeds, pruning, the answer path, stats."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from helpers import AwaitableFake, reply

from decoding import ConfigError
from decoding.base.values import DecodeStats, GenRequest, GenResult, Group
from tasks.base import Problem
from tasks.gsm8k import FINAL_PREFIX, GSM8K, SCORE_PREFIX
from tot.runs.saved import ShowError, read_tree, save_tree
from tot.search.base import GenSettings, request_seed, run_sync
from tot.search.bfs import BFS, BFSSettings
from tot.search.tree import ReasoningTree

PROBLEM = Problem(id="p", question="A shop sells 3 boxes of 4 pens. How many pens does it sell?", gold="12")
_LAST_STEP = re.compile(r"is:\n(.*)\n\n")


class ScriptedEngine(AwaitableFake):
    """Thought k (k counts thought requests in the order they arrive) is " #k", or " k." for a final
    answer; an evaluation of thought k replies with the score scores[k] (or the text scores[k]).
    Records every call in `raw_calls`, and in `calls` the runs of calls of one kind (thoughts or
    evaluations): a search step's batch as the engine sees it."""

    def __init__(self, scores: dict[int, float]) -> None:
        self.scores = scores
        self.calls: list[list[GenRequest]] = []
        self.raw_calls: list[list[GenRequest]] = []
        self.thoughts = 0
        self.same_as: dict[int, int] = {}  # thought k written in the words of thought same_as[k]
        self.last_stats = DecodeStats()

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        self.raw_calls.append(list(requests))
        if self.calls and is_eval(self.calls[-1][0]) == is_eval(requests[0]):
            self.calls[-1].extend(requests)
        else:
            self.calls.append(list(requests))
        results = []
        for r in requests:
            if r.prefix == SCORE_PREFIX:
                k = int(re.findall(r"\d+", _LAST_STEP.search(r.prompt).group(1))[-1])
                score = self.scores[k]
                text = score if isinstance(score, str) else f" {score:g}, because the step looks right."
                results.append(reply(text, [7] * 2))
            else:
                k = self.same_as.get(self.thoughts, self.thoughts)
                self.thoughts += 1
                text = f" {k}." if r.prefix == FINAL_PREFIX else f" #{k}"
                results.append(reply(text, [5] * 3))
        n = sum(len(r.token_ids) for r in results)
        self.last_stats = DecodeStats(generated_tokens=n, target_forwards=len(requests) + 1, verify_steps=n)
        return results


def is_eval(r: GenRequest) -> bool:
    return r.prefix == SCORE_PREFIX


# Depth 3, n=3, b=2. Thought k is tree node k + 1.
#   depth 1: t0..t2 from the root; values 5, 8, 8 -> keep t1, t2 (a tie, both kept)
#   depth 2: t3..t5 from t1, t6..t8 from t2; values 2, 9, 4, 9, 6, 9 -> keep t4, t6 (t8 also 9: generated later)
#   depth 3: t9..t11 from t4, t12..t14 from t6; values 3, 7, 7, 10, 1, 10 -> keep t12, t14; answer t12 -> "12"
SCORES = {0: 5, 1: 8, 2: 8, 3: 2, 4: 9, 5: 4, 6: 9, 7: 6, 8: 9, 9: 3, 10: 7, 11: 7, 12: 10, 13: 1, 14: 10}
GEN = GenSettings(temperature=0.6, top_p=0.9, top_k=5, max_thought_tokens=40, max_eval_tokens=20, eval_temperature=0.3)


def solve(scores=SCORES, depth=3, n=3, b=2, seed=0, gen=GEN, problem=PROBLEM):
    engine = ScriptedEngine(scores)
    task = GSM8K(thoughts="subquestions", depth=depth, value="sampled")
    sol = run_sync(BFS.over(task, BFSSettings(n_thoughts=n, breadth=b), gen, seed).solve(problem, engine))
    return sol, engine


def node(k: int) -> int:
    return k + 1


def test_one_batch_per_phase_per_depth():
    _, engine = solve()
    sizes = [(len(c), {is_eval(r) for r in c}) for c in engine.calls]
    # depth 1 expands the root only (n requests); later depths b*n; each followed by their evaluations.
    assert sizes == [(3, {False}), (3, {True}), (6, {False}), (6, {True}), (6, {False}), (6, {True})]
    # Each thought is its own call, and so is each evaluation: sent as soon as its thought is done.
    assert all(len(c) == 1 for c in engine.raw_calls)


def test_the_search_names_its_rounds_and_a_plug_ins_group_still_works():
    """BFS names each depth ("d1"): a state's thoughts are siblings, and the depth's evaluations; a
    plug-in that passes a `Group` of its own (the earlier API) gets its evaluations pooled in it."""
    _, engine = solve()
    assert {r.group for r in engine.calls[1]} == {Group("p", "d1/eval")}
    assert {r.group for r in engine.calls[3]} == {Group("p", "d2/eval")}
    engine = ScriptedEngine(SCORES)
    task = GSM8K(thoughts="subquestions", depth=3, value="sampled")
    thinker = BFS.over(task, BFSSettings(n_thoughts=3, breadth=2), GEN, 0).thinker(PROBLEM, engine)
    run_sync(thinker.grow([(thinker.tree.root, 3, "")], Group("mine", "evals")))
    assert [r.group for r in engine.calls[0]] == [Group("p", "0")] * 3
    assert {r.group for r in engine.calls[1]} == {Group("mine", "evals")}


def test_a_copied_sibling_takes_no_second_place_and_the_problem_may_grow_more_first_thoughts():
    task = GSM8K(thoughts="subquestions", depth=2, value="sampled")
    # t1 writes t0's words: one state goes on from depth 1 (search.distinct, the default), or both copies.
    for distinct, expanded in ((True, 1), (False, 2)):
        engine = ScriptedEngine(SCORES)
        engine.same_as = {1: 0}
        settings = BFSSettings(n_thoughts=2, breadth=2, distinct=distinct)
        sol = run_sync(BFS.over(task, settings, GEN, 0).solve(PROBLEM, engine))
        assert len(engine.calls[2]) == 2 * expanded
        assert len(sol.tree.graph) == 1 + 2 + 2 * expanded  # the copy stays in the tree
    engine = ScriptedEngine(SCORES)
    run_sync(BFS.over(task, BFSSettings(n_thoughts=2, breadth=2, root_thoughts=4), GEN, 0).solve(PROBLEM, engine))
    assert [len(c) for c in engine.calls[0::2]] == [4, 2 * 2]
    with pytest.raises(ConfigError, match=r"search\.root_thoughts=-1"):
        BFSSettings(root_thoughts=-1)


def test_thought_requests():
    _, engine = solve()
    thought_calls = engine.calls[0::2]
    for depth, call in enumerate(thought_calls, 1):
        prefix = FINAL_PREFIX if depth == 3 else f"Sub-question {depth}:"
        assert all(r.prefix == prefix for r in call)
        assert all(r.max_new_tokens == 40 and r.temperature == 0.6 for r in call)
        assert all(r.top_p == 0.9 and r.top_k == 5 for r in call)
        # The n samples of one state: one prompt, one group, distinct seeds.
        for start in range(0, len(call), 3):
            same = call[start : start + 3]
            assert len({r.prompt for r in same}) == 1
            assert len({r.group for r in same}) == 1
            assert len({r.seed for r in same}) == 3
        assert len({r.group for r in call}) == len(call) // 3
        assert len({r.prompt for r in call}) == len(call) // 3
    assert [r.group for r in thought_calls[0]] == [Group("p", "0")] * 3
    # Only the kept states are expanded, best first: depth 2 expands t1 then t2, depth 3 expands t4 then t6.
    assert [r.group for r in thought_calls[1]] == [Group("p", str(node(1)))] * 3 + [Group("p", str(node(2)))] * 3
    assert [r.group for r in thought_calls[2]] == [Group("p", str(node(4)))] * 3 + [Group("p", str(node(6)))] * 3
    # A state's prompt holds its path and nothing of the pruned thoughts.
    assert "#1" in thought_calls[1][0].prompt and "#0" not in thought_calls[1][0].prompt
    assert "#2" in thought_calls[2][3].prompt and "#6" in thought_calls[2][3].prompt
    assert "#1" not in thought_calls[2][3].prompt and "#4" not in thought_calls[2][3].prompt
    seeds = [r.seed for c in engine.calls for r in c]
    assert len(set(seeds)) == len(seeds)


def test_eval_requests():
    _, engine = solve()
    for call in engine.calls[1::2]:
        assert all(r.max_new_tokens == 20 and r.temperature == 0.3 for r in call)
        # Evaluation is "many different prompts", one per child.
        assert len({r.prompt for r in call}) == len(call)
    # Each child is evaluated in the order it was generated.
    labels = [int(re.findall(r"\d+", _LAST_STEP.search(r.prompt).group(1))[-1]) for c in engine.calls[1::2] for r in c]
    assert labels == list(range(15))


def test_keeps_best_b_and_answer_path():
    sol, _ = solve()
    tree = sol.tree
    chosen = sorted(n for n in tree.graph if tree[n].chosen and n != tree.root)
    assert chosen == sorted(node(k) for k in (1, 2, 4, 6, 12, 14))
    assert {n: tree[n].value for n in tree.graph if n} == {node(k): v for k, v in SCORES.items()}
    # Only chosen states have children.
    parents = {n for n in tree.graph if tree.graph.out_degree(n)}
    assert parents == {tree.root, node(1), node(2), node(4), node(6)}
    assert sol.answer == "12"
    answer_path = sorted(n for n in tree.graph if tree[n].answer)
    assert answer_path == [tree.root, node(2), node(6), node(12)]
    assert tree.steps(node(12)) == ["Sub-question 1: #2", "Sub-question 2: #6", "The answer is 12."]
    assert tree[node(12)].raw == " 12."
    assert tree[node(12)].tokens == 3
    assert tree[node(12)].evaluation == " 10, because the step looks right."


def test_tree_shape():
    sol, _ = solve()
    tree = sol.tree
    assert tree.graph.number_of_nodes() == 1 + 3 + 6 + 6
    assert tree.graph.number_of_edges() == 3 + 6 + 6
    assert Counter(tree[n].depth for n in tree.graph) == {0: 1, 1: 3, 2: 6, 3: 6}
    for depth in (1, 2, 3):
        assert sum(1 for n in tree.graph if tree[n].depth == depth and tree[n].chosen) == 2


def test_breadth_one_default_depth():
    # SEED's GSM8K setup: depth 4, n=3, b=1 -> 1 + 4*3 nodes, one chosen per depth.
    scores = {k: 1 + (k * 7) % 10 for k in range(12)}
    sol, engine = solve(scores=scores, depth=4, n=3, b=1)
    tree = sol.tree
    assert tree.graph.number_of_nodes() == 1 + 4 * 3
    assert [len(c) for c in engine.calls] == [3] * 8
    best = []
    for d in range(4):
        ks = range(3 * d, 3 * d + 3)
        best.append(max(ks, key=lambda k: (scores[k], -k)))
    assert sorted(n for n in tree.graph if tree[n].chosen and n) == [node(k) for k in best]
    assert sol.answer == str(best[-1])


def test_ties_broken_by_generation_order():
    sol, _ = solve(scores=dict.fromkeys(range(15), 5), b=2)
    tree = sol.tree
    # With every value equal, the first b generated children are kept at each depth.
    assert sorted(n for n in tree.graph if tree[n].chosen and n) == [node(k) for k in (0, 1, 3, 4, 9, 10)]
    assert sol.answer == "9"


def test_unparseable_values_count_as_zero():
    # An evaluator reply with no usable number values the state 0, below any real score.
    scores = dict.fromkeys(range(15), " I cannot tell, the step is unclear.")
    scores[2] = 1
    scores[3] = " 11!"
    sol, _ = solve(scores=scores, b=1)
    tree = sol.tree
    assert tree[node(0)].value == tree[node(1)].value == tree[node(3)].value == 0.0
    assert tree[node(2)].value == 1.0
    assert tree[node(2)].chosen and not tree[node(0)].chosen
    assert sorted(tree.graph.successors(node(2))) == [node(3), node(4), node(5)]


def test_phase_stats():
    sol, _ = solve()
    gen, ev = sol.phases["generate"], sol.phases["evaluate"]
    assert gen.calls == ev.calls == 3 + 6 + 6  # one call per thought, one per evaluation
    assert gen.decode.generated_tokens == (3 + 6 + 6) * 3
    assert ev.decode.generated_tokens == (3 + 6 + 6) * 2
    assert gen.decode.target_forwards == (3 + 6 + 6) * 2  # the fake's: len(requests) + 1 per call
    assert gen.engine_s >= 0 and ev.engine_s >= 0
    d = gen.to_dict()
    assert d["tokens"] == 45 and d["calls"] == 15
    assert d["decode_generated_tokens"] == 45 and d["decode_acceptance_length"] == 1.0


def test_same_seed_same_requests():
    _, a = solve(seed=3)
    _, b = solve(seed=3)
    _, c = solve(seed=4)
    seeds = [[r.seed for r in call] for call in a.calls]
    assert seeds == [[r.seed for r in call] for call in b.calls]
    assert seeds != [[r.seed for r in call] for call in c.calls]
    # The seeds depend on the problem, so two problems do not sample alike.
    _, other = solve(seed=3, problem=Problem(id="q", question=PROBLEM.question, gold="12"))
    assert not set(seeds[0]) & {r.seed for r in other.calls[0]}


def test_request_seed():
    assert request_seed(0, "p", 1, 2) == request_seed(0, "p", 1, 2)
    many = {
        request_seed(s, pid, state, i) for s in (0, 1) for pid in ("p", "q") for state in range(5) for i in range(4)
    }
    assert len(many) == 2 * 2 * 5 * 4
    assert request_seed(0, "p", 1, "eval") != request_seed(0, "p", 1, 0)
    assert all(0 <= s < 2**32 for s in many)


def test_tree_round_trip(tmp_path):
    sol, _ = solve()
    tree = sol.tree
    data = json.loads(json.dumps(tree.to_dict()))
    back = ReasoningTree.from_dict(data)
    assert back.thoughts == tree.thoughts
    assert sorted(back.graph.edges) == sorted(tree.graph.edges)
    assert back.steps(node(12)) == tree.steps(node(12))
    assert back[0].text == PROBLEM.question

    path = tmp_path / "trees" / "p.json"
    save_tree(tree, path)
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    saved = ReasoningTree.from_dict(json.loads(path.read_text()))
    assert saved.thoughts == tree.thoughts
    assert sorted(saved.graph.edges) == sorted(tree.graph.edges)
    # A new node added after loading gets a fresh id.
    child = saved.add(node(12), "extra")
    assert child == 16 and saved[child].depth == 4


def test_saved_nodes_keep_their_form_and_fields_of_other_versions(tmp_path):
    """A node saves the fields it has (an unset one is left out, the value always written), and a
    field this version does not know survives a load and a save; a node without its depth is refused
    in one line naming the file."""
    tree = ReasoningTree("q?")
    a = tree.add(tree.root, "a", value=3.0, raw="a.", tokens=2)
    nodes = {n["id"]: n for n in tree.to_dict()["nodes"]}
    assert nodes[0] == {"id": 0, "text": "q?", "depth": 0, "value": None, "chosen": True, "answer": True}
    assert nodes[a] == {
        "id": a,
        "text": "a",
        "depth": 1,
        "value": 3.0,
        "chosen": False,
        "answer": False,
        "raw": "a.",
        "tokens": 2,
    }
    data = tree.to_dict()
    data["nodes"][a]["colour"] = "red"
    back = ReasoningTree.from_dict(json.loads(json.dumps(data)))
    assert back[a].extra == {"colour": "red"} and back.to_dict() == data
    del data["nodes"][a]["depth"]
    (tmp_path / "t.json").write_text(json.dumps(data))
    with pytest.raises(ShowError, match=r"t\.json is not a saved tree \(node 1: a node has no depth\)"):
        read_tree(tmp_path / "t.json")


def test_tree_basics():
    tree = ReasoningTree("q?")
    a = tree.add(tree.root, "a", value=3.0)
    b = tree.add(a, "b")
    c = tree.add(tree.root, "c")
    assert (a, b, c) == (1, 2, 3)
    assert tree.steps(b) == ["a", "b"]
    assert tree.steps(tree.root) == []
    assert tree[a].value == 3.0 and tree[b].value is None
    tree.mark_answer(b)
    assert [n for n in tree.graph if tree[n].answer] == [0, a, b]


@pytest.mark.parametrize("n, b", [(1, 1), (2, 2), (4, 3)])
def test_sizes(n, b):
    scores = {k: 1 + k % 10 for k in range(200)}
    sol, engine = solve(scores=scores, depth=3, n=n, b=b)
    assert [len(c) for c in engine.calls] == [n, n, b * n, b * n, b * n, b * n]
    assert sol.tree.graph.number_of_nodes() == 1 + n + 2 * b * n


def test_breadth_above_n_thoughts_keeps_the_b_best_of_all_the_frontiers_thoughts():
    # n=2, b=3 (ToT's BFS: the b best of every kept state's thoughts, whoever their parent).
    #   depth 1: t0, t1 (5, 8): fewer than b, both kept
    #   depth 2: t2, t3 from t1, t4, t5 from t0; values 9, 9, 4, 1 -> keep t2, t3 (both t1's), t4
    scores = {0: 5, 1: 8, 2: 9, 3: 9, 4: 4, 5: 1}
    sol, engine = solve(scores=scores, depth=2, n=2, b=3)
    tree = sol.tree
    assert [len(c) for c in engine.calls] == [2, 2, 4, 4]
    chosen = sorted(n for n in tree.graph if tree[n].chosen and n != tree.root)
    assert chosen == sorted(node(k) for k in (0, 1, 2, 3, 4))
    assert sorted(tree.graph.successors(node(1))) == [node(2), node(3)]
    assert sol.answer == "2"
