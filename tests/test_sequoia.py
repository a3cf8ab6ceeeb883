"""Sequoia's tree: the dynamic program against brute force, the hardware-aware choice, the static
Sequoia tree policy of the draft model (lossless), and `python -m decoding.sequoia_tree` on tiny models."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, build_model
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from test_decoders import EOS_ID, encode, reference_greedy
from test_seed import requests_for, seed_engine
from test_speculative import PARAMS, check_three_tokens, ragged_requests, sample_three, sd_engine

from decoding.api.config import DecoderConfig
from decoding.base.errors import ConfigError
from decoding.base.options import from_dict
from decoding.base.values import GenRequest
from decoding.runtime.models import LoadedModel
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.trees.policies import StaticPolicy
from decoding.trees.sequoia import (
    CostCurve,
    RankCounts,
    SequoiaDP,
    choose,
    expected_tokens,
    marginal,
    optimal_tree,
    tree_depth,
)
from decoding.trees.static import StaticTree
from tuning.calibrate_tree import CalibrateOptions, build, read_profile

REPO = Path(__file__).resolve().parents[1]

# --- the dynamic program ------------------------------------------------------------------------------


@cache
def ordered_trees(nodes: int, depth: int, width: int) -> tuple[tuple, ...]:
    """Every rooted ordered tree with exactly `nodes` nodes below the root, at most `depth` levels
    below it and at most `width` children per node, as nested tuples of child subtrees."""
    if nodes == 0:
        return ((),)
    if depth == 0:
        return ()
    return forests(nodes, depth, width, width)


@cache
def forests(nodes: int, depth: int, width: int, slots: int) -> tuple[tuple, ...]:
    """Ordered sequences of at most `slots` subtrees holding `nodes` nodes, each subtree a node with
    at most depth - 1 levels and `width` children per node below it."""
    if nodes == 0:
        return ((),)
    if slots == 0:
        return ()
    out = []
    for first in range(1, nodes + 1):  # nodes in the first subtree
        for sub in ordered_trees(first - 1, depth - 1, width):
            for rest in forests(nodes - first, depth, width, slots - 1):
                out.append((sub, *rest))
    return tuple(out)


def parents_of(tree: tuple) -> list[int]:
    parents: list[int] = []

    def add(children: tuple, parent: int) -> None:
        for sub in children:
            parents.append(parent)
            add(sub, len(parents) - 1)

    add(tree, ROOT)
    return parents


def test_tree_enumeration_counts():
    # Ordered trees of n + 1 nodes: Catalan(n); with limits, by hand.
    assert [len(ordered_trees(n, 6, 6)) for n in range(7)] == [1, 1, 2, 5, 14, 42, 132]
    assert len(ordered_trees(2, 1, 6)) == 1  # two children of the root
    assert len(ordered_trees(3, 2, 2)) == 3  # a(b c); a(b) c; a b(c)


def test_expected_tokens_by_hand():
    accept = [0.5, 0.4]
    assert marginal(accept) == pytest.approx([0.5, 0.2])
    # root -> (a, b), a -> c: 1 + P1 + P2 + P1 * P1
    assert expected_tokens([ROOT, ROOT, 0], accept) == pytest.approx(1 + 0.5 + 0.2 + 0.25)
    assert expected_tokens([ROOT, ROOT, ROOT], accept) == pytest.approx(1.7)  # a third rank is never accepted


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    width = 1 + seed % 3
    accept = (torch.rand(width, generator=g) * 0.9 + 0.05).tolist()
    if seed == 5:
        accept[-1] = 0.0  # a rank never accepted: its nodes add nothing and stay out of the tree
    dp = SequoiaDP(accept, 6, 3)
    for budget in range(7):
        for depth in range(4):
            best = max(
                expected_tokens(parents_of(t), accept)
                for n in range(budget + 1)
                for t in ordered_trees(n, depth, width)
            )
            tree = dp.tree(budget, depth)
            assert tree.expected_tokens == pytest.approx(best, abs=1e-12), (budget, depth)
            assert expected_tokens(tree.parents, accept) == pytest.approx(best, abs=1e-12)
            assert len(tree) <= budget and tree_depth(tree.parents) <= depth
            assert all(p == ROOT or 0 <= p < i for i, p in enumerate(tree.parents))
            StaticTree(tree.parents, {})  # a valid static tree
            assert optimal_tree(accept, budget, depth).parents == tree.parents
    if seed == 5:  # the last rank is never accepted: no node gets that many children
        assert all(len(kids) < width for kids in StaticTree(dp.tree(6, 3).parents, {}).children().values())


def test_dp_rejects_bad_input():
    with pytest.raises(ValueError, match="probabilities"):
        SequoiaDP([1.2], 4, 2)
    with pytest.raises(ValueError, match="probabilities"):
        SequoiaDP([], 4, 2)


def test_dp_trees_are_level_ordered():
    """Nodes level by level (as the draft model grows them), each sibling group in rank order."""
    tree = optimal_tree([0.7, 0.4, 0.3], 20, 5)
    assert len(tree) == 20 and tree.depth <= 5
    depths = StaticTree(tree.parents, {}).depths()
    assert depths == sorted(depths)
    assert tree.parents == tuple(sorted(tree.parents))  # parents' children are contiguous, in parent order


# --- the hardware-aware choice --------------------------------------------------------------------------


def test_choice_by_hand():
    """accept [0.6, 0.5] (P = [0.6, 0.2]); verification 10 ms for up to 3 tokens, 30 ms for 4.
    Candidates (G / step ms): one child 1.6 / (c + 10); a chain of 2: 1.96 / (2c + 10);
    two siblings: 1.8 / (c + 10); any 3-node tree: G <= 2.176 over >= 30 ms.
    With c = 2 ms per draft level: 0.133, 0.140, 0.150 -> two siblings. With c = 0: chain (0.196)."""
    curve = CostCurve((1, 2, 3, 4), (10.0, 10.0, 10.0, 30.0))
    wide = choose([0.6, 0.5], curve, 2.0, 3, 3).best
    assert wide.tree.parents == (ROOT, ROOT)
    assert wide.step_ms == pytest.approx(12.0) and wide.tokens_per_ms == pytest.approx(1.8 / 12)
    assert wide.speedup_vs(curve(1)) == pytest.approx(1.8 / 12 * 10)
    chain = choose([0.6, 0.5], curve, 0.0, 3, 3).best
    assert chain.tree.parents == (ROOT, 0) and chain.tokens_per_ms == pytest.approx(1.96 / 10)


def test_cost_curve_interpolates_and_reads_profiles(tmp_path):
    curve = CostCurve((1, 4, 16), (10.0, 16.0, 40.0))
    assert curve(2) == pytest.approx(12.0) and curve(10) == pytest.approx(28.0)
    with pytest.raises(ValueError, match="outside the measured"):
        curve(17)
    rows = [{"batch": b, "tree_tokens": t, "ms": 10.0 * t * b} for b in (1, 4) for t in (1, 2, 4)]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model": "x", "rows": rows}))
    curve, _ = read_profile(str(path), 4)
    assert curve.tokens == (1, 2, 4) and curve.ms == (40.0, 80.0, 160.0) and curve.batch == 4
    with pytest.raises(ConfigError, match=r"calibrate.profile=.* not a usable .*batches \[1, 4\]"):
        read_profile(str(path), 8)
    with pytest.raises(ConfigError, match="does not exist"):
        read_profile(str(tmp_path / "nope.json"), 1)


# --- counting the acceptance per rank ---------------------------------------------------------------------


def test_rank_counts_by_hand():
    tree = DraftTree()
    a, b, c = tree.add(5, ROOT), tree.add(6, ROOT), tree.add(7, ROOT)
    a1, b1 = tree.add(8, a), tree.add(9, b)
    counts = RankCounts()
    slots = (3, 2)
    counts.observe(tree, [b, b1], slots, room=10)  # rank 2 at the root, rank 1 under b (b's 2nd slot empty)
    assert counts.tried == [2, 1, 0] and counts.accepted == [1, 1, 0]
    counts.observe(tree, [], slots, room=10)  # all three root candidates rejected
    assert counts.tried == [3, 2, 1] and counts.accepted == [1, 1, 0]
    counts.observe(tree, [a], slots, room=10)  # a accepted, its only child rejected, its empty slot too
    assert counts.tried == [5, 3, 1] and counts.accepted == [2, 1, 0]
    counts.observe(tree, [a, a1], slots, room=1)  # no room below depth 1: only the root is counted
    assert counts.tried == [6, 3, 1] and counts.accepted == [3, 1, 0]
    assert counts.accept_vector() == pytest.approx([0.5, 1 / 3, 0.0])
    assert c == 2


# --- the Sequoia tree policy of the draft model ---------------------------------------------------------


@pytest.fixture(scope="module")
def sequoia_file(tmp_path_factory) -> str:
    tree = optimal_tree([0.6, 0.25, 0.15], 9, 4)
    path = tmp_path_factory.mktemp("sequoia") / "tree.json"
    StaticTree(tree.parents, {"made_by": "test"}).save(path)
    assert len(StaticPolicy(tree.parents).kids[ROOT]) >= 2  # the test tree does branch
    return str(path)


def test_greedy_identity_sd(tiny_model, tokenizer, loaded, perturbed, sequoia_file):
    specs, requests = ragged_requests()
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    for serial in (True, False):
        engine = sd_engine(loaded, perturbed, serial=serial, tree_policy="sequoia", tree=sequoia_file)
        assert [r.token_ids for r in engine.generate(requests)] == refs
        stats = engine.last_stats
        assert 0 < stats.accepted_tokens < stats.drafted_tokens


def test_greedy_identity_seed(tiny_model, tokenizer, loaded, perturbed, sequoia_file):
    specs, requests = requests_for(7)
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    for overlap in (False, True):
        engine = seed_engine(
            loaded, perturbed, verify_batch=3, overlap=overlap, tree_policy="sequoia", tree=sequoia_file
        )
        assert [r.token_ids for r in engine.generate(requests)] == refs


def drafted_trees(engine, requests: list[GenRequest]) -> list[DraftTree]:
    """Every tree the engine's drafter drafts while generating `requests`."""
    drafter = engine.decoder.drafter
    seen: list[DraftTree] = []
    original = drafter.draft

    def spy(rows):
        trees = original(rows)
        seen.extend(trees)
        return trees

    drafter.draft = spy
    engine.generate(requests)
    return seen


