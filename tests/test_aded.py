"""ADED: the tri-gram matrix, the MCTS draft maker (PUCT, E, the tree), and decoder=aded on the tiny model."""

from __future__ import annotations

import json
import math
import random

import pytest
from helpers import UNCAPPED
from test_decoders import encode
from test_speculative import PARAMS, check_three_tokens, sample_three
from test_stand import greedy_case

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine
from decoding.base.errors import ConfigError
from decoding.base.values import GenRequest, Group
from decoding.drafters.aded import AdedDrafter, AdedOptions, Node, Search, TriGram, exploration, most_visited, puct
from decoding.speculation.draft_tree import ROOT
from decoding.speculation.gumbel import Coupling, gumbel_order

# --- the tri-gram matrix -------------------------------------------------------------------------------


def test_trigram_probabilities_by_hand():
    m = TriGram(top=4)
    m.update([5, 1, 7])
    m.update([6, 1, 8])
    m.update([6, 1, 8])
    m.update([1, 2, 3, 1, 2, 4, 1, 2, 3])  # (1,2,3) twice, (1,2,4) once, and (2,3,1), (3,1,2), ...
    # Eq. 1: P(c | a, b) = C(a, b, c) / C(a, b).
    assert m.prob(1, 2, 3) == pytest.approx(2 / 3)
    assert m.prob(1, 2, 4) == pytest.approx(1 / 3)
    assert m.candidates(1, 2) == ([3, 4], pytest.approx([2 / 3, 1 / 3]))
    assert m.candidates(5, 1) == ([7], [1.0])  # the pair (5, 1) was seen: its tri-grams only
    # An unseen pair backs off to the bigram after its last token: after 1 came 7 once, 8 twice, 2 twice.
    assert m.candidates(9, 1) == ([2, 8, 7], pytest.approx([0.4, 0.4, 0.2]))  # tie 2 / 8: the lower id first
    assert m.prob(9, 1, 7) == pytest.approx(0.2)
    assert m.candidates(9, 9) == ([], [])  # no unigram level: nothing after an unseen token
    assert TriGram(top=1).candidates(0, 0) == ([], [])


def test_trigram_update_weight_cache_and_base():
    m = TriGram(top=2)
    m.update([5, 1, 7])
    assert m.candidates(5, 1) == ([7], [1.0])
    m.update([5, 1, 9], weight=3.0)  # the cached candidates of (5, 1) are dropped by the update
    assert m.candidates(5, 1) == ([9, 7], pytest.approx([0.75, 0.25]))
    m.update([5, 1, 4])
    assert m.candidates(5, 1) == ([9, 4], pytest.approx([0.6, 0.2]))  # top 2 of {9: 3, 7: 1, 4: 1}
    corpus = TriGram(top=2)
    corpus.update([5, 1, 7, 7])
    layered = TriGram(top=2, base=corpus)
    layered.update([5, 1, 9])
    assert layered.candidates(5, 1) == ([7, 9], pytest.approx([0.5, 0.5]))  # the corpus' counts add
    assert layered.candidates(1, 7) == ([7], [1.0])  # a pair only the corpus saw
    assert corpus.candidates(5, 1) == ([7], [1.0])  # the base itself is not changed


def test_trigram_capacity_evicts_the_least_recently_updated():
    m = TriGram(capacity=2)
    m.update([1, 2, 3])
    m.update([4, 5, 6])
    m.update([1, 2, 3])  # (1, 2) updated again: now the most recent
    m.update([7, 8, 9])
    assert set(m.tri) == {(1, 2), (7, 8)}


# --- PUCT and the search -------------------------------------------------------------------------------


def test_exploration_and_puct_by_hand():
    assert exploration(0, 1.0, 8.0) == pytest.approx(1 + math.log(9 / 8))
    assert exploration(4, 2.414, 8.0) == pytest.approx(2.414 + math.log(13 / 8))
    assert puct(0.5, 0.3, 4, 1, 2.0) == pytest.approx(0.5 + 2.0 * 0.3 * 2 / 2)


