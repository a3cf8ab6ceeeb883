"""The default forward is batch- and tree-invariant, bitwise: a token's logits are the same scored
alone one at a time, as a chunk, beside 7 other rows of other lengths, inside a 16-node draft tree,
and when a subset of the cache's rows is verified in place. Checked for the bfloat16 default of a
checkpoint and for the GGUF int4 paths (float and int8 activations) (tests/test_quant.py builds its tiny int4 model)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from test_quant import int4_copy

from decoding.runtime import kernels
from decoding.runtime.runner import ModelRunner
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.verify import pack

PROMPT = [5 + (7 * i) % 90 for i in range(21)]
CONTINUATION = [11, 42, 17, 63, 8, 29]  # the pending token, then 5 tokens scored after it


@pytest.fixture(scope="module", params=["bfloat16", "gguf-int4", "gguf-int4-int8"])
def runner(request, tiny_model) -> ModelRunner:
    if request.param == "bfloat16":
        return ModelRunner(tiny_model)
    return ModelRunner(int4_copy(tiny_model, "int8" if request.param.endswith("int8") else "float"))


def _run(runner: ModelRunner, prompts: list[list[int]], steps) -> list[torch.Tensor]:
    """Prefill ragged prompts in one forward, then call steps(cache) -> list of logits."""
    cache = runner.new_cache(len(prompts), 128)
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    causal = torch.ones(width, width, dtype=torch.bool).tril().expand(len(prompts), -1, -1)
    runner.forward(cache, tokens, causal, torch.arange(width).expand(len(prompts), -1))
    cache.advance(torch.tensor([len(p) for p in prompts]))
    return steps(cache)


def _one_at_a_time(runner, cache, row_tokens: list[list[int]], rows: list[int] | None = None) -> list[torch.Tensor]:
    """Feed each row's tokens one per forward; logits [B, V] per step."""
    out = []
    one = torch.ones(len(row_tokens), 1, 1, dtype=torch.bool)
    for step in range(len(row_tokens[0])):
        tokens = torch.tensor([[t[step]] for t in row_tokens])
        depth = torch.zeros(len(row_tokens), 1, dtype=torch.long)
        out.append(runner.forward(cache, tokens, one, depth, rows=rows).logits[:, 0])
        advance = torch.zeros(cache.batch, dtype=torch.long)
        advance[rows if rows is not None else slice(None)] = 1
        cache.advance(advance)
    return out


def reference(runner: ModelRunner) -> torch.Tensor:
    """The continuation scored alone, one token per forward: [len(CONTINUATION), V]."""
    return torch.stack(_run(runner, [PROMPT], lambda c: [x[0] for x in _one_at_a_time(runner, c, [CONTINUATION])]))


def test_a_chunk_equals_one_token_at_a_time(runner):
    def chunk(cache):
        n = len(CONTINUATION)
        causal = torch.ones(1, n, n, dtype=torch.bool).tril()
        return list(runner.forward(cache, torch.tensor([CONTINUATION]), causal, torch.arange(n)[None]).logits[0])

    assert torch.equal(torch.stack(_run(runner, [PROMPT], chunk)), reference(runner))


def test_beside_seven_rows_of_other_lengths(runner):
    g = torch.Generator().manual_seed(1)
    others = [torch.randint(3, 100, (int(n),), generator=g).tolist() for n in (3, 40, 9, 1, 33, 17, 26)]
    prompts = [*others[:3], PROMPT, *others[3:]]
    conts = [torch.randint(3, 100, (len(CONTINUATION),), generator=g).tolist() for _ in prompts]
    conts[3] = CONTINUATION
    got = _run(runner, prompts, lambda c: [x[3] for x in _one_at_a_time(runner, c, conts)])
    assert torch.equal(torch.stack(got), reference(runner))


def test_verifying_some_rows_in_place(runner):
    """Rows 3 and 5 of 8 verified alone (SEED's verifier): the cache rows are read where they lie."""
    prompts = [PROMPT[: 5 + i] for i in range(8)]
    prompts[3] = PROMPT
    conts = [CONTINUATION, list(reversed(CONTINUATION))]
    got = _run(runner, prompts, lambda c: [x[0] for x in _one_at_a_time(runner, c, conts, rows=[3, 5])])
    assert torch.equal(torch.stack(got), reference(runner))


def test_inside_a_sixteen_node_tree(runner):
    """The continuation is one path of a 16-node tree whose levels interleave it with siblings."""
    tree = DraftTree()
    parent, path = ROOT, []
    g = torch.Generator().manual_seed(2)
    for token in CONTINUATION[1:]:
        for _ in range(2):  # siblings before the path's node, so its slots are not consecutive
            tree.add(int(torch.randint(3, 100, (1,), generator=g)), parent)
        parent = tree.add(token, parent)
        path.append(parent)
    while len(tree) < 16:
        tree.add(int(torch.randint(3, 100, (1,), generator=g)), path[len(tree) % len(path)])
    # Nodes must be listed parents-first, which `add` keeps; the tree has 16 nodes plus the root.
    packed = pack([[CONTINUATION[0]]], [tree])

    def in_tree(cache):
        logits = runner.forward(cache, packed.tokens, packed.see, packed.depth).logits[0]
        return [logits[packed.n_pending - 1]] + [logits[packed.n_pending + i] for i in path]

    assert len(tree) == 16
    assert torch.equal(torch.stack(_run(runner, [PROMPT], in_tree)), reference(runner))