def test_trees_follow_the_static_shape(loaded, perturbed, sequoia_file, tokenizer):
    """Every drafted tree is the Sequoia shape (at temperature 0 and, drawn from q, above it)."""
    shape = StaticTree.load(sequoia_file).parents
    engine = sd_engine(loaded, perturbed, serial=False, tree_policy="sequoia", tree=sequoia_file)
    requests = [GenRequest("once upon a time", max_new_tokens=30, temperature=t, seed=1) for t in (0.0, 1.0)]
    seen = drafted_trees(engine, requests)
    full = [t for t in seen if len(t) == len(shape)]
    assert full and all(tuple(t.parents) == shape for t in full)
    assert {t.draw for t in seen} == {"top", "iid"}
    assert engine.decoder.drafter.max_nodes == len(shape)


@pytest.mark.parametrize("rule", ["without_replacement", "iid"])
def test_sampling_follows_the_target(tiny_model, tokenizer, loaded, perturbed, sequoia_file, rule):
    """8,000 seeded 3-token runs with the Sequoia tree; tolerance as in test_speculative."""
    params = PARAMS["t0.7-k20-p0.9" if rule == "iid" else "t1.0"]
    prompt = encode(tokenizer, "once upon a time")
    engine = sd_engine(
        loaded,
        perturbed,
        serial=False,
        tree_policy="sequoia",
        tree=sequoia_file,
        without_replacement=rule == "without_replacement",
    )
    samples = sample_three(engine, prompt, params, 8000)
    stats = engine.total_stats
    assert stats.accepted_tokens / stats.drafted_tokens > 0.05 and stats.acceptance_length < 4.0
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))


