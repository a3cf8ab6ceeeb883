"""STAND: the logit N-gram pool, Gumbel-top-k, trees, and the stand / seed_stand / pld / recycling decoders."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch
from helpers import UNCAPPED
from test_decoders import BUDGETS, EOS_ID, PROMPTS, _stop_string_case, encode, reference_greedy
from test_speculative import PARAMS, check_three_tokens, sample_three

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine
from decoding.base.errors import ConfigError
from decoding.base.values import GenRequest, Group
from decoding.drafters.aded import TriGram
from decoding.drafters.ngram import LogitNGram
from decoding.drafters.pld import lookup
from decoding.drafters.pools import Pools
from decoding.drafters.stand import GumbelNoise, StandOptions, gumbel_top_k
from decoding.drafters.suffix import SuffixTrie
from decoding.schedules.rounds import RoundsOptions
from decoding.speculation.draft_tree import ROOT, k_config_parents
from decoding.speculation.options import VerifyOptions
from decoding.trees.static import StaticTree, initial_tree, prune

# --- the pool ----------------------------------------------------------------------------------------


def test_running_average_merge_by_hand():
    pool = LogitNGram(max_n=2, top=3)
    pool.add([5, 6], [1, 2], [0.6, 0.4])
    pool.add([9, 6], [2, 3], [0.5, 0.5])  # a new bigram, the same unigram context (6)
    pool.add([5, 6], [1, 4, 7, 8], [0.1, 0.4, 0.3, 0.2])
    uni = pool.tables[0][(6,)]
    # Unigram 6 saw three distributions, each kept as its top 3: {1: .6, 2: .4}, {2: .5, 3: .5} and
    # {4: .4, 7: .3, 8: .2} (the .1 on token 1 is cut). Merged one at a time: after two,
    # {1: .3, 2: .45, 3: .25}; after three, 2/3 of that plus 1/3 of the new one:
    # {2: .3, 1: .2, 3: .1667, 4: .1333, 7: .1, 8: .0667}, cut to the top 3.
    assert uni.count == 3
    assert list(uni.ids) == [2, 1, 3]
    assert list(uni.probs) == pytest.approx([0.3, 0.2, 0.5 / 3], abs=1e-6)
    bi = pool.tables[1][(5, 6)]
    assert bi.count == 2
    # {1: .6, 2: .4} and {4: .4, 7: .3, 8: .2} averaged: 1: .3, 2: .2, 4: .2, 7: .15, 8: .1 -> top 3.
    assert dict(zip(bi.ids, bi.probs)) == pytest.approx({1: 0.3, 2: 0.2, 4: 0.2}, abs=1e-6)


def test_lookup_takes_the_longest_match():
    pool = LogitNGram()
    pool.add([1, 2, 3, 4], [10], [1.0])
    pool.add([7, 3, 4], [20], [1.0])
    assert list(pool.lookup([1, 2, 3, 4]).ids) == [10]  # the 4-gram
    assert list(pool.lookup([9, 7, 3, 4]).ids) == [20]  # the 3-gram (7, 3, 4)
    assert list(pool.lookup([8, 8, 3, 4]).ids) == [10, 20]  # the bigram (3, 4): both, averaged
    assert pool.lookup([8, 8, 8, 5]) is None


def test_learning_read_late_equals_learning_merged_at_once():
    """Additions wait (a queue, then under each context's entry) until a lookup reads them: a pool
    read now and then ends with the very tables (entries, counts, LRU order) of one whose every
    addition was merged at once, and its lookups along the way see the same entries."""
    rng = random.Random(0)
    late, eager = LogitNGram(max_n=3, top=4, capacity=60), LogitNGram(max_n=3, top=4, capacity=60)
    for step in range(3000):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        ids = rng.sample(range(12), rng.randrange(1, 7))
        probs = [rng.random() for _ in ids]
        late.add(context, ids, probs)
        eager.add(context, ids, probs)
        _ = eager.tables  # merged at once
        if step % 7 == 0:
            probe = [rng.randrange(6) for _ in range(3)]
            assert late.lookup(probe) == eager.lookup(probe)
    assert [list(t.items()) for t in late.tables] == [list(t.items()) for t in eager.tables]
    assert late.size == eager.size <= 60


def test_capacity_evicts():
    pool = LogitNGram(max_n=2, capacity=10)
    for t in range(50):
        pool.add([t, t + 1], [t], [1.0])
    assert pool.size == sum(len(t) for t in pool.tables) <= 10
    assert pool.lookup([49, 50]) is not None  # the latest survives


def test_prompt_priming():
    pool = LogitNGram()
    pool.prime([3, 4, 5, 3, 4])
    assert list(pool.lookup([3, 4]).ids) == [5]
    assert list(pool.lookup([9, 3]).ids) == [4]


def test_a_prompt_is_counted_past_the_prefix_its_pool_holds():
    """A ToT step's prompts share the question and the steps so far: a pool counts that text once,
    and of each later prompt what follows it (for every kind of pool), the same as priming that
    prompt's own tokens on top of the first."""
    first, second = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 8, 7]
    pools = Pools("group", 8, LogitNGram)
    pools.prime(Group("p", "a"), first)
    pools.prime(Group("p", "a"), second)
    pools.prime(Group("p", "a"), second)  # the same prompt again: nothing
    pool = pools.get(Group("p", "a"))
    assert pool.lookup([1, 2, 3]).count == 1  # the shared text, once
    assert list(pool.lookup([2, 3, 4]).ids) == [5, 9]  # after it, both continuations
    assert list(pool.lookup([9, 8]).ids) == [7]
    want = LogitNGram()
    want.prime(first)
    want.prime(second, start=4)
    assert [dict(t) for t in pool.tables] == [dict(t) for t in want.tables]
    tries = Pools("group", 8, lambda: SuffixTrie(depth=3, capacity=100))
    tries.prime(Group("p", "a"), first)
    tries.prime(Group("p", "a"), second)
    trie = tries.get(Group("p", "a"))
    assert trie.find([2, 3]).count == 1 and trie.find([4, 9]).count == 1 and trie.find([9, 8, 7]) is not None
    grams = Pools("group", 8, TriGram)
    grams.prime(Group("p", "a"), first)
    grams.prime(Group("p", "a"), second)
    whole = TriGram()
    whole.update(first)
    whole.update([3, 4, 9, 8, 7])
    assert grams.get(Group("p", "a")).tri == whole.tri


