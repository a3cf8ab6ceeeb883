"""Where a decode step's time goes: admission, the verification forward, and the host's work around
it by stage (`DecodeStats.host_*_s`), adding up to the step's wall time as the engine clocks it."""

from __future__ import annotations

import itertools
import random
import statistics
import time

import pytest
import torch
from conftest import DEVICE
from test_continuous import engine_for

import decoding.schedules.rounds as rounds_module
from decoding.base.run import run_sync
from decoding.base.values import HOST_STAGES, DecodeStats, GenRequest, ScheduleStats
from decoding.runtime import kernels
from decoding.runtime.kv_cache import RowKVCache
from decoding.runtime.packing import pack
from decoding.runtime.paged_kv import BLOCK, BlockPool, PagedKVCache
from decoding.schedules.rounds import Rounds
from decoding.schedules.step import Laps
from decoding.speculation.draft_tree import DraftTree
from decoding.speculation.sampling import argmax_rows

PROMPTS = ["the cat", "hello world and more", "a", "once upon a time", "the dog sat on the mat"]


def test_laps_charge_each_stage_the_time_since_the_last():
    ticks = itertools.count(0.0, 0.5)
    laps = Laps(lambda: next(ticks))  # 0.0 at the start, then 0.5 a call
    laps.lap("pack")
    laps.lap("launch", less=0.25)  # 0.5 s, of it 0.25 the forward's
    laps.lap("pack")
    assert laps.seconds == {"pack": 1.0, "launch": 0.25} and laps.total == 1.5


@pytest.mark.parametrize("name", ["ar", "stand", "seed_stand", "sd"])
def test_a_steps_stages_add_up_to_its_wall_time(name, loaded, perturbed):
    engine = engine_for(name, loaded, perturbed)
    requests = [
        GenRequest(p, max_new_tokens=10 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=i)
        for i, p in enumerate(PROMPTS)
    ]
    decoder = engine.decoder
    decoder.admit([engine._sequence(r) for r in requests])
    s, gaps = ScheduleStats(), []
    while decoder.busy:
        t0 = time.perf_counter()
        cost = decoder.step().cost
        gaps.append(time.perf_counter() - t0 - cost.schedule.step_s)
        s += cost.schedule
    assert s.steps == len(gaps) >= 10 and s.forward_s > 0 and s.admit_s > 0
    # The stages are laps of one clock: they and the forward make the step, exactly ...
    assert s.admit_s + s.forward_s + s.host_s == pytest.approx(s.step_s, rel=1e-9)
    # ... and the step is what a clock around it sees, bar the call and its return (tens of us; the
    # median: a step the machine preempted between the two clocks' reads is not the laps' fault).
    assert min(gaps) >= 0 and statistics.median(gaps) <= 2e-4
    stages = s.host_by_stage
    assert set(stages) == set(HOST_STAGES)
    if DEVICE.type == "cpu":  # on a GPU the forward's kernels run on after its call returns
        assert all(v >= 0 for v in stages.values()), stages
    assert stages["accept"] > 0 and stages["commit"] > 0 and stages["pack"] > 0
    summary = s.host_summary()
    assert summary["steps"] == s.steps
    assert summary["host_ms_per_step"] == pytest.approx(sum(summary["host_ms_per_step_by_stage"].values()))
    assert summary["host_ms_per_step"] == pytest.approx(1000 * s.host_s / s.steps)


def test_a_search_reports_its_steps_in_its_calls_shares(loaded):
    """Through `agenerate` (as a search calls it) the calls' shares of the steps add up to what the
    engine clocked around them."""
    engine = engine_for("ar", loaded, None)
    run_sync(engine.agenerate([GenRequest(p, max_new_tokens=8) for p in PROMPTS]))
    s = engine.total_stats.schedule
    assert s.steps >= 8 and 0 <= engine.step_s - s.step_s <= 0.5 * engine.step_s


def test_step_times_survive_the_records_and_add_across_calls():
    a = DecodeStats()
    a.schedule.add_step(0.010, 0.004, {"admit": 0.001, "pack": 0.002, "accept": 0.003})
    b = DecodeStats.from_dict(a.to_dict())
    assert b == a
    b += a
    assert (b.schedule.steps, b.schedule.host_pack_s, b.schedule.admit_s) == (2, 0.004, 0.002)
    assert b.schedule.host_ms_per_step == pytest.approx(5.0) and b.schedule.forward_ms_per_step == pytest.approx(4.0)


# The batched stages against their per-row definitions: the same layout, the same cache, the same tokens.


def per_row_pack(pending: list[list[int]], trees: list[DraftTree]) -> tuple[torch.Tensor, ...]:
    """The layout packing.py's doc describes, written row by row."""
    n_pending, width = max(map(len, pending)), max(map(len, pending)) + max(map(len, trees))
    tokens, depth = (
        torch.zeros(len(pending), width, dtype=torch.long),
        torch.zeros(len(pending), width, dtype=torch.long),
    )
    see = torch.eye(width, dtype=torch.bool).repeat(len(pending), 1, 1)
    for b, (pend, tree) in enumerate(zip(pending, trees)):
        pad, n, end = n_pending - len(pend), len(tree), n_pending + len(tree)
        tokens[b, pad:n_pending] = torch.tensor(pend)
        see[b, pad:n_pending, pad:n_pending] = torch.ones(len(pend), len(pend), dtype=torch.bool).tril()
        depth[b, pad:n_pending] = torch.arange(len(pend))
        if n:
            tokens[b, n_pending:end] = torch.tensor(tree.tokens)
            see[b, n_pending:end, pad:n_pending] = True
            see[b, n_pending:end, n_pending:end] = tree.ancestry()
            depth[b, n_pending:end] = len(pend) - 1 + torch.tensor(tree.depths())
    return tokens, see, depth