# --- configuration errors ----------------------------------------------------------------------------------


def decoder_from(*overrides: str) -> DecoderConfig:
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["draft.path=self", *overrides])
    return DecoderConfig.from_container(OmegaConf.to_container(cfg, resolve=True))


def test_config_errors(tmp_path, sequoia_file):
    spec = decoder_from("decoder=sd", "draft_tree.tree_policy=sequoia", f"draft_tree.tree={sequoia_file}").draft_tree
    assert spec.tree_policy == "sequoia" and spec.parents == StaticTree.load(sequoia_file).parents
    seed = decoder_from("decoder=seed", "draft_tree.tree_policy=sequoia", f"draft_tree.tree={sequoia_file}").draft_tree
    assert seed.key == "draft_tree" and seed.tree == sequoia_file
    cases = {
        (
            "decoder=sd",
            "draft_tree.tree_policy=nope",
        ): r"draft_tree\.tree_policy=nope is not one of k_config, sequoia, pct",
        (
            "decoder=sd",
            "draft_tree.tree_policy=sequoia",
        ): r"draft_tree\.tree_policy=sequoia needs draft_tree\.tree=PATH",
        (
            "decoder=seed",
            "draft_tree.tree_policy=sequoia",
            "draft_tree.tree=/no/such.json",
        ): r"draft_tree\.tree=/no/such\.json is "
        "neither a shipped tree",
        (
            "decoder=sd",
            "draft_tree.tree_policy=sequoia",
            f"draft_tree.tree={sequoia_file}",
            "draft_tree.multi_candidate=false",
        ): (r"has nodes with \d children, which needs draft_tree\.multi_candidate=true"),
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            decoder_from(*overrides)
    with pytest.raises(ConfigError, match=r"calibrate\.drafter='nope' is not one of stand, model"):
        from_dict(CalibrateOptions, {"drafter": "nope"}, "calibrate")
    with pytest.raises(ConfigError, match=r"calibrate\.calibration=\[0\]"):
        CalibrateOptions(calibration=(0,))
    with pytest.raises(ConfigError, match=r"calibrate\.method=prune prunes STAND's initial tree"):
        CalibrateOptions(method="prune", drafter="model")


# --- the command -------------------------------------------------------------------------------------------

SMALL = [
    "data.path=null",
    "data.offset=0",
    "data.limit=1",
    "task.depth=1",
    "search=bfs",
    "search.n_thoughts=2",
    "gen.max_thought_tokens=12",
    "gen.max_eval_tokens=4",
    "calibrate.calibration=[4,2]",
    "calibrate.max_budget=12",
    "calibrate.max_depth=4",
]


@pytest.fixture(scope="module")
def long_context(tokenizer) -> LoadedModel:
    """A tiny model whose context holds a GSM8K prompt in the tiny byte-level tokenizer."""
    return LoadedModel(build_model(len(tokenizer), max_positions=4096), tokenizer, DEVICE, False, "long")


def compose_command(*overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="calibrate_tree", overrides=[*SMALL, *overrides])


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory) -> str:
    rows = [{"batch": 1, "tree_tokens": t, "ms": 10.0 + 0.5 * t} for t in (1, 2, 4, 8, 16)]
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    path.write_text(json.dumps({"model": "tiny", "rows": rows}))
    return str(path)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="its seed was picked for the CPU's sampling stream")