def test_pools_are_isolated_by_scope():
    groups = [Group("p1", "a"), Group("p1", "b"), Group("p2", "a")]
    for scope, shared in (("group", [False, False]), ("problem", [True, False]), ("run", [True, True])):
        pools = Pools(scope, 256, LogitNGram)
        pools.get(groups[0]).add([1, 2], [3], [1.0])
        for g, expect in zip(groups[1:], shared):
            assert (pools.get(g).lookup([1, 2]) is not None) == expect, (scope, g)
    with pytest.raises(ConfigError, match=r"stand\.scope='galaxy'"):
        StandOptions(scope="galaxy")


def test_gumbel_top_k_inclusion_matches_sampling_without_replacement():
    """Inclusion frequency of each candidate in k=2 draws (40,000 runs; tolerance 0.012, about 5
    standard errors) against the exact probability of sequential sampling without replacement."""
    ids, probs = [0, 1, 2, 3], [0.5, 0.25, 0.15, 0.1]
    exact = [0.0] * 4
    for a, b in itertools.permutations(range(4), 2):
        p = probs[a] * probs[b] / (1 - probs[a])
        exact[a] += p
        exact[b] += p
    noise = GumbelNoise(torch.Generator().manual_seed(0), block=1000)  # refreshed many times
    n = 40_000
    counts = [0] * 4
    first = [0] * 4
    for _ in range(n):
        picks = gumbel_top_k(ids, probs, 2, noise)
        first[picks[0]] += 1
        for x in picks:
            counts[x] += 1
    assert [c / n for c in counts] == pytest.approx(exact, abs=0.012)
    assert [c / n for c in first] == pytest.approx(probs, abs=0.012)  # the first draw follows q


# --- trees -------------------------------------------------------------------------------------------


def test_initial_tree_is_standS_625_nodes():
    tree = initial_tree()
    assert len(tree) + 1 == 625  # the paper counts the root
    assert max(tree.depths()) == 20
    assert len(tree.children()[ROOT]) == 8


