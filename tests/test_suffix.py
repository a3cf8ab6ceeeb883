"""The suffix drafter: its trie, its best-first trees, coupled sibling order, and the `suffix` decoder
and `stand.suffix` (the suffix tree merged with STAND's) returning the target's tokens."""

from __future__ import annotations

import math

import pytest
from test_decoders import encode
from test_speculative import PARAMS, check_three_tokens, sample_three
from test_stand import engine_for, greedy_case

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine
from decoding.base.errors import ConfigError
from decoding.base.values import GenRequest, Group
from decoding.drafters.suffix import SuffixOptions, SuffixTrie, grow
from decoding.speculation.draft_tree import ROOT
from decoding.speculation.gumbel import Coupling, gumbel_order
from decoding.speculation.options import Rule, VerifyOptions

# --- the trie ----------------------------------------------------------------------------------------


def test_trie_counts_every_substring_up_to_its_depth():
    trie = SuffixTrie(depth=3, capacity=1000)
    trie.prime([1, 2, 3, 1, 2, 4])
    assert trie.find([1, 2]).count == 2
    assert trie.find([2, 3, 1]).count == 1
    assert trie.find([1, 2, 3, 1]) is None  # longer than the depth
    assert sorted(trie.find([1, 2]).kids) == [3, 4]
    # The longest suffix with a continuation: (1, 2) continues twice; the whole (3, 1, 2) too, once.
    node, n = trie.match([9, 3, 1, 2], longest=5)
    assert n == 2 and sorted(node.kids) == [3, 4]  # depth 3 leaves suffixes of 2 room for a continuation
    assert trie.match([7, 8], longest=5) is None
    # A text's own end has no continuation: only earlier occurrences make a match.
    assert trie.match([1, 2, 3, 1, 2, 4], longest=2) is None
    own = SuffixTrie(depth=3, capacity=1000)
    own.prime([1, 2, 3, 1, 2])
    node, n = own.match([1, 2, 3, 1, 2], longest=5)
    assert n == 2 and list(node.kids) == [3]


def test_trie_resumes_a_primed_text_and_stays_within_capacity():
    trie = SuffixTrie(depth=4, capacity=1000)
    text = [5, 6, 7]
    trie.prime(text)
    open_ = trie.resume(text)
    for t in [5, 6]:
        open_ = trie.step(open_, t)
    # The continuation spans the primed text's end: (6, 7, 5, 6) is in the trie.
    assert trie.find([6, 7, 5, 6]).count == 1 and trie.find([5, 6]).count == 2
    small = SuffixTrie(depth=4, capacity=5)
    small.prime(list(range(20)))
    assert small.size == 5


def test_options_are_checked_at_load_time():
    with pytest.raises(ConfigError, match=r"suffix\.max_match"):
        SuffixOptions(max_match=0)
    with pytest.raises(ConfigError, match=r"suffix\.min_prob"):
        SuffixOptions(min_prob=1.0)
    with pytest.raises(ConfigError, match=r"suffix\.scope"):
        SuffixOptions(scope="everything")


# --- the draft tree ----------------------------------------------------------------------------------


def _trie_of(*texts: list[int]) -> SuffixTrie:
    trie = SuffixTrie(depth=8, capacity=10_000)
    for text in texts:
        trie.prime(text)
    return trie


def test_tree_grows_best_first_with_siblings_in_count_order():
    # After 1: 2 three times (then 3), 5 once.
    trie = _trie_of([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5])
    tree = grow(trie.find([1]), budget=10, max_depth=4, min_prob=0.2, coupling=None)
    assert tree.tokens == [2, 3, 5, 4]
    assert tree.parents == [ROOT, 0, ROOT, 0]
    assert tree.probs == pytest.approx([0.75, 2 / 3, 0.25, 1 / 3])
    # Siblings in draw order: 4 comes after 3, 5 after 2.
    assert grow(trie.find([1]), budget=2, max_depth=4, min_prob=0.0, coupling=None).tokens == [2, 3]
    # Path probabilities under min_prob are not drafted; depth caps the tree.
    assert grow(trie.find([1]), budget=10, max_depth=4, min_prob=0.3, coupling=None).tokens == [2, 3]
    assert grow(trie.find([1]), budget=10, max_depth=1, min_prob=0.0, coupling=None).tokens == [2, 5]


