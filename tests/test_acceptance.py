"""Acceptance rules alone, against exact enumeration on small vocabularies."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import acceptance_chain, choose

from decoding.speculation.acceptance import residual, walk_matched
from decoding.speculation.draft_tree import ROOT, DraftTree, k_config_parents

V = 5


def dist(seed: int, zeros: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g, dtype=torch.float64) ** 3
    if zeros:
        p[torch.randperm(V, generator=g)[:zeros]] = 0.0
    return p / p.sum()


def draws(q: torch.Tensor, k: int, draw: str) -> list[tuple[tuple[int, ...], float]]:
    """Every candidate tuple a drafter can produce, with its probability."""
    out = []
    for cands in itertools.product(range(V), repeat=k):
        prob = 1.0
        if draw == "without_replacement":
            if len(set(cands)) < k:
                continue
            # Drawn one after another, each from q restricted to the tokens not drawn yet, and
            # uniformly among those once q's support is used up (Sequoia).
            for i, x in enumerate(cands):
                left = 1 - float(q[list(cands[:i])].sum())
                prob *= float(q[x]) / left if left > 1e-12 else 1 / (V - i)
        else:
            prob = float(torch.prod(q[list(cands)]))
        if prob > 0:
            out.append((cands, prob))
    return out


def output_distribution(p: torch.Tensor, q: torch.Tensor, k: int, draw: str, chain=acceptance_chain) -> torch.Tensor:
    """Exact distribution of the token a rule returns, summed over every draw of k candidates."""
    total = torch.zeros(V, dtype=torch.float64)
    cases = [((tuple(torch.topk(q, k).indices.tolist())), 1.0)] if draw == "top" else draws(q, k, draw)
    for cands, prob in cases:
        accept, r = chain(p, list(cands), q, draw)
        reach = 1.0
        for x, a in zip(cands, accept):
            total[x] += prob * reach * a
            reach *= 1 - a
        total += prob * reach * r
    return total


CASES = [(0, 1, 0, 0), (2, 3, 0, 0), (4, 5, 2, 0), (6, 7, 0, 2), (8, 9, 2, 2), (10, 10, 0, 0)]


@pytest.mark.parametrize("draw", ["iid", "without_replacement", "top"])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("p_seed, q_seed, p_zeros, q_zeros", CASES)
def test_rules_return_the_target_distribution(draw, k, p_seed, q_seed, p_zeros, q_zeros):
    """For every rule and number of candidates the returned token is distributed exactly as p,
    including targets with zeros (top-k / top-p) and drafts whose support misses target tokens."""
    p, q = dist(p_seed, p_zeros), dist(q_seed, q_zeros)
    out = output_distribution(p, q, k, draw)
    assert torch.allclose(out, p, atol=1e-12), (out, p)


def test_without_replacement_past_the_draft_support():
    """More candidates than q has tokens: Sequoia's uniform fallback keeps the rule exact."""
    p, q = dist(12, 1), dist(13, 3)
    assert torch.allclose(output_distribution(p, q, 4, "without_replacement"), p, atol=1e-12)


def test_enumeration_catches_a_wrong_rule():
    """The check above can fail: SpecInfer without the residual update after a rejection is biased."""

    def stale_residual(p, cands, q, draw):
        accept = [min(1.0, float(p[x] / q[x])) for x in cands]
        return accept, residual(p.double(), q.double())

    p, q = dist(2), dist(3)
    assert not torch.allclose(output_distribution(p, q, 2, "iid", stale_residual), p, atol=1e-3)


def test_single_candidate_accepts_with_one_minus_total_variation():
    """Optimal transport property (Sequoia, 3.2.2): with one candidate, P(accept) = 1 - TV(p, q)."""
    p, q = dist(0), dist(1)
    accept = sum(float(q[x]) * acceptance_chain(p, [x], q, "iid")[0][0] for x in range(V))
    assert accept == pytest.approx(1 - 0.5 * float((p - q).abs().sum()))


def test_without_replacement_covers_the_support():
    """Cover property: when the k candidates hold all of q's support and q's support covers p's,
    Sequoia's rule always accepts one of them; SpecInfer (iid) does not."""
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.1, 0.8, 0.0, 0.0], dtype=torch.float64)
    for cands, _ in draws(q, 3, "without_replacement"):
        accept, _ = acceptance_chain(p, list(cands), q, "without_replacement")
        assert 1 - torch.prod(1 - torch.tensor(accept)) == pytest.approx(1.0)
    reject_all = sum(
        prob * float(torch.prod(1 - torch.tensor(acceptance_chain(p, list(c), q, "iid")[0])))
        for c, prob in draws(q, 3, "iid")
    )
    assert reject_all > 0.05