def test_prune_keeps_a_connected_tree_deterministically():
    tree = initial_tree()
    g = torch.Generator().manual_seed(3)
    hits = {}
    for i in range(len(tree)):  # hits that shrink with depth, as accepted paths do
        parent = tree.parents[i]
        cap = 1000 if parent == ROOT else hits[parent]
        hits[i] = int(torch.randint(0, cap + 1, (1,), generator=g))
    small = prune(tree, hits, 40, {"note": "test"})
    assert len(small) == 40
    assert all(p == ROOT or 0 <= p < i for i, p in enumerate(small.parents))  # connected, parents first
    assert prune(tree, hits, 40, {"note": "test"}).parents == small.parents
    assert small.meta == {"note": "test"}


def test_tree_files(tmp_path):
    tree = StaticTree(tuple(k_config_parents((2, 1))), {"made_by": "test"})
    tree.save(tmp_path / "t.json")
    assert StaticTree.load(str(tmp_path / "t.json")).parents == tree.parents
    assert len(StaticTree.load("initial")) == 624
    with pytest.raises(ConfigError, match=r"stand\.tree=nope is neither a shipped tree"):
        StaticTree.load("nope")
    (tmp_path / "bad.json").write_text(json.dumps({"parents": [0]}))
    with pytest.raises(ValueError, match="parents first"):
        StaticTree.load(str(tmp_path / "bad.json"))


def test_pld_lookup():
    assert lookup([1, 2, 3, 9, 1, 2], 3, 4) == [3, 9, 1, 2]
    assert lookup([5, 6, 7, 5, 6, 8, 5, 6], 2, 2) == [8, 5]  # the latest occurrence
    assert lookup([1, 2, 3], 3, 4) == []


# --- decoders on the tiny model ----------------------------------------------------------------------


def engine_for(
    loaded, name: str, tree: str, verify_batch: int = 8, verify: VerifyOptions = UNCAPPED, **stand
) -> Engine:
    cfg = DecoderConfig(
        name, rounds=RoundsOptions(verify_batch), options={"stand": StandOptions(tree=tree, **stand)}, verify=verify
    )
    return Engine(loaded, cfg)


def greedy_case(tiny_model, tokenizer):
    specs = [*zip(PROMPTS, BUDGETS), ("the cat", 30), ("the cat", 30), ("the cat", 12)]
    requests = [GenRequest(p, max_new_tokens=m, group=Group(p)) for p, m in specs]
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    prompt, budget, gen, stop = _stop_string_case(tiny_model, tokenizer)
    n = next(i for i in range(1, len(gen) + 1) if stop in tokenizer.decode(gen[:i]))
    requests.append(GenRequest(prompt, max_new_tokens=budget, stop=stop))
    refs.append(gen[:n])
    return requests, refs


@pytest.mark.parametrize(
    "name, verify_batch", [("stand", 8), ("seed_stand", 1), ("seed_stand", 8), ("pld", 8), ("recycling", 8)]
)
def test_greedy_identity(tiny_model, tokenizer, loaded, small_tree, name, verify_batch):
    requests, refs = greedy_case(tiny_model, tokenizer)
    engine = engine_for(loaded, name, small_tree, verify_batch)
    for _ in range(2):  # the second call drafts from pools / tables the first one filled
        results = engine.generate(requests)
        assert [r.token_ids for r in results] == refs
        assert results[-1].finish_reason == "stop"
    stats = engine.last_stats
    assert stats.drafted_tokens > 0
    if name != "pld":  # PLD copies only from a sequence's own context, which this random model rarely repeats
        # The trajectories sharing a prompt repeat each other, so model-free drafts do get accepted.
        assert stats.accepted_tokens > 0 and stats.acceptance_length > 1.0


def test_pools_learn_across_calls(loaded, small_tree):
    engine = engine_for(loaded, "stand", small_tree, scope="run")
    requests = [GenRequest("once upon a time", max_new_tokens=40, group=Group("g"))]
    first = engine.generate(requests)[0]
    engine.generate(requests)
    second = engine.last_stats
    assert second.acceptance_length > 3.0  # the second run copies the first
    assert engine.generate(requests)[0].token_ids == first.token_ids