def _root_with(children: list[tuple[int, float, int, float]]) -> Node:
    root = Node(0, (0, 0), None, 1.0)
    for token, prior, visits, value in children:
        child = Node(token, (0, token), root, prior)
        child.visits, child.value = visits, value
        root.children.append(child)
    root.expanded = True
    return root


def test_puct_selection_by_hand():
    """N = 4 visits below the root; E = c1 + log(13/8) = c1 + 0.4855, sqrt(N) = 2.

    c1 = 1 (E = 1.4855): A 0.3 + E*0.6*2/4 = 0.746, B 0 + E*0.3*2/1 = 0.891, C 0.8 + E*0.1*2/2 = 0.949: C.
    c1 = 3 (E = 3.4855): A 1.346, B 2.091, C 1.149: the unvisited B.
    """
    children = [(1, 0.6, 3, 0.9), (2, 0.3, 0, 0.0), (3, 0.1, 1, 0.8)]  # A, B, C: Q = 0.3, 0, 0.8
    for c1, expected in ((1.0, 3), (3.0, 2)):
        search = Search(TriGram(), 0, 0, AdedOptions(c1=c1, c2=8.0), 4)
        assert search.select(_root_with(children)).token == expected


def hand_matrix() -> TriGram:
    """After (0, 1): 2 (p 0.75) then 4 (p 1); or 3 (p 0.25) then 5 (p 1); nothing after 4 or 5."""
    m = TriGram(top=4)
    for _ in range(3):
        m.update([0, 1, 2, 4])
    m.update([0, 1, 3, 5])
    return m


def test_search_by_hand():
    """Values: the expected accepted tokens of a path and its greedy rollout, were the matrix the target.

    Iteration 1 expands the root and evaluates node 2: 0.75 + 0.75 * 1 = 1.5 (its rollout 2 -> 4).
    Iteration 2 takes 2 (Q 1.5) and expands it into 4: value 1.5 again; 4 has no children, so from
    then on every visit to 2 goes to 4 and Q(2) stays 1.5. Node 3 (Q 0) wins once
    E * 0.25 * sqrt(N) > 1.5 + E * 0.75 * sqrt(N) / (1 + N), E = 2.414 + log((N + 9) / 8):
    at N = 8, 2.240 < 2.247; at N = 9, 2.419 > 2.226. So 9 iterations never visit 3; the 10th does.
    """
    options = AdedOptions(iterations=9, c1=2.414, c2=8.0, max_nodes=8)
    tree = Search(hand_matrix(), 0, 1, options, 3).run()
    assert (tree.tokens, tree.parents, tree.probs) == ([2, 4], [ROOT, 0], [0.75, 1.0])
    search = Search(hand_matrix(), 0, 1, AdedOptions(iterations=10, c1=2.414, c2=8.0), 3)
    tree = search.run()
    assert (tree.tokens, tree.parents) == ([2, 3, 4, 5], [ROOT, ROOT, 0, 1])  # breadth first, most visited first
    assert [c.visits for c in search.root.children] == [9, 1]
    grandchildren = [c.children[0] for c in search.root.children]
    assert [(n.token, n.visits) for n in grandchildren] == [(4, 8), (5, 1)]
    assert most_visited(search.root, 3).tokens == [2, 3, 4]  # by visits: 2 (9), 4 (8), then 3 before 5 (shallower)
    # Depth 1: Q(2) = 0.75 only, so 3 is visited sooner (at N = 5: 1.662 > 1.581).
    assert Search(hand_matrix(), 0, 1, options, 1).run().tokens == [2, 3]
    assert len(Search(hand_matrix(), 7, 7, options, 3).run()) == 0  # the matrix knows nothing after 7