def test_attention_skips_the_queries_no_one_reads():
    """A ragged forward's pads are never read: the kernel skips their queries (zeros), and every other
    query's output has the bits it has when all are computed (each query is its own computation)."""
    from decoding.runtime import kernels

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 4, 64, generator=g).to(torch.bfloat16)  # 3 rows, 6 heads over 2 kv heads, 4 slots
    k = torch.randn(3, 2, 40, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(3, 2, 40, 64, generator=g).to(torch.bfloat16)
    empty = torch.empty(0)
    full = kernels.load().attend(q, k, v, empty, empty, 0.125, empty, empty, empty, -1)
    live = torch.tensor([[True, True, True, True], [True, False, False, False], [True, True, False, True]])
    part = kernels.load().attend(q, k, v, empty, empty, 0.125, live, empty, empty, -1)
    assert torch.equal(part[live], full[live])
    assert not part[~live].any() and full[~live].abs().sum() > 0


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 9])
def test_a_hidden_positions_values_add_nothing_whatever_they_hold(tokens):
    """Queries run up to four a pass, sharing each value load: a position hidden from a query (a pad
    slot, another branch of the tree) may hold anything, even inf and NaN, and that query's output has
    the bits it has when the position holds zeros, whether the others in its pass see it or not; and
    each query's output is the one it has alone."""
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(2, 8, tokens, 64, generator=g).to(torch.bfloat16)  # 8 query heads over 2 kv heads
    k = torch.randn(2, 2, 48, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 2, 48, 64, generator=g).to(torch.bfloat16)
    mask = torch.rand(2, 1, tokens, 48, generator=g) < 0.7
    mask[..., 0] = True
    mask[..., 20:26] = False  # hidden from every query
    mask[:, :, 0::2, 30:34] = False  # hidden from the even tokens, seen by the odd ones
    mask[:, :, 1::2, 30:34] = True
    empty = torch.empty(0)
    clean = v.clone()
    clean[:, :, 20:26] = 0
    clean[:, :, 30:34] = 0
    garbage = v.clone()
    garbage[:, :, 20:23] = float("inf")
    garbage[:, :, 23:26] = float("nan")
    garbage[:, :, 30:32] = float("inf")
    garbage[:, :, 32:34] = float("nan")
    attend = kernels.load().attend
    reference = attend(q, k, clean, mask, empty, 0.125, empty, empty, empty, -1)  # [B, T, H, D]
    assert torch.isfinite(reference.float()).all()
    out = attend(q, k, garbage, mask, empty, 0.125, empty, empty, empty, -1)
    assert torch.equal(out[:, 0::2], reference[:, 0::2])
    if tokens > 1:
        assert not torch.isfinite(out[:, 1::2].float()).any()  # a seen position's garbage is read
    for t in range(tokens):  # each query alone: the same bits as in its pass
        alone = attend(q[:, :, t : t + 1], k, clean, mask[:, :, t : t + 1], empty, 0.125, empty, empty, empty, -1)
        assert torch.equal(alone[:, 0], reference[:, t])


def test_long_rows_read_in_spans_or_blocks_give_the_same_bits():
    """A task of few queries widens position-contiguous keys a span of up to 512 positions at a time,
    one of many queries a block of 64 at a time, and keys stored [L, D] are transposed as they are
    read: over 1,100 positions (two whole spans and a part) a query has the same bits each way, and
    its output is attention's to float rounding."""
    g = torch.Generator().manual_seed(3)
    L, tokens = 1100, 6
    q = torch.randn(1, 4, tokens, 64, generator=g).to(torch.bfloat16)  # 4 query heads over 1 kv head
    by_dim = torch.randn(1, 1, L, 64, generator=g).to(torch.bfloat16)
    by_pos = by_dim.transpose(2, 3).contiguous().transpose(2, 3)  # stored [D, L], as the RowKVCache
    v = torch.randn(1, 1, L, 64, generator=g).to(torch.bfloat16)
    mask = torch.rand(1, 1, tokens, L, generator=g) < 0.8
    mask[..., 0] = True
    empty = torch.empty(0)
    attend = kernels.load().attend
    together = attend(q, by_pos, v, mask, empty, 0.125, empty, empty, empty, -1)  # 24 queries: blocks
    assert torch.equal(attend(q, by_dim, v, mask, empty, 0.125, empty, empty, empty, -1), together)
    for t in range(tokens):  # 4 queries: spans
        alone = attend(q[:, :, t : t + 1], by_pos, v, mask[:, :, t : t + 1], empty, 0.125, empty, empty, empty, -1)
        assert torch.equal(alone[:, 0], together[:, t])
    scores = (q.float() @ by_dim.float().transpose(2, 3)) * 0.125
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    expected = (weights @ v.float()).transpose(1, 2)  # [B, T, H, D]
    torch.testing.assert_close(together.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_killed_builds_lock_is_cleared(tmp_path):
    """A build stopped mid-way leaves torch's lock file, and every later start would wait on it
    forever: an old one is removed, a fresh one (a build under way) is left."""
    lock = tmp_path / "lock"
    lock.write_text("")
    assert not kernels.clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert kernels.clear_stale_lock(tmp_path) and not lock.exists()
    assert not kernels.clear_stale_lock(tmp_path)
