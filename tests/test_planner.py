"""The goodput step planner: its cost model, calibrated acceptance, cuts and what it plans."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from decoding.api.engine import Engine
from decoding.base.errors import ConfigError
from decoding.base.values import GenRequest, Group
from decoding.drafters.stand import StandDrafter, StandOptions
from decoding.runtime.runner import ModelRunner
from decoding.schedules.planner import FAR_PROBE, PLAIN_REUSE, PROBE, SELDOM, Planner, best_first
from decoding.schedules.scheduler import Scheduler
from decoding.schedules.step import forward_context
from decoding.speculation.calibration import EXPLORE, AcceptanceRecord
from decoding.speculation.cost import CONTEXT, ForwardCost, Overhead, cost_key, forward_cost, node_ms, profile
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.slot import Estimate, Slot
from decoding.speculation.verify import Verdict
from decoding.trees.static import StaticTree

REPO = Path(__file__).resolve().parents[1]
# A CPU-like curve: every token of a forward costs about as much as the forward's fixed part.
STEEP = ForwardCost({1: [(1, 10.0), (16, 160.0)], 16: [(16, 160.0), (256, 2560.0)]})
# A GPU-like curve: flat up to hundreds of tokens at small batch.
FLAT = ForwardCost({1: [(1, 10.0), (16, 10.0), (256, 11.0)], 16: [(16, 10.5), (256, 12.0)]})


def chain(tokens: list[int], prob: float = 0.9) -> DraftTree:
    tree = DraftTree()
    parent = ROOT
    for t in tokens:
        parent = tree.add(t, parent, prob)
    return tree


def sure_record(tree: DraftTree, times: int = 200) -> AcceptanceRecord:
    """A record that has seen every node of `tree` accepted `times` times: synthetic acceptance ~1."""
    record = AcceptanceRecord()
    for _ in range(times):
        record.observe(tree, list(range(len(tree))), greedy=True)
    return record


def test_no_draft_tokens_where_they_cost_more_than_they_return():
    tree = chain([5, 6, 7, 8], prob=0.3)
    record = AcceptanceRecord()
    for _ in range(100):  # accepted one time in five
        record.observe(tree, [0] if np.random.default_rng(len(record.tried)).random() < 0.2 else [], greedy=True)
    planner = Planner(STEEP, record, draft_ms_per_row=8.0)  # drafting costs too (a draft model's forwards)
    rows = [Estimate(), Estimate()]  # what the slots of two rows hold for the planner
    cut, plan = planner.cut(rows, [tree, tree], [True, True], [1, 1], 100.0)
    assert plan.nodes == [0, 0] and [len(t) for t in cut] == [0, 0]
    # Rows whose kept nodes are worth nothing stop being drafted, and are looked at again later:
    # rarely once the trees' best node has seldom been able to pay at this cost (no verdict can change
    # that), not after one such step (one step's trees are one draw of what drafts are worth).
    planner.cut(rows, [tree, tree], [True, True], [1, 1], 100.0)
    assert [planner.budgets(rows, 4) for _ in range(PROBE)][-1] == [4, 4]
    for _ in range(30):
        planner.cut(rows, [tree, tree], [True, True], [1, 1], 100.0)
    assert planner.pays < SELDOM
    budgets = [planner.budgets(rows, 4) for _ in range(FAR_PROBE)]
    assert budgets == [[0, 0]] * (FAR_PROBE - 1) + [[4, 4]]
    # Where forwards got cheap (fewer rows, another machine) the same nodes pay: looked at every PROBE steps.
    planner.cost = FLAT
    _, plan = planner.cut(rows, [tree, tree], [True, True], [1, 1], 100.0)
    assert sum(plan.nodes) > 0
    assert [planner.budgets(rows, 4) for _ in range(PROBE)] == [[0, 0]] * (PROBE - 1) + [[4, 4]]
    # A new sequence's row starts from what the other rows' drafts were worth: not drafted either.
    assert planner.budgets([Estimate()], 4) == [0]


def test_a_plain_steps_plan_is_priced_once_while_its_rows_stay():
    """A step that verifies no draft reads the context (every row's blocks) only when its plan is
    priced: anew every PLAIN_REUSE steps of the same rows and tokens, and whenever those change."""
    planner = Planner(copy.deepcopy(STEEP))
    reads: list[float] = []

    def context() -> float:
        reads.append(100.0)
        return 100.0

    first = planner.plain(2, [1, 1], context)
    assert first.nodes == [0, 0] and first.expected_tokens == 2 and planner.rate_per_ms > 0
    plans = [planner.plain(2, [1, 1], context) for _ in range(PLAIN_REUSE - 2)]
    assert len(reads) == 1 and all(p == first for p in plans)
    # The cost model corrected meanwhile: the reused forward's prediction follows it (observe reads it).
    planner.cost.observe(first.predicted_forward_ms, 2 * first.predicted_forward_ms)
    scaled = planner.plain(2, [1, 1], context)
    assert scaled.predicted_forward_ms == pytest.approx(first.predicted_forward_ms * planner.cost.correction)
    planner.plain(2, [1, 1], context)
    assert len(reads) == 2  # priced again
    planner.plain(3, [1, 1, 1], context)  # another row count
    assert len(reads) == 3
    # cut's own plain case goes the same way: no tree has a node, nothing ranked.
    cut, plan = planner.cut([Estimate()] * 3, [DraftTree()] * 3, [True] * 3, [1] * 3, 100.0)
    assert plan.nodes == [0, 0, 0] and [len(t) for t in cut] == [0, 0, 0] and len(reads) == 3


def test_large_trees_under_a_flat_curve():
    tree = DraftTree()
    for t in range(8):  # eight candidates at depth 1, each with a chain of 3 under it
        node = tree.add(10 + t, ROOT, 0.5)
        for d in range(3):
            node = tree.add(20 + d, node, 0.5)
    record = AcceptanceRecord()
    for i in range(400):  # one of the first four candidates accepted each time in turn, its chain after it
        first = 4 * (i % 4)
        record.observe(tree, [first, first + 1, first + 2, first + 3], greedy=True)
    flat = Planner(FLAT, record)
    _, plan = flat.cut([Estimate() for _ in range(4)], [tree] * 4, [True] * 4, [1] * 4, 100.0)
    steep = Planner(STEEP, record)
    _, steep_plan = steep.cut([Estimate() for _ in range(4)], [tree] * 4, [True] * 4, [1] * 4, 100.0)
    assert min(plan.nodes) >= 16 and sum(steep_plan.nodes) < sum(plan.nodes)
    assert flat.budgets([Estimate()], 32) == [32]  # a new row where drafts have paid is drafted from its first step


def test_a_cut_keeps_a_first_run_of_siblings_in_draw_order():
    tree = DraftTree(draw="without_replacement")
    a = tree.add(1, ROOT, 0.1)  # drawn first, unlikely
    b = tree.add(2, ROOT, 0.8)
    tree.add(3, b, 0.9)
    tree.add(4, a, 0.9)
    reach = [0.1, 0.8, 0.72, 0.09]
    order = best_first(tree, reach)
    # b cannot come before a (its earlier sibling), nor a node before its parent.
    assert order == [0, 1, 2, 3]
    for k in range(len(order) + 1):
        kept = tree.subtree(sorted(order[:k]))
        for node, parent in enumerate(kept.parents):
            assert parent < node
            sibs = [i for i, p in enumerate(kept.parents) if p == parent]
            assert sibs == list(range(sibs[0], sibs[0] + len(sibs))) or parent != ROOT
    deep = chain([1, 2, 3])
    deep.add(9, ROOT, 0.1)  # a second root candidate, after the chain in the node list
    assert best_first(deep, [0.9, 0.8, 0.7, 0.05]) == [0, 1, 2, 3]  # depth first where it pays
    sub = deep.subtree([0, 3])
    assert sub.tokens == [1, 9] and sub.parents == [ROOT, ROOT]


def test_calibration_follows_verdicts():
    tree = chain([1, 2], prob=0.9)
    record = AcceptanceRecord()
    untried = record.accept(tree, True)[0]
    assert untried >= 0.9  # the drafter's score before any verdict, and optimism: it gets tried
    for _ in range(300):
        record.observe(tree, [], greedy=True)  # never accepted
    assert record.accept(tree, True)[0] < 0.05
    assert record.accept(tree, False)[0] == untried  # sampled rows are a separate record
    # The second node was never tried (its parent was never reached), yet its prior is no longer its
    # raw score: the source's scores ran high, so its score is scaled by how they fared.
    scale = record.scale((tree.source_of(1), True, True))
    assert scale < 0.05
    assert record.accept(tree, True)[1] == pytest.approx(0.9 * scale + EXPLORE)


def test_calibration_keeps_first_children_apart_from_their_siblings():
    # Under match_gumbel a coupled drafter's first child is its guess of the target's own sample and
    # is accepted far more often than its score says; the runners-up behind it are not.
    tree = DraftTree()
    first = tree.add(1, ROOT, 0.3)
    tree.add(2, ROOT, 0.3)
    record = AcceptanceRecord()
    for _ in range(300):
        record.observe(tree, [first], greedy=False)
    first_p, sibling_p = record.accept(tree, False)
    assert first_p > 0.9 and sibling_p < 0.1
    # A new first child at another depth and score inherits its pool's record: scores scaled up.
    other = chain([5, 6], prob=0.2)
    assert record.accept(other, False)[0] > 0.6


def test_a_steps_candidate_plans_cost_what_each_would_alone():
    """`ms_each` (one pass of array arithmetic over a step's candidate plans) gives `ms`'s values
    exactly: ragged and padded, between and past the profiled points and row counts, one row count."""
    one_curve = ForwardCost({4: [(4, 9.0), (16, 20.0), (64, 70.0)]}, context_ms=0.3)
    for cost in (STEEP, FLAT, ForwardCost(STEEP.points, ragged=False, context_ms=1.0), one_curve):
        for rows in (1, 3, 16, 40):
            tokens = rows + np.arange(0, 300, 7, dtype=float)
            widths = np.minimum(1 + np.arange(len(tokens)), 64).astype(float)
            for context in (0.0, 256.0, 900.0):
                want = [cost.ms(rows, t, w, context) for t, w in zip(tokens.tolist(), widths.tolist())]
                assert cost.ms_each(rows, tokens, widths, context).tolist() == want


def test_cost_model_fit_padding_and_cache(tiny_model, tmp_path):
    target = ModelRunner(tiny_model)
    cost = profile(target, repeats=1)
    assert cost.ragged == target.ragged
    assert 0.0 <= cost.shared_saving <= 1.0  # measured: siblings read a shared context once
    assert ForwardCost.from_json(cost.to_json(), "cached").shared_saving == cost.shared_saving
    for rows, points in cost.points.items():
        ns = [n for n, _ in points]
        assert ns == sorted(ns) and ns[0] == rows
    # Padded forwards cost rows x the widest row; ragged ones the tokens their rows hold.
    padded = ForwardCost(STEEP.points, ragged=False)
    assert float(padded.ms(4, 5, 2, 0)) == pytest.approx(float(STEEP.ms(4, 8, 2, 0)))
    assert float(STEEP.ms(4, 5, 2, 0)) < float(padded.ms(4, 5, 2, 0))
    # So is attention past the profiled context: by real tokens (pads' queries skipped) or rows x width.
    ragged_ctx = ForwardCost(STEEP.points, context_ms=1.0)
    padded_ctx = ForwardCost(STEEP.points, context_ms=1.0, ragged=False)
    assert float(ragged_ctx.ms(4, 5, 2, 256 + 1000) - ragged_ctx.ms(4, 5, 2, 256)) == pytest.approx(5.0)
    assert float(padded_ctx.ms(4, 5, 2, 256 + 1000) - padded_ctx.ms(4, 5, 2, 256)) == pytest.approx(8.0)
    # Interpolated between points and continued linearly past them.
    assert float(STEEP.ms(1, 8, 8, 0)) == pytest.approx(80.0)
    assert float(STEEP.ms(1, 32, 32, 0)) == pytest.approx(320.0)

    # Between profiled row counts, read at the same total tokens: a forward whose linear layers cost
    # its tokens (2 ms each) and whose rows add 1 ms each is predicted at unprofiled shapes to within
    # the log-interpolation of the row term, 7% (read at the same tokens per row, 8 x 4 came out as
    # the mean of 4 x 4 and 16 x 4: 95 ms for 77).
    def true_ms(rows: int, tokens: int) -> float:
        return 5.0 + 2.0 * tokens + 1.0 * rows

    linear = ForwardCost({r: [(r * t, true_ms(r, r * t)) for t in (1, 2, 4, 8)] for r in (4, 16)})
    for rows, per_row in ((8, 1), (8, 4), (12, 2), (6, 3)):
        assert linear.ms(rows, rows * per_row, per_row, 0) == pytest.approx(true_ms(rows, rows * per_row), rel=0.08)
    # Online correction follows measured forwards, bounded.
    c = ForwardCost(STEEP.points)
    for _ in range(200):
        c.observe(float(c.ms(1, 1, 1, 0)), 20.0)
    assert float(c.ms(1, 1, 1, 0)) == pytest.approx(20.0, rel=0.02)
    # Profiled once per model / device / threads, then read from the cache.
    first = forward_cost(target, tmp_path)
    file = tmp_path / "cost" / f"{cost_key(target)}.json"
    assert file.exists() and first.source == str(file)
    again = forward_cost(target, tmp_path)
    assert again.points == first.points
    # Another CPU or GPU (a cache folder outlives its machine) is another profile.
    key = cost_key(target)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("decoding.runtime.kernels.cpu_model", lambda: "another CPU")
        m.setattr("torch.cuda.get_device_name", lambda device=None: "another GPU")
        assert cost_key(target) != key
    # A profile written elsewhere (profile_forward's rows, e.g. a GPU's) is read as padded forwards.
    rows = [{"batch": 1, "tree_tokens": t, "ms": 5.0 + 0.01 * t, "context": 300} for t in (1, 16, 64)]
    (tmp_path / "gpu.json").write_text(json.dumps({"model": "x", "rows": rows}))
    gpu = forward_cost(target, tmp_path, str(tmp_path / "gpu.json"))
    assert not gpu.ragged and float(gpu.ms(1, 16, 16, 300)) == pytest.approx(5.16)
    (tmp_path / "broken.json").write_text('{"rows": [{"batch": 1}]}')
    with pytest.raises(ConfigError, match=r"verify.cost=.*broken.json is not a forward-cost profile"):
        forward_cost(target, tmp_path, str(tmp_path / "broken.json"))


def test_every_ready_row_is_verified_in_every_forward(loaded, tokenizer):
    drafter = StandDrafter(StandOptions(), StaticTree.load("default"), len(tokenizer))
    engine = Engine(loaded, "ar")
    engine.decoder = Scheduler("stand", engine.target, tokenizer, drafter, planner=Planner(STEEP))
    requests = [GenRequest(f"row {i} counts to", max_new_tokens=12, temperature=0.0) for i in range(6)]
    decoder = engine.decoder
    decoder.admit([engine._sequence(r) for r in requests])
    steps = 0
    while decoder.busy:
        live = decoder.live + len(decoder.waiting)
        assert decoder.step().cost.schedule.planned_rows == live  # no row waits for another's forward
        steps += 1
    assert steps > 1


def test_drafters_keep_learning_without_drafts(tokenizer):
    """A row given no draft tokens updates the pool from what it commits: afterwards it drafts what
    a row that drafted all along drafts."""
    from decoding.speculation.sampling import SamplingParams
    from decoding.speculation.sequence import Sequence
    from decoding.speculation.stopping import StopRule

    text = tokenizer.encode("the cat sat on the mat and the cat sat on the")
    drafters = [StandDrafter(StandOptions(prime_with_prompt=False), StaticTree.load("default"), len(tokenizer))]
    drafters.append(StandDrafter(StandOptions(prime_with_prompt=False), StaticTree.load("default"), len(tokenizer)))
    rule = StopRule(frozenset(), (), 64)
    seqs = [Sequence.create(text[:1], rule, SamplingParams(0.0), 0, group=Group("g")) for _ in drafters]
    slots = [Slot(0, s) for s in seqs]
    for d, slot in zip(drafters, slots):
        d.admit([slot])
    vocab = len(tokenizer)
    for token in text[1:]:
        logits = torch.full((1, vocab), -10.0)
        logits[0, token] = 10.0
        for d, slot, drafted in zip(drafters, slots, (True, False)):
            if drafted:
                d.draft([slot])
            best = logits.softmax(-1).topk(10)
            v = Verdict(DraftTree(), [], token, None, logits, kept=1, top=(best.indices, best.values))
            slot.seq.generated.append(token)
            d.update([slot], [v])
    a, b = (d.draft([slot])[0] for d, slot in zip(drafters, slots))
    assert a.tokens and a.tokens == b.tokens and a.probs == b.probs


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "llama-3.1-8b"])
def test_a_measured_gpu_curve_pays_for_large_trees(shape):
    """The curves measured on an H100 (docs/data, docs/performance.md "On a GPU") are flat from 1 to 64
    tokens per row at 8 rows: a chain the record has seen accepted whole half the time (else not at
    all) is kept whole there, where a CPU-like curve keeps none of it."""
    cost = ForwardCost.load(REPO / "docs" / "data" / f"h100_{shape}.json")
    assert cost.ms(8, 8 * 32, 32, CONTEXT) < 1.5 * cost.ms(8, 8, 1, CONTEXT)
    tree = chain(list(range(100, 116)))
    record = AcceptanceRecord()
    for i in range(400):
        record.observe(tree, list(range(16)) if i % 2 else [], greedy=True)
    _, plan = Planner(cost, record).cut([Estimate() for _ in range(8)], [tree] * 8, [True] * 8, [1] * 8, 100.0)
    _, steep = Planner(STEEP, record).cut([Estimate() for _ in range(8)], [tree] * 8, [True] * 8, [1] * 8, 100.0)
    assert plan.nodes == [16] * 8 and steep.nodes == [0] * 8


def test_the_work_around_the_forward_and_drafting_are_charged_as_measured(tiny_model):
    # Fitted in rows from the steps' times; a node is charged its measured share, not a fit.
    overhead = Overhead(node_ms=0.1)
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = int(rng.integers(1, 17))
        overhead.observe(rows, 0, 2.0 + 1.5 * rows + float(rng.normal(0, 0.3)))
    assert (overhead.a, overhead.b) == pytest.approx((2.0, 1.5), abs=0.3)
    # A slow step of many nodes leaves a node's charge as measured (a fitted one once read 1.5 ms
    # per node from such a step, and no node was kept again).
    overhead.observe(10, 30, 60.0)
    assert float(overhead.ms(10, 1) - overhead.ms(10, 0)) == pytest.approx(0.1)
    assert 0 <= node_ms(ModelRunner(tiny_model)) < 5.0
    # Drafting is charged per drafted row; one call that folded a pool's backlog counts at most 4x.
    planner = Planner(STEEP)
    planner.drafted(4, 2.0)
    assert planner.draft_ms_per_row == pytest.approx(0.5)
    planner.drafted(1, 500.0)
    assert planner.draft_ms_per_row == pytest.approx(0.9 * 0.5 + 0.1 * 2.0)


def test_the_profiled_forward_scores_what_a_batched_prefill_would(tiny_model):
    """timing.verification computes one row's prompt and copies its keys and values into every row
    (the profile computes it once for all its forwards): every row then scores its tree with the
    logits of a row whose prompt was computed in the batch."""
    from decoding.runtime.runner import ModelRunner
    from decoding.speculation.timing import chain_tree, filled, verification
    from decoding.speculation.verify import pack

    runner = ModelRunner(tiny_model)
    scored = verification(runner, 20, 4, 3)().logits
    prompt = filled(runner, 20)
    for batch in (2, 3):  # one prompt, many forwards
        again = verification(runner, 20, 4, batch, prompt=prompt)().logits
        assert all(torch.equal(a, b) for a, b in zip(again, scored[:batch], strict=True))
    cache = runner.new_cache(3, 26)
    fill = pack([[(100 + i) % tiny_model.config.vocab_size for i in range(20)]] * 3, [DraftTree()] * 3)
    runner.forward(cache, fill.tokens, fill.see, fill.depth)
    cache.advance(torch.full((3,), 20))
    tree = chain_tree(3, tiny_model.config.vocab_size)
    batched = runner.score(cache, pack([[7]] * 3, [tree] * 3)).logits
    assert all(torch.equal(a, b) for a, b in zip(scored, batched, strict=True))


def test_the_planner_prices_context_read_from_a_sibling_by_what_it_saves(loaded):
    """The forward's context as the cost model sees it: the rows' committed positions, those read once
    for a group of siblings counted at the share of their cost they still take."""
    runner = ModelRunner(loaded.model)
    prompts = [list(range(3, 203))] * 4 + [list(range(150, 3, -1))]  # 4 samples of one state, another
    cache = runner.new_cache(len(prompts), 256)
    runner.admit(cache, list(range(len(prompts))), prompts, room=8)
    slots = [Slot(r, None, [], None, cache) for r in range(len(prompts))]  # type: ignore[arg-type]
    total, shared = cache.reads(list(range(len(prompts))))
    assert total == 4 * 199 + 146 and shared == 3 * 192  # the 4 samples' whole blocks of 64, once
    assert forward_context(cache, slots, 0.0) == total / 5
    assert forward_context(cache, slots, 0.5) == (total - 0.5 * shared) / 5