def test_coupled_siblings_follow_the_targets_noise():
    trie = _trie_of(*([1, t] for t in (10, 11, 11, 12, 12, 12)))
    counts = {10: 1, 11: 2, 12: 3}
    for seed in range(20):
        coupling = Coupling(seed, 40)
        tree = grow(trie.find([1]), budget=3, max_depth=1, min_prob=0.0, coupling=coupling)
        ids = sorted(counts)
        expect = gumbel_order(ids, [math.log(counts[t] / 6) for t in ids], seed, 40)
        assert tree.tokens == expect


# --- decoders ----------------------------------------------------------------------------------------


def suffix_engine(loaded, rule: Rule = "match_gumbel", **options) -> Engine:
    """The suffix decoder, every tree verified whole."""
    verify = VerifyOptions(plan="fixed", max_tokens=None, rule=rule)
    return Engine(loaded, DecoderConfig("suffix", options={"suffix": SuffixOptions(**options)}, verify=verify))


@pytest.mark.parametrize("name", ["suffix", "stand+suffix"])
def test_greedy_identity(tiny_model, tokenizer, loaded, small_tree, name):
    requests, refs = greedy_case(tiny_model, tokenizer)
    whole = VerifyOptions(plan="fixed", max_tokens=None)  # matched: the two trees merged as one trie
    engine = (
        suffix_engine(loaded) if name == "suffix" else engine_for(loaded, "stand", small_tree, 8, whole, suffix=True)
    )
    for _ in range(2):  # the second call drafts from the tries the first one filled
        assert [r.token_ids for r in engine.generate(requests)] == refs
    stats = engine.last_stats
    # The trajectories sharing a prompt repeat each other: the suffix drafter's nodes are accepted.
    assert stats.suffix_accepted_tokens > 0 and stats.accepted_tokens >= stats.suffix_accepted_tokens


def test_a_trajectory_copies_what_its_group_wrote(loaded):
    engine = suffix_engine(loaded, scope="run", min_prob=0.0)
    requests = [GenRequest("once upon a time", max_new_tokens=40, group=Group("g"))]
    first = engine.generate(requests)[0]
    assert engine.generate(requests)[0].token_ids == first.token_ids
    second = engine.last_stats
    assert second.acceptance_length > 3.0  # the second run copies the first


@pytest.mark.parametrize(
    "name, params_name, rule",
    [
        ("suffix", "t1.0", "rejection"),
        ("suffix", "t0.7-k20-p0.9", "match_gumbel"),
        ("stand+suffix", "t0.7-k20-p0.9", "match_gumbel"),
    ],
)
def test_sampling_follows_the_target(tiny_model, tokenizer, loaded, small_tree, name, params_name, rule):
    """8,000 seeded 3-token runs sharing one trie; tolerance as in test_speculative. (Under the
    rejection rules STAND's siblings come first and hold the suffix drafter's tokens, which then
    have no residual left: its share there is measured, not asserted.)"""
    params = PARAMS[params_name]
    prompt = encode(tokenizer, "once upon a time")
    whole = VerifyOptions(plan="fixed", max_tokens=None, rule=rule)
    if name == "suffix":
        engine = suffix_engine(loaded, rule)
    else:
        engine = engine_for(loaded, "stand", small_tree, 64, whole, suffix=True)
    samples = sample_three(engine, prompt, params, 8000)
    assert engine.total_stats.suffix_accepted_tokens > 0
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))