def test_choose_samples_the_exact_distribution():
    """The sampler that drives decoding agrees with the exact chain (Monte Carlo, 20,000 runs,
    tolerance 0.02 in total variation; its standard error here is about 0.006)."""
    p, q = dist(4, 1), dist(5)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, dtype=torch.float64)
    n = 20_000
    for _ in range(n):
        cands = torch.multinomial(q.float(), 2, replacement=True, generator=g).tolist()
        _, token = choose(p, cands, q, "iid", g)
        counts[token] += 1
    assert 0.5 * float((counts / n - p).abs().sum()) < 0.02


def test_walk_greedy_follows_the_argmax_path():
    tree = DraftTree()
    for parent, token in zip(k_config_parents((2, 2)), [7, 3, 1, 4, 4, 9]):
        tree.add(token, parent)
    # Root's argmax is 3 (node 1), whose argmax is 9 (node 5), whose argmax is 2: bonus token.
    argmax = [3, 0, 9, 0, 0, 0, 2]
    path, token = walk_matched(tree, lambda node, d: argmax[node + 1])
    assert path == [1, 5] and token == 2
    path, token = walk_matched(tree, lambda node, d: [5, *argmax[1:]][node + 1])
    assert path == [] and token == 5
    assert tree.path(5) == [1, 5] and tree.depths() == [1, 1, 2, 2, 2, 2]
    assert tree.children(ROOT) == [0, 1]


def test_tree_ancestry():
    tree = DraftTree()
    for parent in k_config_parents((2, 1)):
        tree.add(0, parent)
    assert k_config_parents((2, 1)) == [ROOT, ROOT, 0, 1]
    see = tree.ancestry()
    assert see.tolist() == [
        [True, False, False, False],
        [False, True, False, False],
        [True, False, True, False],
        [False, True, False, True],
    ]


@pytest.mark.parametrize("k_config, size", [((1, 1, 1), 3), ((2, 2, 1), 10), ((4, 2, 1), 20)])
def test_k_config_sizes(k_config, size):
    assert len(k_config_parents(k_config)) == size


def test_k_config_rejects_bad_values():
    with pytest.raises(ValueError, match="positive"):
        k_config_parents((2, 0))


def test_grafted_sources_are_exact():
    """Children from two drafters at one node (a model's iid draw and an N-gram's draws without
    replacement), each with its own proposal: the rule still returns exactly p."""
    from decoding.speculation.acceptance import chain, node_proposals
    from decoding.speculation.draft_tree import graft

    p, q0, q1 = dist(20, 1), dist(21), dist(22, 2)
    total = torch.zeros(V, dtype=torch.float64)
    for (x,), px in draws(q0, 1, "iid"):
        for ys, py in draws(q1, 2, "without_replacement"):
            a = DraftTree(draw="iid", dists={ROOT: q0})
            a.add(x, ROOT)
            b = DraftTree(draw="without_replacement", dists={ROOT: (list(range(V)), q1.tolist())})
            for y in ys:
                b.add(y, ROOT)
            merged, where = graft([a, b])
            assert where == [[0], [1, 2]] and merged.sources == [0, 1, 1]
            kids = merged.children(ROOT)
            accept, r = chain(p, [merged.tokens[c] for c in kids], node_proposals(merged, ROOT, kids, V))
            reach = px * py
            for c, acc in zip(kids, accept):
                total[merged.tokens[c]] += reach * acc
                reach *= 1 - acc
            total += reach * r
    assert torch.allclose(total, p, atol=1e-12)


def test_graft_merges_duplicates_for_the_matched_rules():
    """merge=True: a token two drafters put at the same place is one node (verified once), and each
    drafter's nodes map into the trie; the rejection rules' graft keeps both."""
    from decoding.speculation.draft_tree import graft

    a, b = DraftTree(), DraftTree()
    for tree, spec in ((a, [(5, ROOT), (6, 0), (7, ROOT)]), (b, [(5, ROOT), (9, 0), (6, 0), (8, ROOT)])):
        for token, parent in spec:
            tree.add(token, parent)
    merged, where = graft([a, b], merge=True)
    assert merged.tokens == [5, 6, 7, 9, 8] and merged.parents == [ROOT, 0, ROOT, 0, ROOT]
    assert where == [[0, 1, 2], [0, 3, 1, 4]]
    assert merged.sources == [0, 0, 0, 1, 1]
    assert len(graft([a, b])[0]) == 7
