"""RowKVCache + ModelRunner.forward against plain full forwards of the model (no cache).

Every check compares the logits a cached, batched, ragged or tree-shaped forward gives a token with
the logits of one plain `model(input_ids)` call over that token's whole sequence (prompt, committed
tokens, and the token's root-to-node path in a tree).
"""

from __future__ import annotations

import pytest
import torch
from helpers import prefill, select_rows

from decoding.runtime.kv_cache import RowKVCache, cache_geometry
from decoding.runtime.runner import ModelRunner

ATOL = 1e-4
RTOL = 1e-4

# Ragged prompts of token ids (ids >= 3 are ordinary tokens of the tiny tokenizer).
PROMPTS = [
    [10, 45, 88, 120, 7],
    [200, 33, 33, 17, 250, 91, 64, 12, 150],
    [77, 5],
]


@pytest.fixture()
def target(tiny_model) -> ModelRunner:
    return ModelRunner(tiny_model)


def plain_logits(model, seq: list[int]) -> torch.Tensor:
    """Logits [T, V] of one uncached forward over the whole sequence."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([seq], device=model.device)).logits[0]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL, rtol=RTOL)


def chain(n_rows: int, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree and depth arguments for n_new causally chained new tokens per row."""
    tree = torch.ones(n_new, n_new, dtype=torch.bool).tril().expand(n_rows, -1, -1)
    depth = torch.arange(n_new).expand(n_rows, -1)
    return tree, depth


