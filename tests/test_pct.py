"""EDD's pruned candidate tree (PCT) as the draft model's tree policy: the pruning rules, and
lossless decoding with it (greedy identity, sampling follows the target)."""

from __future__ import annotations

import pytest
import torch
from test_decoders import EOS_ID, encode, reference_greedy
from test_seed import requests_for, seed_engine
from test_sequoia import decoder_from, drafted_trees
from test_speculative import PARAMS, check_three_tokens, ragged_requests, sample_three, sd_engine

from decoding.base.errors import ConfigError
from decoding.base.values import GenRequest
from decoding.drafters.draft_model import ModelDrafter
from decoding.runtime.runner import ModelRunner
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.trees.policies import DraftTreeOptions, PCTPolicy, pct_max_nodes

V = 12


def confidences(tree: DraftTree) -> list[float]:
    """Each node's path confidence: the product of the draft probabilities along its path."""
    out: list[float] = []
    for p, q in zip(tree.parents, tree.probs):
        out.append(q * (1.0 if p == ROOT else out[p]))
    return out


def grow_random(policy: PCTPolicy, g: torch.Generator, max_depth: int = 99) -> tuple[DraftTree, dict, list[int]]:
    """A PCT tree grown from random peaked draft distributions; also each expanded node's distribution."""
    growth = policy.grow(False, None, max_depth)
    dists: dict[int, torch.Tensor] = {}
    expanded: list[int] = []
    while growth.frontier:
        level = []
        for node in growth.frontier:
            q = (3 * torch.randn(V, generator=g)).softmax(-1)
            dists[node] = q
            expanded.append(node)
            level.append(q)
        growth.next_level(level)
    return growth.tree, dists, expanded


@pytest.mark.parametrize("ratio, threshold", [(0.1, 0.05), (0.3, 0.01), (0.05, 0.2), (1.0, 0.01)])
def test_pct_pruning_rules(ratio, threshold):
    """Over 200 random trees: a node is expanded iff its confidence >= s_d / s_t and it is above the
    depth limit; children are the top-k in order; no node under the threshold; the size bound holds."""
    policy = PCTPolicy(top_k=3, max_depth=4, threshold=threshold, ratio=ratio)
    g = torch.Generator().manual_seed(0)
    sizes = []
    for _ in range(200):
        tree, dists, expanded = grow_random(policy, g)
        conf = confidences(tree)
        depths = tree.depths()
        assert tree.draw == "top" and not tree.dists
        assert len(tree) <= policy.max_nodes and max(depths, default=0) <= 4
        assert all(c >= threshold for c in conf)
        for node in expanded:
            if node != ROOT:
                assert conf[node] >= ratio and depths[node] < 4  # never expanded under s_d / s_t
        for node in range(len(tree)):
            if conf[node] >= ratio and depths[node] < 4:
                assert node in expanded  # every node worth expanding is expanded
        for node in (ROOT, *range(len(tree))):
            kids = tree.children(node)
            if node not in dists:
                assert not kids
                continue
            q = dists[node]
            top = torch.topk(q, 3)
            base = 1.0 if node == ROOT else conf[node]
            want = [int(t) for t, p in zip(top.indices, top.values) if base * float(p) >= threshold]
            assert [tree.tokens[k] for k in kids] == want  # the top-k that pass the threshold, in rank order
        sizes.append(len(tree))
    # Trees do grow past one level, except where s_d / s_t = 1: then only the root is worth expanding.
    assert max(sizes) == 3 if ratio >= 1 else max(sizes) > 3


def test_pct_depth_limit_and_budget():
    g = torch.Generator().manual_seed(1)
    policy = PCTPolicy(top_k=2, max_depth=3, threshold=1e-6, ratio=1e-6)  # everything passes but depth
    tree, _, _ = grow_random(policy, g)
    assert max(tree.depths()) == 3 and len(tree) == 2 + 4 + 8
    tree, _, _ = grow_random(policy, g, max_depth=2)  # a row with room for 2 tokens only
    assert max(tree.depths()) == 2 and len(tree) == 6
    assert not policy.grow(False, None, 0).frontier
    assert not PCTPolicy(2, 3, 0.01, 1.5).grow(False, None, 5).frontier  # drafting never pays
    assert pct_max_nodes(5, 10, 0.01, 0.05) <= 10 * 100
    assert pct_max_nodes(2, 3, 0.4, 0.01) == 2 + 2 + 2  # at most 1 / 0.4 nodes per depth