@pytest.mark.parametrize(
    "name, params_name",
    [
        ("stand", "t1.0"),
        ("stand", "t0.7-k20-p0.9"),
        ("seed_stand", "t1.0"),
        ("seed_stand", "t0.7-k20-p0.9"),
        ("pld", "t1.0"),
        ("recycling", "t0.7-k20-p0.9"),
    ],
)
def test_sampling_follows_the_target(tiny_model, tokenizer, loaded, small_tree, name, params_name):
    """8,000 seeded 3-token runs sharing one pool; tolerance as in test_speculative."""
    params = PARAMS[params_name]
    prompt = encode(tokenizer, "once upon a time")
    engine = engine_for(loaded, name, small_tree, verify_batch=64)
    samples = sample_three(engine, prompt, params, 8000)
    stats = engine.total_stats
    # Drafts do get accepted, so the rule's both paths are exercised.
    assert stats.accepted_tokens > (0.05 * stats.verify_steps if name in ("stand", "seed_stand") else 0)
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))


# --- a forward's token budget (verify.max_tokens) ------------------------------------------------------


@pytest.mark.parametrize("name, verify_batch", [("stand", 8), ("seed_stand", 3)])
def test_greedy_identity_with_trees_cut_to_the_budget(tiny_model, tokenizer, loaded, small_tree, name, verify_batch):
    """12 tokens per forward: 7 rows verify their roots only, rows drafting again as others finish."""
    requests, refs = greedy_case(tiny_model, tokenizer)
    engine = engine_for(loaded, name, small_tree, verify_batch, verify=VerifyOptions(plan="fixed", max_tokens=12))
    for _ in range(2):
        assert [r.token_ids for r in engine.generate(requests)] == refs
    assert engine.last_stats.drafted_tokens > 0


@pytest.mark.parametrize("params_name", list(PARAMS))
def test_sampling_follows_the_target_with_cut_trees(tiny_model, tokenizer, loaded, small_tree, params_name):
    """8,000 seeded runs, two rows per forward with 5 tokens: each 7-node tree is cut to its first
    node (two rows) or first four (one row), mid-way through a run of siblings."""
    params = PARAMS[params_name]
    prompt = encode(tokenizer, "once upon a time")
    engine = engine_for(
        loaded,
        "seed_stand",
        small_tree,
        verify_batch=2,
        verify=VerifyOptions(plan="fixed", max_tokens=5, rule="rejection"),
    )
    samples = sample_three(engine, prompt, params, 8000)
    stats = engine.total_stats
    assert stats.accepted_tokens > 0.05 * stats.verify_steps
    assert stats.drafted_tokens <= 4 * stats.verify_steps
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))


def test_sparse_draft_distributions_are_exact():
    """The (ids, probs) form N-gram drafts carry gives the same acceptance as the dense vector."""
    from helpers import acceptance_chain

    p = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    ids, probs = [3, 1], [0.7, 0.3]
    dense = torch.tensor([0.0, 0.3, 0.0, 0.7], dtype=torch.float64)
    a1, r1 = acceptance_chain(p, [3, 1], (ids, probs), "without_replacement")
    a2, r2 = acceptance_chain(p, [3, 1], dense, "without_replacement")
    assert a1 == pytest.approx(a2) and torch.allclose(r1, r2)
    assert math.isclose(sum(probs), 1.0)


def test_reprune_from_recorded_hits(tmp_path):
    """`tuning.calibrate_tree calibrate.method=prune calibrate.from_counts=...` re-cuts a tree from its
    recorded hits."""
    from tuning.calibrate_tree import reprune

    initial = initial_tree()
    hits = {0: 50, 8: 40, 1: 30, 9: 5, 2: 2}  # node 8 is node 0's first child
    assert initial.parents[8] == 0
    made = prune(initial, hits, 4, {"initial_tree": "initial", "hits": {str(k): v for k, v in hits.items()}})
    made.save(tmp_path / "made.json")
    small = reprune(tmp_path / "made.json", 2)
    assert small.parents == (ROOT, 0)  # nodes 0 and 8, renumbered
    assert small.meta["nodes"] == 2 and small.meta["repruned_from"] == str(tmp_path / "made.json")
    with pytest.raises(ConfigError, match="has no recorded hits"):
        StaticTree(tuple(k_config_parents((2,))), {}).save(tmp_path / "plain.json")
        reprune(tmp_path / "plain.json", 2)


def test_shipped_default_tree():
    tree = StaticTree.load("default")
    assert 1 <= len(tree) <= 80
    assert "made_by" in tree.meta and "how" in tree.meta