def test_command_stand(tmp_path, long_context, profile_file):
    # One tiny problem with enough sampled text that STAND's drafts are accepted at all (with two
    # 12-token thoughts most seeds accept nothing, which the command reports as an error), under the
    # rule whose draws these few accepted drafts were recorded with (the random model's rates are
    # near zero under either rule: which rank the few land on is luck).
    cfg = compose_command(
        f"calibrate.profile={profile_file}",
        "gen.temperature=0.7",
        "gen.seed=0",
        "search.n_thoughts=4",
        "gen.max_thought_tokens=24",
        "verify.rule=match_multinomial",
        "task.thoughts=subquestions",  # the setup its seed was picked under
    )
    made, summary = build(cfg, tmp_path / "run", target=long_context, progress=False)
    meta = made.tree.meta
    assert summary["n_problems"] == 1 and meta["drafter"] == "stand" and meta["decoder"] == "stand"
    assert meta["draw"] == "without_replacement" and meta["temperature"] == 0.7
    assert meta["rule"] == "match_multinomial"
    tried, accepted = meta["counts"]["tried"], meta["counts"]["accepted"]
    assert len(meta["accept"]) == 4 and meta["calibration_steps"] > 0 and tried[0] > 0
    assert all(a <= t for a, t in zip(accepted, tried)) and tried == sorted(tried, reverse=True)
    assert len({tuple(c.values()) for c in meta["best_candidates"]}) == len(meta["best_candidates"])
    assert 1 <= meta["nodes"] <= 12 and meta["tree_depth"] <= 4
    assert meta["expected_tokens"] == pytest.approx(expected_tokens(made.tree.parents, made.accept), abs=1e-5)
    assert meta["cost_model"]["verify"]["source"] == profile_file
    out = tmp_path / "tree.json"
    made.tree.save(out)
    # Loadable as STAND's tree and as the draft model's Sequoia tree.
    assert StaticTree.load(str(out)).parents == made.tree.parents
    assert (
        decoder_from("decoder=sd", "draft_tree.tree_policy=sequoia", f"draft_tree.tree={out}").draft_tree.parents
        == made.tree.parents
    )
    # Re-solved from the recorded counts without decoding: the same tree for the same costs.
    again, _ = build(compose_command(f"calibrate.from_counts={out}"), tmp_path / "again")
    assert again.tree.parents == made.tree.parents and again.tree.meta["resolved_from"] == str(out)


