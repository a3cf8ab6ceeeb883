"""Rows admitted with one prefix read it once: the attention kernel reads a group's shared positions
from one row for the queries of all of them, and every query keeps the bits it has alone."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from decoding.base.values import GenRequest
from decoding.runtime import kernels
from decoding.runtime.kv_cache import ForwardView, shared_reads
from decoding.runtime.paged_kv import BLOCK, PagedKVCache
from decoding.runtime.runner import ModelRunner

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU kernel's shared reads")

EMPTY = torch.empty(0)


def _inputs(dtype: torch.dtype, head_dim: int, tokens: int, by_position: bool, seed: int = 0):
    """Six cache rows of 150 positions (not a multiple of the kernel's 64-position blocks): rows 0-2
    hold the same first 130, rows 3-4 the same first 40; queries of five of them, in another order."""
    g = torch.Generator().manual_seed(seed)
    rows, heads, kv_heads, length = 6, 4, 2, 150
    k = torch.randn(rows, kv_heads, length, head_dim, generator=g)
    v = torch.randn(rows, kv_heads, length, head_dim, generator=g)
    for group, n in (([0, 1, 2], 130), ([3, 4], 40)):
        k[group, :, :n] = k[group[0], :, :n]
        v[group, :, :n] = v[group[0], :, :n]
    if by_position:  # the RowKVCache's layout: positions contiguous
        k = k.transpose(2, 3).contiguous().transpose(2, 3)
    kv_rows = torch.tensor([2, 0, 3, 5, 4])
    q = torch.randn(len(kv_rows), heads, tokens, head_dim, generator=g)
    mask = torch.rand(len(kv_rows), 1, tokens, length, generator=g) < 0.8
    mask[..., 0] = True
    share = torch.tensor([[7, 130], [7, 130], [9, 40], [-1, 0], [9, 40]])
    return q.to(dtype), k.to(dtype), v.to(dtype), mask, kv_rows, share


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("by_position", [True, False])
def test_a_groups_shared_positions_are_read_once_with_each_querys_bits(dtype, head_dim, tokens, by_position):
    """With `share`, a group's shared positions are read from its first row alone (the others' may
    hold anything there, even NaN) and every output has the bits it has without sharing."""
    q, k, v, mask, kv_rows, share = _inputs(dtype, head_dim, tokens, by_position)
    attend = kernels.load().attend
    alone = attend(q, k, v, mask, kv_rows, 0.125, EMPTY, EMPTY, EMPTY, -1)
    # The first member of each group (in query order) is read for the shared part: row 2 for rows
    # {2, 0}, row 3 for {3, 4}; the others' shared positions are poisoned past the first block.
    k2, v2 = k.clone(), v.clone()
    for row, n in ((0, 130), (4, 40)):
        k2[row, :, 1:n] = float("nan")
        v2[row, :, 1:n] = float("nan")
    blocks = 128  # 130 rounds down to two blocks; 40 to none: rows 3 and 4 read their own
    k2[0, :, blocks:130], v2[0, :, blocks:130] = k[0, :, blocks:130], v[0, :, blocks:130]
    k2[4, :, 1:40], v2[4, :, 1:40] = k[4, :, 1:40], v[4, :, 1:40]
    shared = attend(q, k2, v2, mask, kv_rows, 0.125, EMPTY, share, EMPTY, -1)
    assert torch.equal(shared, alone)
    poisoned = attend(q, k2, v2, mask, kv_rows, 0.125, EMPTY, EMPTY, EMPTY, -1)
    assert poisoned[1].isnan().any()  # row 0 read alone sees its poison: the shared forward did not


def test_pad_queries_are_skipped_in_a_group_too():
    q, k, v, mask, kv_rows, share = _inputs(torch.bfloat16, 64, 4, True)
    live = torch.rand(len(kv_rows), 4, generator=torch.Generator().manual_seed(3)) < 0.6
    live[:, -1] = True
    attend = kernels.load().attend
    full = attend(q, k, v, mask, kv_rows, 0.125, EMPTY, EMPTY, EMPTY, -1)
    part = attend(q, k, v, mask, kv_rows, 0.125, live, share, EMPTY, -1)
    assert torch.equal(part[live], full[live])
    assert not part[~live].any()


def test_siblings_admitted_together_hold_one_prompts_blocks_until_a_write_copies_them(loaded):
    """Admission gives the samples of one prompt its blocks by reference (the forward reads them as a
    group); a row's first write into a block another holds takes a copy; a cleared row lets go."""
    runner = ModelRunner(loaded.model)
    assert runner.layers is not None and runner.pool is not None, "the tiny model runs paged on the project's layers"
    tok = loaded.tokenizer
    question = tok("a question that every sibling shares, long enough to be worth sharing " * 6)["input_ids"]
    prompts = [question + tok(" one")["input_ids"]] * 3 + [question + tok(" two more")["input_ids"]]
    cache = runner.new_cache(4, 256)
    runner.admit(cache, [0, 1, 2, 3], prompts, room=8)
    held = -(-(len(prompts[0]) - 1) // BLOCK)  # the blocks of the committed prompt
    assert torch.equal(cache.tables[:3, :held], cache.tables[:1, :held].expand(3, -1))
    whole = len(question) // BLOCK
    assert whole and torch.equal(cache.tables[0, :whole], cache.tables[3, :whole])  # the question's whole blocks
    assert cache.tables[0, whole] != cache.tables[3, whole]  # where the prompts part: each its own
    view = cache.prepare(1)
    assert view.share is not None and view.share[:, 0].unique().numel() == 1 and view.reads[1] > 0
    # The forward wrote each row's next slot: rows 0-2 each copied the block they shared (one kept it).
    last = (len(prompts[0]) - 1) // BLOCK
    assert cache.tables[:3, last].unique().numel() == 3
    assert torch.equal(cache.tables[0, :last], cache.tables[1, :last])
    used, own = runner.pool.used, int((cache.tables[1] != 0).sum()) - last
    cache.clear([1])
    assert runner.pool.used == used - own  # its own blocks went back, the shared ones are still held
    cache.clear([0, 2, 3])
    assert cache.prepare(1).share is None


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("decoder", ["ar", "seed_stand"])
def test_tokens_are_hfs_with_siblings_sharing_their_prompt(make_engine, decoder, temperature, monkeypatch):
    """ToT's shape: samples of one prompt and evaluations sharing a question, decoded in one batch on
    the shared reads, give `hf`'s tokens, greedy and sampled (each request its own seed, the project's
    sampler); and the forwards did read shared positions."""
    # Long enough for two of the kernel's 64-position blocks: the part a group reads once.
    question = "Q: what is the sum of the first few numbers we count with? Think step by step. " * 3
    prompts = [question + "Step 1:"] * 4 + [question + "Evaluate: sure", question + "Evaluate: maybe"]
    requests = [GenRequest(p, max_new_tokens=12, temperature=temperature, seed=i) for i, p in enumerate(prompts)]
    reference = [r.token_ids for r in make_engine("hf").generate(requests)]
    if temperature:  # the four samples of one prompt went four ways: the rows diverge past the prompt
        assert len({tuple(t) for t in reference[:4]}) > 1
    seen: list[bool] = []
    prepare = PagedKVCache.prepare

    def spy(cache: PagedKVCache, *args: object, **kwargs: object) -> ForwardView:
        view = prepare(cache, *args, **kwargs)
        seen.append(view.share is not None)
        return view

    monkeypatch.setattr(PagedKVCache, "prepare", spy)
    engine = make_engine(decoder)
    assert [r.token_ids for r in engine.generate(requests)] == reference
    assert any(seen)
    # The statistics say how much of the context came from a sibling's row: here most of it.
    stats = engine.last_stats
    assert 0.5 < stats.schedule.context_shared_fraction < 1 and stats.to_dict()["context_shared_fraction"] > 0.5
    engine.generate(requests[:1])
    assert engine.last_stats.schedule.context_positions > 0 == engine.last_stats.schedule.context_positions_shared


def test_a_forward_counts_each_groups_whole_shared_blocks_for_all_members_but_one():
    share = torch.tensor([[3, 200], [3, 130], [3, 150], [-1, 0], [5, 64], [5, 64], [8, 500]])
    # group 3: two members beyond the first read min(200, 130, 150) = 130 -> 128; group 5: one, 64;
    # group 8 alone reads its own
    assert shared_reads(share) == 2 * 128 + 64