def test_coupled_siblings_follow_the_targets_noise():
    """Under match_gumbel the same nodes are kept, siblings ordered by log P + the target's noise at
    their position: the matrix's guess of the target's own sample first."""
    options = AdedOptions(iterations=10, c1=2.414, c2=8.0)
    firsts = set()
    for seed in range(20):
        tree = Search(hand_matrix(), 0, 1, options, 3).run(Coupling(seed, 40))
        expect = gumbel_order([2, 3], [math.log(0.75), math.log(0.25)], seed, 40)
        assert tree.tokens[:2] == expect and sorted(tree.tokens) == [2, 3, 4, 5]
        assert tree.parents[tree.tokens.index(4)] == tree.tokens.index(2)  # each child under its own parent
        firsts.add(expect[0])
    assert firsts == {2, 3}  # the noise does reorder them


@pytest.mark.parametrize("max_nodes, max_depth, top_k", [(1, 1, 1), (4, 2, 3), (8, 4, 4), (16, 3, 8), (12, 6, 2)])
def test_tree_respects_the_budget(max_nodes, max_depth, top_k):
    rng = random.Random(max_nodes * 31 + max_depth)
    m = TriGram(top=top_k)
    m.update([rng.randrange(6) for _ in range(400)])  # 6 tokens: every context has several successors
    options = AdedOptions(iterations=40, max_nodes=max_nodes, max_depth=max_depth, top_k=top_k)
    search = Search(m, 0, 1, options, max_depth)
    tree = search.run()
    visited, stack = 0, list(search.root.children)
    while stack:
        node = stack.pop()
        visited += node.visits > 0
        stack += node.children
    assert 1 <= len(tree) == min(max_nodes, visited)
    assert max(tree.depths()) <= max_depth
    assert all(p == ROOT or 0 <= p < i for i, p in enumerate(tree.parents))  # parents first
    for node in (ROOT, *range(len(tree))):
        kids = [tree.tokens[c] for c in tree.children(node)]
        assert len(kids) == len(set(kids)) <= top_k  # distinct candidates, at most top_k
    assert all(0 < p <= 1 for p in tree.probs)
    assert tree.draw == "top"


# --- options -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, pattern",
    [
        ({"iterations": 0}, r"aded\.iterations=0 must be a positive integer"),
        ({"max_nodes": 2.5}, r"aded\.max_nodes=2\.5 is not an integer"),
        ({"c2": 0}, r"aded\.c1=2\.414 and aded\.c2=0\.0"),
        ({"c1": "big"}, r"aded\.c1='big' is not a number"),
        ({"scope": "galaxy"}, r"aded\.scope='galaxy' is not one of group, problem, run"),
        ({"update_weight": -1}, r"aded\.update_weight=-1\.0 must be positive"),
        ({"prime_with_prompt": "yes"}, r"aded\.prime_with_prompt='yes' must be true or false"),
        ({"corpus": "/no/such/file.txt"}, r"aded\.corpus=/no/such/file\.txt is not a file"),
        ({"depth": 3}, r"aded\.depth is not an option of aded"),
    ],
)
def test_config_errors_name_the_key(values, pattern):
    container = {"decoder": {"name": "aded"}, "aded": {**AdedOptions().__dict__, **values}}
    with pytest.raises(ConfigError, match=pattern):
        DecoderConfig.from_container(container)


def test_config_reads_the_namespace():
    cfg = DecoderConfig.from_container({"decoder": {"name": "aded"}, "aded": {"iterations": 7, "c1": 32, "corpus": ""}})
    assert (cfg.section("aded").iterations, cfg.section("aded").c1, cfg.section("aded").corpus) == (7, 32.0, None)
    assert (
        DecoderConfig.from_container({"decoder": {"name": "ar"}, "aded": {"iterations": 0}}).section("aded")
        == AdedOptions()
    )


# --- decoder=aded on the tiny model ----------------------------------------------------------------------

TEST_OPTIONS = {"iterations": 16, "max_nodes": 8, "max_depth": 4, "top_k": 3}


