"""The Gumbel-max sampler with public noise (decoding/speculation/gumbel.py): exact, reproducible, independent.

Statistical checks are seeded (fixed outcomes) and use Pearson's chi-square with the Wilson-Hilferty
normal approximation: a statistic more than 4 standard deviations above its mean (p < 3e-5) fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from decoding.runtime import kernels
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.gumbel import (
    G_MAX,
    G_MIN,
    Coupling,
    _gumbel_py,
    _noisy_top,
    _pick_np,
    gumbel_choice,
    gumbel_noise,
    gumbel_order,
    gumbel_pick,
    gumbel_pick_rows,
    key,
)
from decoding.speculation.row_sampling import RowSampling
from decoding.speculation.sampling import SamplingParams, process_logits, processed_logits
from decoding.speculation.sequence import Sequence
from decoding.speculation.stopping import StopRule
from decoding.speculation.verify import device_targets, processed_rows, target_sampler

N = 20_000


def chi_square_z(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """How many standard deviations Pearson's statistic lies above its mean: bins with an expected
    count under 5 are pooled into one."""
    expected = probs.double() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def logits_of(seed: int, vocab: int = 64) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def sample_counts(logits: torch.Tensor, p: SamplingParams, n: int = N) -> torch.Tensor:
    """n samples at one position, one request seed each (seeds are what makes draws independent)."""
    counts = torch.zeros(logits.shape[0])
    for seed in range(n):
        counts[gumbel_choice(logits, p, seed, 11)] += 1
    return counts


@pytest.mark.parametrize("p", [SamplingParams(0.7, 20, 0.9), SamplingParams(1.3)], ids=["t0.7-k20-p0.9", "t1.3"])
def test_samples_follow_the_processed_distribution(p):
    logits = logits_of(0)
    counts = sample_counts(logits, p)
    probs = process_logits(logits[None], [p])[0]
    assert chi_square_z(counts, probs) < 4
    assert counts[probs == 0].sum() == 0  # nothing outside top-k / top-p


def test_the_check_catches_a_wrong_temperature():
    """The same test fails when the samples come from another temperature: it can fail."""
    logits = logits_of(0)
    counts = sample_counts(logits, SamplingParams(1.0))
    assert chi_square_z(counts, process_logits(logits[None], [SamplingParams(1.0)])[0]) < 4
    assert chi_square_z(counts, process_logits(logits[None], [SamplingParams(1.2)])[0]) > 10


def test_pruning_is_exact():
    """Only tokens near the top get their noise computed: the choice is still the argmax over all, on
    the CPU's numpy path and the device path alike, and a coupled drafter's top k are the true top k."""
    for seed in range(300):
        logits = 4.0 * logits_of(seed, 2000)
        p = SamplingParams([0.1, 0.6, 0.9, 1.2, 1.5][seed % 5], [0, 50][seed % 2], [1.0, 0.95][seed % 3 == 0])
        scores = processed_logits(logits, p)
        full = scores.double() + gumbel_noise(seed, seed * 7, torch.arange(2000))
        assert gumbel_choice(logits, p, seed, seed * 7) == int(full.argmax())
        assert int(_noisy_top(scores.double(), seed, seed * 7, 1)[0]) == int(full.argmax())
        q = scores.softmax(-1)
        k = min(5, int((q > 0).sum()))
        noisy = q.double().log() + gumbel_noise(seed, seed * 7 + 2, torch.arange(2000))
        assert Coupling(seed, seed * 7).top(q, 5, 2) == noisy.topk(k).indices.tolist()


@pytest.mark.parametrize("vocab", [1, 282, 2000, 49_159])
def test_the_kernels_pass_picks_the_full_argmax(vocab):
    """csrc/gumbel.cpp computes the noise of only the tokens its bounds cannot rule out: its pick is
    still the argmax over every token's score + noise, as numpy's pass and torch's, over peaked, flat
    and masked rows (a width not a multiple of its blocks of 64 and lanes of 8 included)."""
    kernels.load()
    rows, keys, expected = [], [], []
    for seed in range(60):
        base = logits_of(seed, vocab)
        scores = [4.0 * base / 0.7, 0.01 * base, base.masked_fill(base < base.median(), float("-inf"))][seed % 3]
        position = seed * 13 + 1
        full = scores.double() + gumbel_noise(seed, position, torch.arange(vocab))
        assert gumbel_pick(scores.float(), seed, position) == int(full.argmax())
        assert _pick_np(scores.float(), key(seed, position)) == int(full.argmax())
        rows.append(scores.float())
        keys.append(key(seed, position))
        expected.append(int(full.argmax()))
    assert gumbel_pick_rows(rows, keys) == expected  # the rows of a step, drawn on the machine's threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("built", [True, False])
def test_raw_rows_are_drawn_as_their_processed_logits(dtype, built, monkeypatch):
    """A row whose processing is its temperature alone is drawn from its raw logits (the kernel divides
    them in its pass, as `processed_logits` does in float32): the argmax of the processed row's scores +
    noise, with the kernels and without them."""
    if built:
        kernels.load()
    else:
        monkeypatch.setattr(kernels, "built", lambda: None)
    rows, keys, temperatures, expected = [], [], [], []
    for seed in range(24):
        raw = (logits_of(seed, 4_099) * [0.3, 3.0, 30.0][seed % 3]).to(dtype)
        t = [0.6, 1.0, 1.7, 0.123][seed % 4]
        position = 7 * seed
        scores = processed_logits(raw.float(), SamplingParams(t))
        expected.append(int((scores.double() + gumbel_noise(seed, position, torch.arange(len(raw)))).argmax()))
        rows.append(raw)
        keys.append(key(seed, position))
        temperatures.append(t)
    assert gumbel_pick_rows(rows, keys, temperatures) == expected


def test_noise_is_a_function_of_seed_position_and_token():
    ids = torch.arange(1000)
    full = gumbel_noise(5, 9, ids)
    assert torch.equal(gumbel_noise(5, 9, ids[[3, 500, 2]]), full[[3, 500, 2]])  # any subset, any order
    assert torch.equal(gumbel_noise(5, 9, ids.reshape(10, 100)), full.reshape(10, 100))
    assert float(full.min()) > G_MIN and float(full.max()) < G_MAX
    # Public noise: fixed bits for a fixed (seed, position, token), run after run and release after release.
    # A change to the hash changes every sampled run: these are the values it has always given.
    assert gumbel_noise(0, 0, torch.tensor([0, 1, 49151])).tolist() == pytest.approx(
        [-0.3250704182868967, -0.14567400333701677, -0.10734394228785013], abs=1e-15
    )
    assert gumbel_noise(2**40 + 3, 1000, torch.tensor([7])).item() == pytest.approx(-1.7288917237117252, abs=1e-15)
    # A drafter's few candidates take the plain-Python path: the same noise.
    some = [0, 1, 49151, 3, 500]
    assert _gumbel_py(0, 0, some) == pytest.approx(gumbel_noise(0, 0, torch.tensor(some)).tolist(), abs=1e-15)
    assert _gumbel_py(2**40 + 3, 1000, [7]) == pytest.approx([-1.7288917237117252], abs=1e-15)
    # Standard Gumbel: mean Euler's gamma, variance pi^2 / 6 (n = 100k: sd of the mean 0.004).
    g = gumbel_noise(1, 2, torch.arange(100_000))
    assert abs(float(g.mean()) - 0.5772) < 0.02 and abs(float(g.var()) - math.pi**2 / 6) < 0.05


@pytest.mark.parametrize("neighbour", [(1, 0), (0, 1), (1, 1)], ids=["seed+1", "position+1", "both+1"])
def test_neighbouring_seeds_and_positions_are_independent(neighbour):
    ids = torch.arange(49_152)
    ds, dp = neighbour
    for seed, pos in [(0, 0), (123, 456), (2**40, 7)]:
        a, b = gumbel_noise(seed, pos, ids), gumbel_noise(seed + ds, pos + dp, ids)
        r = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
        assert abs(r) < 0.02  # 4.4 standard deviations at n = 49k
    # And the tokens sampled there: a contingency table of neighbouring draws is the product of its margins.
    logits = torch.tensor([0.0, 0.3, -0.2, 0.5])
    p = SamplingParams(1.0)
    table = torch.zeros(4, 4)
    for seed in range(8000):
        x = gumbel_choice(logits, p, seed, 3)
        y = gumbel_choice(logits, p, seed + ds, 3 + dp)
        table[x, y] += 1
    rows, cols = table.sum(1) / table.sum(), table.sum(0) / table.sum()
    assert chi_square_z(table.flatten(), torch.outer(rows, cols).flatten()) < 4


def test_a_coupled_draft_is_the_sample_when_it_knows_the_distribution():
    """Candidates ordered by log q + G: with q = p the first is the target's sample every time; with
    a q far from p it is still the sample far more often than a blind draw from q."""
    logits = logits_of(3, 200)
    p = SamplingParams(0.8)
    probs = process_logits(logits[None], [p])[0]
    ids = list(range(200))
    same = [gumbel_order(ids, probs.log().tolist(), s, 4)[0] == gumbel_choice(logits, p, s, 4) for s in range(500)]
    assert all(same)
    q = process_logits(logits_of(4, 200)[None] * 0.5 + logits[None], [p])[0]
    coupled = sum(gumbel_order(ids, q.log().tolist(), s, 4)[0] == gumbel_choice(logits, p, s, 4) for s in range(2000))
    blind = float((probs * q).sum())  # P(an independent draw from q equals the target's sample)
    tv = 0.5 * float((probs - q).abs().sum())
    assert coupled / 2000 > max(blind + 0.1, (1 - tv) / (1 + tv) - 0.04)


@pytest.mark.parametrize("rule", ["match_gumbel", "match_multinomial", "rejection"])
def test_device_targets_are_the_samplers_own_tokens(rule):
    """What a GPU's verification computes for every node at once (`device_targets`, no read-back) is,
    node by node, the token `target_sampler` picks lazily on the host: the argmax for a greedy row, the
    Gumbel-max sample under match_gumbel and for rows without a draft under rejection; rows that
    sample on the host (a generator's stream, the rejection walk) are not among them."""
    gen = torch.Generator().manual_seed(3)
    trees, seqs, logits, scores = [], [], [], []
    rows = [(0.0, 0, 1.0, 4), (0.7, 20, 0.9, 6), (1.2, 0, 1.0, 0)]
    for i, (temperature, top_k, top_p, n_nodes) in enumerate(rows):
        tree = DraftTree()
        for n in range(n_nodes):
            tree.add(int(torch.randint(0, 300, (1,), generator=gen)), n // 2 - 1 if n else ROOT)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        seq = Sequence.create(list(range(5 + i)), StopRule(frozenset(), (), 8), params, seed=40 + i)
        row = torch.randn(1 + n_nodes, 300, generator=gen) * 2
        trees.append(tree)
        seqs.append(seq)
        logits.append(row)
        scores.append(None if params.greedy else processed_logits(row, params))
    rows, flat = device_targets(trees, seqs, logits, scores, rule)
    owns = dict(zip(rows, torch.split(flat, [1 + len(trees[b]) for b in rows])))
    for b, (tree, seq, row, sc) in enumerate(zip(trees, seqs, logits, scores)):
        if sc is not None and (rule == "match_multinomial" or (rule == "rejection" and len(tree))):
            assert b not in owns
            continue
        own = owns[b].tolist()
        depths = [0, *tree.depths()]
        pick = target_sampler(seq, "match_gumbel" if sc is not None else rule, row, sc, None if sc is None else sc)
        assert own == [pick(m - 1, depths[m]) for m in range(1 + len(tree))]


def test_rows_processed_together_are_the_rows_processed_alone():
    """Verification processes every row of one sampling setting in one call (`processed_rows`):
    each row's scores, and their softmax, are what processing it alone gives."""
    gen = torch.Generator().manual_seed(5)
    settings = [SamplingParams(0.7, 20, 0.9), SamplingParams(0.0), SamplingParams(1.3), SamplingParams(0.7, 20, 0.9)]
    logits = [torch.randn(1 + i, 300, generator=gen) * 2 for i in range(len(settings))]
    together, dists = processed_rows(RowSampling.of(settings), logits)
    for p, row, t, dist in zip(settings, logits, together, dists):
        alone = None if p.greedy else processed_logits(row.float(), p)
        assert (t is None) == (alone is None) == (dist is None)
        if t is not None:
            assert torch.equal(t, alone) and torch.equal(dist, alone.softmax(-1))