def test_command_model_measures_the_profile(tmp_path, long_context):
    cfg = compose_command(
        "calibrate.drafter=model",
        "draft.path=self",
        "gen.temperature=0",
        "calibrate.tree_sizes=[1,2,4,8]",
        "calibrate.repeats=2",
    )
    made, _ = build(cfg, tmp_path / "run", target=long_context, draft=long_context, progress=False)
    meta = made.tree.meta
    assert meta["decoder"] == "sd" and meta["draw"] == "top" and meta["draft"] == "self"
    # The target drafting for itself at temperature 0: the first candidate is always accepted.
    assert made.accept[0] == pytest.approx(1.0)
    assert meta["cost_model"]["verify"]["tree_tokens"] == [1, 2, 4, 8]
    assert json.loads((tmp_path / "run" / "profile.json").read_text())["rows"][0]["tree_tokens"] == 1
    assert meta["cost_model"]["draft_ms_per_level"] > 0
    assert len(made.tree) <= 7  # the measured sizes end at 8 tree tokens


def test_command_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"calibrate\.drafter=model measures a draft model: set draft\.path"):
        build(compose_command("calibrate.drafter=model"), tmp_path)
    with pytest.raises(ConfigError, match=r"calibrate\.profile=.*does not exist"):
        build(compose_command(f"calibrate.profile={tmp_path / 'none.json'}"), tmp_path)
    with pytest.raises(ConfigError, match="has no recorded counts"):
        StaticTree((ROOT,), {}).save(tmp_path / "plain.json")
        build(compose_command(f"calibrate.from_counts={tmp_path / 'plain.json'}"), tmp_path)


def test_command_line_exit_status():
    result = subprocess.run(
        [sys.executable, "-m", "tuning.calibrate_tree", "calibrate.drafter=nope"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: calibrate.drafter='nope' is not one of stand, model"