def engine_for(loaded, **options) -> Engine:
    return Engine(
        loaded, DecoderConfig("aded", options={"aded": AdedOptions(**{**TEST_OPTIONS, **options})}, verify=UNCAPPED)
    )


@pytest.mark.parametrize("scope", ["group", "problem", "run"])
def test_greedy_identity(tiny_model, tokenizer, loaded, scope):
    requests, refs = greedy_case(tiny_model, tokenizer)
    engine = engine_for(loaded, scope=scope)
    for _ in range(2):  # the second call drafts from what the first one taught the matrices
        results = engine.generate(requests)
        assert [r.token_ids for r in results] == refs
        assert results[-1].finish_reason == "stop"
    stats = engine.last_stats
    assert stats.drafted_tokens > 0
    assert stats.accepted_tokens > 0 and stats.acceptance_length > 1.0


def test_matrix_learns_across_calls(loaded):
    engine = engine_for(loaded, scope="run", prime_with_prompt=False)
    requests = [GenRequest("once upon a time", max_new_tokens=40, group=Group("g"))]
    first = engine.generate(requests)[0]
    assert engine.last_stats.acceptance_length < 2.0
    engine.generate(requests)
    assert engine.last_stats.acceptance_length > 3.0  # the second run copies the first
    assert engine.generate(requests)[0].token_ids == first.token_ids


def test_corpus_initialises_the_matrix(tmp_path, tiny_model, tokenizer, loaded):
    """A corpus holding the greedy continuation itself: drafts are accepted from the first call."""
    prompt = encode(tokenizer, "hello world and more")
    ref = Engine(loaded, "ar").generate([GenRequest(tuple(prompt), max_new_tokens=24)])[0].token_ids
    text = tokenizer.decode(prompt + ref)
    (tmp_path / "corpus.txt").write_text(f"something else\n\n{text}\n")
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"id": 1, "text": text}) + "\n")
    for name in ("corpus.txt", "corpus.jsonl"):
        engine = engine_for(loaded, corpus=str(tmp_path / name), prime_with_prompt=False)
        assert engine.generate([GenRequest(tuple(prompt), max_new_tokens=24)])[0].token_ids == ref
        assert engine.last_stats.acceptance_length > 3.0
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"aded\.corpus=.*bad\.jsonl: line 2 is not JSON"):
        AdedDrafter(AdedOptions(corpus=str(tmp_path / "bad.jsonl")), tokenizer)


def test_drafts_fit_the_room_left(loaded):
    """No draft reaches past a sequence's token limit (the tree's depth is cut to the room left)."""
    engine = engine_for(loaded, scope="run", max_depth=6)
    requests = [GenRequest("the cat", max_new_tokens=30, group=Group("g"))]
    engine.generate(requests)  # teach the matrix the continuation
    drafter = engine.decoder.drafter
    seen: list[int] = []
    original = drafter._draft

    def record(seq):
        tree = original(seq)
        seen.append(seq.rule.max_new_tokens - len(seq.generated) - 1 - (max(tree.depths()) if len(tree) else 0))
        return tree

    drafter._draft = record
    engine.generate([GenRequest("the cat", max_new_tokens=5, group=Group("g"))])
    assert seen and min(seen) >= 0


@pytest.mark.parametrize("params_name", list(PARAMS))
def test_sampling_follows_the_target(tiny_model, tokenizer, loaded, params_name):
    """8,000 seeded 3-token runs sharing one matrix; tolerance as in test_speculative (`tvd_tolerance`)."""
    params = PARAMS[params_name]
    prompt = encode(tokenizer, "once upon a time")
    engine = engine_for(loaded, iterations=8, max_nodes=4, max_depth=2)
    samples = sample_three(engine, prompt, params, 8000)
    stats = engine.total_stats
    # Drafts are both accepted and rejected, so both paths of the point-mass rule are exercised.
    assert 0.05 * stats.verify_steps < stats.accepted_tokens < stats.drafted_tokens
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))