def test_pct_with_the_draft_model(loaded, perturbed):
    """Trees the draft model grows: expanded nodes have confidence >= s_d / s_t, leaves >= threshold."""
    engine = sd_engine(
        loaded,
        perturbed,
        serial=False,
        planned=False,  # every row drafted every step: the planner would leave rows undrafted here
        tree_policy="pct",
        pct_top_k=3,
        pct_max_depth=4,
        pct_ratio=0.2,
        pct_threshold=0.02,
    )
    requests = [GenRequest(p, max_new_tokens=20, temperature=t, seed=2) for p in ("the cat", "a") for t in (0, 1)]
    seen = drafted_trees(engine, requests)
    assert seen and max(len(t) for t in seen) > 3
    for tree in seen:
        conf = confidences(tree)
        depths = tree.depths()
        assert all(c >= 0.02 - 1e-9 for c in conf) and max(depths, default=0) <= 4
        for node in range(len(tree)):
            if tree.children(node):
                assert conf[node] >= 0.2 - 1e-9


def test_greedy_identity_sd(tiny_model, tokenizer, loaded, perturbed):
    specs, requests = ragged_requests()
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    for serial in (True, False):
        engine = sd_engine(loaded, perturbed, serial=serial, tree_policy="pct", pct_ratio=0.1, pct_max_depth=4)
        assert [r.token_ids for r in engine.generate(requests)] == refs
        stats = engine.last_stats
        assert 0 < stats.accepted_tokens < stats.drafted_tokens


def test_greedy_identity_seed(tiny_model, tokenizer, loaded, perturbed):
    specs, requests = requests_for(7)
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    for overlap in (False, True):
        engine = seed_engine(loaded, perturbed, verify_batch=3, overlap=overlap, tree_policy="pct", pct_ratio=0.1)
        assert [r.token_ids for r in engine.generate(requests)] == refs


def test_ratio_measured_at_start_up(tiny_model, tokenizer, loaded, perturbed):
    """Without pct_ratio, s_d / s_t is timed on this machine (two models of one size: near 1)."""
    specs, requests = requests_for(3)
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    engine = sd_engine(loaded, perturbed, tree_policy="pct")
    policy = engine.decoder.drafter.policy
    assert 0.2 < policy.ratio < 5
    assert [r.token_ids for r in engine.generate(requests)] == refs
    with pytest.raises(ValueError, match="measures s_d / s_t against the target"):
        ModelDrafter(ModelRunner(perturbed.model), DraftTreeOptions(tree_policy="pct"), len(tokenizer))


@pytest.mark.parametrize("params_name", list(PARAMS))
def test_sampling_follows_the_target(tiny_model, tokenizer, loaded, perturbed, params_name):
    """8,000 seeded 3-token runs with PCT trees (top-k drafts, point-mass rule); tolerance as in
    test_speculative."""
    params = PARAMS[params_name]
    prompt = encode(tokenizer, "once upon a time")
    engine = sd_engine(
        loaded, perturbed, serial=False, planned=False, tree_policy="pct", pct_ratio=0.1, pct_max_depth=3
    )
    samples = sample_three(engine, prompt, params, 8000)
    stats = engine.total_stats
    # Both paths of the rule are exercised: drafts are accepted, and rejected.
    assert stats.accepted_tokens > 0.1 * stats.verify_steps and stats.acceptance_length < 3.0
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))


def test_config():
    pct = ("decoder=sd", "draft_tree.tree_policy=pct")
    spec = decoder_from(*pct, "draft_tree.pct_ratio=0.25", "draft_tree.pct_top_k=3").draft_tree
    assert (spec.tree_policy, spec.pct_ratio, spec.pct_top_k, spec.draw) == ("pct", 0.25, 3, "top")
    seed = decoder_from("decoder=seed", "draft_tree.tree_policy=pct").draft_tree
    assert seed.pct_ratio is None  # measured at start-up
    cases = {
        (*pct, "draft_tree.pct_threshold=0"): r"draft_tree\.pct_threshold=0\.0 must be in \(0, 1\)",
        ("decoder=seed", *pct[1:], "draft_tree.pct_top_k=0"): r"draft_tree\.pct_top_k=0 .* must be positive",
        (*pct, "draft_tree.pct_ratio=-1"): r"draft_tree\.pct_ratio=-1\.0 must be positive, or null",
        (*pct, "draft_tree.without_replacement=true"): (
            r"draft_tree\.tree_policy=pct takes the top-k candidates deterministically .* "
            r"set draft_tree\.without_replacement=false"
        ),
        (*pct, "draft_tree.multi_candidate=false"): r"needs draft_tree\.multi_candidate=true",
        (*pct, "draft_tree.pct_ratio=fast"): r"draft_tree\.pct_ratio='fast' is not a number",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            decoder_from(*overrides)


def test_the_policies_table_and_the_names_the_options_accept_agree():
    """`tree_policy` is checked against trees/options.py's names (no torch at a config's check); the
    table that builds the policies must hold exactly those."""
    from decoding.trees.options import TREE_POLICY_NAMES
    from decoding.trees.policies import TREE_POLICIES

    assert tuple(TREE_POLICIES) == TREE_POLICY_NAMES