def tree_from_parents(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Visibility [T, T] (a node sees itself and its ancestors) and depth [T] of a tree given as parent indices."""
    n = len(parents)
    vis = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for t in range(n):
        node, d = t, 0
        while node >= 0:
            vis[t, node] = True
            node = parents[node]
            d += 1
        depth[t] = d - 1
    return vis, depth


def path(parents: list[int], t: int) -> list[int]:
    """Indices from the root to node t."""
    out = []
    while t >= 0:
        out.append(t)
        t = parents[t]
    return out[::-1]


def step(target: ModelRunner, cache: RowKVCache, tokens: list[int]) -> torch.Tensor:
    """One plain decoding step (one new token per row), committed; returns logits [B, V]."""
    n = len(tokens)
    tree, depth = chain(n, 1)
    logits = target.forward(cache, torch.tensor(tokens)[:, None], tree, depth).logits[:, 0]
    cache.advance(torch.ones(n, dtype=torch.long))
    return logits


def test_prefill_and_steps_match_plain_forward(tiny_model, target):
    cache, logits = prefill(target, PROMPTS, capacity=32)
    assert cache.lens.tolist() == [len(p) for p in PROMPTS]
    seqs = [list(p) for p in PROMPTS]
    for b, s in enumerate(seqs):
        assert_close(logits[b], plain_logits(tiny_model, s)[-1])
    for k in range(5):
        tokens = [3 + (37 * b + 11 * k + 5) % 270 for b in range(len(seqs))]
        logits = step(target, cache, tokens)
        for b, (s, t) in enumerate(zip(seqs, tokens)):
            s.append(t)
            assert_close(logits[b], plain_logits(tiny_model, s)[-1])
    assert cache.lens.tolist() == [len(s) for s in seqs]


def test_ragged_forward_gives_every_real_position_its_plain_logits(tiny_model, target):
    """A padded ragged forward without logits_at: every real (non-pad) position matches."""
    width = max(len(p) for p in PROMPTS)
    tokens = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for b, p in enumerate(PROMPTS):
        tokens[b, : len(p)] = torch.tensor(p)
    cache = target.new_cache(len(PROMPTS), 16)
    tree, depth = chain(len(PROMPTS), width)
    logits = target.forward(cache, tokens, tree, depth).logits
    assert logits.shape[:2] == (len(PROMPTS), width)
    for b, p in enumerate(PROMPTS):
        assert_close(logits[b, : len(p)], plain_logits(tiny_model, p))


def test_tree_forward_matches_plain_forward_of_each_path(tiny_model, target):
    cache, _ = prefill(target, PROMPTS[:2], capacity=32)
    # Row 0: x with two children y1, y2, and z under y2. Row 1: x, y under x, z under y, w a sibling of y.
    parents = [[-1, 0, 0, 2], [-1, 0, 1, 0]]
    tokens = torch.tensor([[40, 41, 42, 43], [140, 141, 142, 143]])
    trees, depths = zip(*(tree_from_parents(p) for p in parents))
    logits = target.forward(cache, tokens, torch.stack(trees), torch.stack(depths)).logits
    for b, par in enumerate(parents):
        for t in range(len(par)):
            seq = PROMPTS[b] + tokens[b, path(par, t)].tolist()
            assert_close(logits[b, t], plain_logits(tiny_model, seq)[-1])
    # A forward writes but does not commit.
    assert cache.lens.tolist() == [len(p) for p in PROMPTS[:2]]


def test_tree_forward_logits_at_subset(tiny_model, target):
    cache, _ = prefill(target, PROMPTS[:2], capacity=32)
    parents = [-1, 0, 0, 1]
    tree, depth = tree_from_parents(parents)
    tokens = torch.tensor([[50, 51, 52, 53], [60, 61, 62, 63]])
    logits = target.forward(
        cache, tokens, tree.expand(2, -1, -1), depth.expand(2, -1), logits_at=torch.tensor([2, 3])
    ).logits
    assert logits.shape[:2] == (2, 2)
    for b in range(2):
        for j, t in enumerate([2, 3]):
            seq = PROMPTS[b] + tokens[b, path(parents, t)].tolist()
            assert_close(logits[b, j], plain_logits(tiny_model, seq)[-1])


def test_keep_accepted_path_then_continue(tiny_model, target):
    cache, _ = prefill(target, PROMPTS, capacity=32)
    parents = [[-1, 0, 0, 2], [-1, 0, 1, 0], [-1, 0, 0, 1]]
    tokens = torch.tensor([[40, 41, 42, 43], [140, 141, 142, 143], [240, 241, 242, 243]])
    trees, depths = zip(*(tree_from_parents(p) for p in parents))
    target.forward(cache, tokens, torch.stack(trees), torch.stack(depths))
    # Accepted paths: row 0 x -> y2 -> z (moves two entries), row 1 x -> w (moves one past a
    # rejected sibling), row 2 x -> y1 -> grandchild (already contiguous).
    accepted = [[0, 2, 3], [0, 3], [0, 1, 3]]
    committed = []
    for b, idx in enumerate(accepted):
        cache.commit(b, idx)
        committed.append(PROMPTS[b] + tokens[b, idx].tolist())
    assert cache.lens.tolist() == [len(s) for s in committed]
    # The rejected entries still lie past each row's length; continuing must not see them.
    for k in range(3):
        nxt = [7 + 13 * b + 3 * k for b in range(3)]
        logits = step(target, cache, nxt)
        for b in range(3):
            committed[b].append(nxt[b])
            assert_close(logits[b], plain_logits(tiny_model, committed[b])[-1])


def test_keep_then_second_tree(tiny_model, target):
    """Two rounds of tree verification: the second tree is written over the first one's rejected slots."""
    cache, _ = prefill(target, PROMPTS[:2], capacity=32)
    parents = [-1, 0, 0, 1, 2]
    tree, depth = tree_from_parents(parents)
    trees, depths = tree.expand(2, -1, -1), depth.expand(2, -1)
    committed = [list(p) for p in PROMPTS[:2]]
    for rnd, accepted in enumerate(([[0, 2, 4], [0, 1]], [[0], [0, 2]])):
        tokens = torch.tensor([[20 + 10 * rnd + i for i in range(5)], [120 + 10 * rnd + i for i in range(5)]])
        logits = target.forward(cache, tokens, trees, depths).logits
        for b in range(2):
            for t in range(len(parents)):
                seq = committed[b] + tokens[b, path(parents, t)].tolist()
                assert_close(logits[b, t], plain_logits(tiny_model, seq)[-1])
            cache.commit(b, accepted[b])
            committed[b] += tokens[b, accepted[b]].tolist()
    assert cache.lens.tolist() == [len(s) for s in committed]


def test_select_rows_drops_and_repeats_rows(tiny_model, target):
    cache, _ = prefill(target, PROMPTS, capacity=32)
    seqs = [list(p) for p in PROMPTS]
    first = [11, 22, 33]
    step(target, cache, first)
    for s, t in zip(seqs, first):
        s.append(t)
    # Drop row 1, put row 2 first, repeat row 0.
    index = [2, 0, 0]
    select_rows(cache, torch.tensor(index))
    assert cache.batch == 3
    assert cache.lens.tolist() == [len(seqs[i]) for i in index]
    rows = [list(seqs[i]) for i in index]
    for k in range(3):
        nxt = [50 + k, 60 + k, 70 + k]  # the two copies of row 0 diverge
        logits = step(target, cache, nxt)
        for b in range(3):
            rows[b].append(nxt[b])
            assert_close(logits[b], plain_logits(tiny_model, rows[b])[-1])


def test_prefill_computes_distinct_prompts_once_and_fans_out(tiny_model, target):
    a, b, c = PROMPTS
    prompts = [a, b, a, a, c, b]
    shapes = []

    def spy(module, args):  # the token embedding: every forward path starts there
        shapes.append(tuple(args[0].shape))

    handle = tiny_model.get_input_embeddings().register_forward_pre_hook(spy)
    try:
        cache, logits = prefill(target, prompts, capacity=24)
    finally:
        handle.remove()
    assert target.forwards == 1
    assert shapes == [(3, len(b))], "only the three distinct prompts should be computed"
    assert cache.batch == len(prompts)
    assert cache.lens.tolist() == [len(p) for p in prompts]

    # Same as prefilling each prompt on its own: logits and the cached keys/values.
    for row, p in enumerate(prompts):
        alone, alone_logits = prefill(ModelRunner(tiny_model), [p], capacity=24)
        assert_close(logits[row], alone_logits[0])
        for layer in range(len(cache)):
            got, want = cache.read(row, 0, len(p)), alone.read(0, 0, len(p))
            assert_close(got[0][layer], want[0][layer])
            assert_close(got[1][layer], want[1][layer])

    # The fanned-out rows are independent afterwards.
    nxt = [3 + 17 * i for i in range(len(prompts))]
    out = step(target, cache, nxt)
    for row, p in enumerate(prompts):
        assert_close(out[row], plain_logits(tiny_model, [*p, nxt[row]])[-1])


def test_prefill_all_identical_prompts(tiny_model, target):
    prompts = [PROMPTS[1]] * 4
    cache, logits = prefill(target, prompts, capacity=16)
    assert cache.batch == 4
    expected = plain_logits(tiny_model, PROMPTS[1])[-1]
    for row in range(4):
        assert_close(logits[row], expected)


def test_prefill_keeps_order_of_distinct_prompts(tiny_model, target):
    """Distinct prompts that share a last index (equal lengths) each get their own logits, in order."""
    prompts = [[9, 8, 7, 6], [6, 7, 8, 9], [5, 5], [9, 8, 7, 6, 5]]
    _, logits = prefill(target, prompts, capacity=16)
    for row, p in enumerate(prompts):
        assert_close(logits[row], plain_logits(tiny_model, p)[-1])


def test_capacity_overflow_raises(target):
    cache = target.new_cache(2, 4)
    room = cache.capacity  # (a paged cache's rows hold whole blocks)
    cache.advance(torch.tensor([room - 1, 1]))
    cache.prepare(1)  # room - 1 + 1 fits
    with pytest.raises(RuntimeError, match=f"holds {room} positions"):
        cache.prepare(2)


def test_cache_geometry(tiny_model):
    assert cache_geometry(tiny_model.config) == (2, 2, 16)


@pytest.mark.parametrize("by_position", [False, True])
def test_give_back_keeps_what_fits_and_only_far_past_need(by_position):
    """A pool shrinks only once it holds more than `slack` times what is asked (so a pool swinging
    between wide and narrow steps is not copied each time), and then keeps the kept rows' entries."""
    cache = RowKVCache(2, 8, 2, 4, 32, torch.float32, "cpu", keys_by_position=by_position)
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape))
    cache.advance(torch.tensor([5, 3, 0, 0, 0, 0, 0, 0]))
    before = [t[:2, :, :10].clone() for t in cache.keys + cache.values]
    assert not cache.give_back(4, 16)  # a quarter of the pool: within the slack of 4
    assert cache.give_back(2, 10)
    assert (cache.batch, cache.capacity) == (2, 10)
    assert cache.lens.tolist() == [5, 3]
    assert all(torch.equal(t, b) for t, b in zip(cache.keys + cache.values, before))
    assert (cache.keys[0].stride(2) == 1) == by_position  # the layout the attention reads stays
    cache.reserve(3, 12)  # and it grows again as before
    assert (cache.batch, cache.capacity, cache.lens.tolist()) == (3, 12, [5, 3, 0])