def random_rows(rng: random.Random, batch: int) -> tuple[list[list[int]], list[DraftTree]]:
    pending = [[rng.randint(1, 99) for _ in range(rng.randint(1, 4))] for _ in range(batch)]
    trees = []
    for _ in range(batch):
        tree = DraftTree()
        for _ in range(rng.choice([0, 0, 1, 3, 6])):
            tree.add(rng.randint(1, 99), rng.randint(-1, len(tree) - 1))
        trees.append(tree)
    return pending, trees


def test_pack_lays_rows_out_as_row_by_row():
    rng = random.Random(0)
    for _ in range(200):
        pending, trees = random_rows(rng, rng.randint(1, 6))
        packed = pack(pending, trees)
        tokens, see, depth = per_row_pack(pending, trees)
        assert torch.equal(packed.tokens, tokens) and torch.equal(packed.see, see) and torch.equal(packed.depth, depth)
        width = packed.tokens.shape[1]
        real = [b * width + c for b, (p, n) in enumerate(zip(packed.pads, packed.sizes)) for c in range(p, p + n)]
        assert packed.real.tolist() == real
        index, counts = packed.real_logits_index()
        starts = [sum(packed.sizes[:b]) for b in range(len(pending))]
        roots = [s + packed.n_pending - 1 - p for s, p in zip(starts, packed.pads)]
        assert counts == [len(t) + 1 for t in trees]
        assert index.tolist() == [r + k for r, c in zip(roots, counts) for k in range(c)]


@pytest.mark.parametrize("paged", [False, True])
def test_commit_rows_commits_what_commit_does_row_by_row(paged):
    rng = random.Random(1)
    caches = []
    for _ in range(2):
        if paged:
            cache = PagedKVCache(BlockPool(2, 2, 4, torch.float32, "cpu"), 5, 96)
        else:
            cache = RowKVCache(2, 5, 2, 4, 96, torch.float32, "cpu")
        caches.append(cache)
    for step in range(6):
        rows = sorted(rng.sample(range(5), rng.randint(1, 5)))
        width = rng.randint(1, 12)
        kept = [sorted(rng.sample(range(width), rng.randint(1, width))) for _ in rows]
        if step % 2:
            kept[0] = list(range(len(kept[0])))  # in place already: nothing to move
        for cache in caches:
            if paged:
                cache.prepare(width, rows=rows)  # the forward takes the rows' blocks for its slots
            view_rows = torch.tensor(rows)
            for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
                torch.manual_seed(step * 10 + layer)  # both caches written alike
                new = torch.randn(len(rows), 2, width, 4)
                if paged:
                    slots = cache.lens[view_rows][:, None] + torch.arange(width)
                    blocks = cache.tables[view_rows[:, None], slots // BLOCK]
                    k[blocks, :, slots % BLOCK] = new.transpose(1, 2)
                    v[blocks, :, slots % BLOCK] = -new.transpose(1, 2)
                else:
                    slots = cache.lens[view_rows][:, None] + torch.arange(width)
                    k[view_rows[:, None], :, slots] = new.transpose(1, 2)
                    v[view_rows[:, None], :, slots] = -new.transpose(1, 2)
        one, batched = caches
        for row, k in zip(rows, kept):
            one.commit(row, k)
        batched.commit_rows(rows, kept)
        assert torch.equal(one.lens, batched.lens)
        for row in range(5):
            for a, b in zip(stored(one, row), stored(batched, row)):
                assert torch.equal(a, b)
    if paged:
        assert one.pool.used == batched.pool.used  # the blocks past each row's end went back alike


def stored(cache: RowKVCache | PagedKVCache, row: int) -> list[torch.Tensor]:
    """What a row has committed, layer by layer, keys then values."""
    n = int(cache.lens[row])
    if isinstance(cache, PagedKVCache):
        pos = torch.arange(n)
        blocks = cache.tables[row, pos // BLOCK]
        return [t[blocks, :, pos % BLOCK] for t in [*cache.keys, *cache.values]]
    return [t[row, :, :n] for t in [*cache.keys, *cache.values]]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "numpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_argmax_rows_is_torchs_argmax(dtype, kernel, monkeypatch):
    """Both paths (csrc/argmax.cpp reads bfloat16 rows where the kernels are built; numpy the rest):
    ties, NaNs of both signs anywhere in a row, signed zeros, all -inf, rows shorter than the
    kernel's lanes and tails past them."""
    if kernel:
        kernels.load()
    else:
        monkeypatch.setattr(kernels, "built", lambda: None)
    torch.manual_seed(0)
    x = torch.randn(9, 1000).to(dtype)
    x[1, 10] = x[1, 20] = 1e4  # a tie: the first
    x[2, 7] = float("nan")  # a NaN counts as the largest, as in torch
    x[3, 5] = -float("nan")
    x[4] = 0.0
    x[4, 3] = -0.0  # equal zeros: the first
    x[5] = -float("inf")
    x[6, 999] = float("nan")  # in the tail past the last full lane group
    x[7, 0] = float("nan")
    x[8, 4] = x[8, 996] = 1e4  # a tie between a lane and the tail
    assert argmax_rows(x) == x.argmax(-1).tolist()
    for width in (1, 7, 8, 15, 16, 17, 49152):
        y = torch.randn(5, width).to(dtype)
        assert argmax_rows(y) == y.argmax(-1).tolist(), width


def test_the_rounds_log_stays_bounded(monkeypatch):
    monkeypatch.setattr(rounds_module, "LOG_EVENTS", 10)
    rounds = Rounds()
    for _ in range(100):
        rounds._note(("queued", 0))
    assert 10 <= len(rounds.log) <= 20
