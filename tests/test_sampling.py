"""Logit processing against `transformers`' own warpers, sampling, and the stop rule."""

from __future__ import annotations

import pytest
import torch
from builds import BUILDS, X86, other_build
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from decoding.runtime import kernels
from decoding.speculation.gumbel import _signed, draw_top_rows, gumbel_pick_rows, key
from decoding.speculation.sampling import (
    NUCLEUS_FIRST,
    SamplingParams,
    process_logits,
    processed_logits,
    top_k,
    top_k_rows,
    top_p_kept,
)
from decoding.speculation.stopping import StopRule, final_text

PARAM_SETS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=10),
    SamplingParams(temperature=0.5, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.95),
    SamplingParams(temperature=2.0, top_k=3, top_p=0.3),
    SamplingParams(temperature=1.0, top_p=0.05),  # keeps only the top token
    SamplingParams(temperature=1.0, top_k=1000),  # top_k larger than the vocabulary
]


def hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row [V] through transformers' warpers in generate's order, then softmax."""
    scores = logits[None].float()
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return scores.softmax(-1)[0]


@pytest.mark.parametrize("p", PARAM_SETS, ids=str)
def test_process_logits_matches_transformers_warpers(p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=gen) * 3
    got = process_logits(logits, [p] * 6)
    for b in range(6):
        torch.testing.assert_close(got[b], hf_probs(logits[b], p), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones(6))


def sorted_top_p_kept(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by a sort of the whole row: the smallest descending prefix whose mass reaches top_p
    (the row's softmax as the kernel takes it: a sorted row's sum rounds otherwise, which moves a
    cut deep in the tail by a few tokens)."""
    order = torch.sort(logits, dim=-1, descending=True).indices
    mass = logits.softmax(-1).gather(-1, order)
    kept = torch.cat([torch.zeros_like(mass[:, :1]), mass.cumsum(-1)[:, :-1]], -1) < top_p
    return torch.zeros_like(kept).scatter(-1, order, kept)


@pytest.mark.parametrize("first", [NUCLEUS_FIRST, None], ids=["candidates", "sorted"])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95, 0.999])
def test_top_p_over_a_large_vocabulary_keeps_what_a_sort_of_it_keeps(top_p, first):
    """The nucleus is looked for among the largest logits, more of them while a row's mass falls
    short: peaked rows find it in the first candidates, flat ones only in most of the vocabulary."""
    gen = torch.Generator().manual_seed(5)
    scale = torch.tensor([8.0, 4.0, 1.0, 0.05])[:, None]  # peaked to nearly uniform
    logits = torch.randn(4, 50_000, generator=gen) * scale
    kept = top_p_kept(logits, top_p, first)
    assert torch.equal(kept, sorted_top_p_kept(logits, top_p))
    counts = kept.sum(-1)
    assert counts.min() >= 1 and counts.max() > NUCLEUS_FIRST  # both the first look and a grown one
    if top_p <= 0.9:
        assert counts.min() < NUCLEUS_FIRST


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_keeps_tied_tokens_together_whatever_the_batch(top_p):
    """bfloat16 logits tie often: a cut among tied tokens would depend on the order a sort or top-k
    leaves them in, and the number of candidates looked at, on the rest of the batch."""
    gen = torch.Generator().manual_seed(6)
    scale = torch.tensor([6.0, 2.0, 0.05])[:, None]
    logits = (torch.randn(3, 20_000, generator=gen) * scale).bfloat16().float()
    batch = top_p_kept(logits, top_p)
    for b in range(3):
        alone = top_p_kept(logits[b : b + 1], top_p)[0]
        assert torch.equal(alone, batch[b])
        assert torch.equal(alone, top_p_kept(logits[b : b + 1], top_p, None)[0])
        row, kept = logits[b], batch[b]
        assert torch.equal(torch.isin(row, row[kept]), kept)  # a tie is kept whole or not at all
        probs = row.double().softmax(-1)
        lowest = row[kept].min()
        assert probs[row > lowest].sum() < top_p + 1e-6  # the last tie kept starts below top_p
        assert probs[kept].sum() >= top_p - 1e-6  # and what is kept reaches it
    assert (logits[0] == logits[0][batch[0]].min()).sum() > 1 or (logits[1] == logits[1][batch[1]].min()).sum() > 1


def test_process_logits_per_row_parameters_in_one_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(len(PARAM_SETS), 300, generator=gen) * 3
    got = process_logits(logits, PARAM_SETS)
    for b, p in enumerate(PARAM_SETS):
        torch.testing.assert_close(got[b], hf_probs(logits[b], p), atol=1e-6, rtol=1e-5)
    # The rows really differ, so a mix-up of parameters between rows would show.
    assert not torch.allclose(got[0], got[1], atol=1e-3)


def test_process_logits_keeps_extra_dims():
    """Logits [B, T, V] (a tree of T tokens per row): each row's parameters apply to all its T positions."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 100, generator=gen) * 2
    params = [SamplingParams(0.8, top_k=20), SamplingParams(1.2, top_p=0.7)]
    got = process_logits(logits, params)
    assert got.shape == logits.shape
    for b, p in enumerate(params):
        for t in range(4):
            torch.testing.assert_close(got[b, t], hf_probs(logits[b, t], p), atol=1e-6, rtol=1e-5)


def test_greedy_is_one_hot_argmax():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 50, generator=gen)
    params = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.0, top_k=5, top_p=0.5)]
    got = process_logits(logits, params)
    for b in (0, 2):
        expected = torch.nn.functional.one_hot(logits[b].argmax(-1), 50).float()
        assert torch.equal(got[b], expected)
    assert (got[1] > 0).all()


def test_process_logits_does_not_modify_input():
    logits = torch.randn(2, 40)
    before = logits.clone()
    process_logits(logits, [SamplingParams(0.5, top_k=3), SamplingParams(0.0)])
    assert torch.equal(logits, before)


# --- the stop rule -------------------------------------------------------------------------------


class ToyTokenizer:
    """Each id decodes to a fixed string; id 0 is the (special) EOS."""

    PIECES = ("<eos>", "a", "b", "E", "ND", "ENDx", " ", "xy", "N", "D")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0))


TOK = ToyTokenizer()
EOS = frozenset({0})


def one_at_a_time(rule: StopRule, generated: list[int]) -> tuple[int, str | None]:
    """What a decoder that commits one token per step would keep."""
    for n in range(1, len(generated) + 1):
        kept, reason = rule.check(generated[:n], TOK, start=n - 1)
        if reason is not None:
            return kept, reason
    return len(generated), None


@pytest.mark.parametrize("width", [49_152, 1000])  # the block path, and torch's own top-k where blocks do not fit
def test_top_k_is_torch_topk(width):
    g = torch.Generator().manual_seed(0)
    for scale in (0.1, 3.0, 30.0):  # from nearly flat rows to a few dominant tokens
        x = (scale * torch.randn(3, width, generator=g)).softmax(-1)
        values, ids = top_k(x, 10)
        want = x.topk(10)
        assert torch.equal(values, want.values) and torch.equal(ids, want.indices)
    # Processed distributions hold many exact zeros (top-k, top-p): the values still match.
    x = torch.zeros(2, width)
    x[0, [5, 700, 999]] = torch.tensor([0.5, 0.3, 0.2])
    x[1, 17] = 1.0
    values, ids = top_k(x, 10)
    assert torch.equal(values, x.topk(10).values)
    assert ids[0, :3].tolist() == [5, 700, 999] and ids[1, 0] == 17


@pytest.mark.parametrize("built", [True, False], ids=["kernel", "torch"])
def test_top_k_rows_is_torch_topk_over_the_concatenation(built, monkeypatch):
    """The kernel (one pass a row over strided blocks) and its torch fallback give torch.topk's
    values over the blocks' rows as if concatenated; with no ties, its indices too."""
    if built:
        kernels.load()
    else:
        monkeypatch.setattr(kernels, "built", lambda: None)
    g = torch.Generator().manual_seed(3)
    full = (3.0 * torch.randn(2, 5, 4099, generator=g)).softmax(-1)  # a width no vector divides
    blocks = [full[0, :1], full[1, [0, 2, 4]], full[0, 1:3]]  # a view, a gathered copy, a slice
    values, ids, _ = top_k_rows(blocks, 10)
    want = torch.cat(blocks).topk(10)
    assert torch.equal(values, want.values) and torch.equal(ids, want.indices)
    # Rows of exact zeros and minus infinity (processed and masked distributions): the values match.
    x = torch.zeros(3, 300)
    x[0, [5, 200, 299]] = torch.tensor([0.5, 0.3, 0.2])
    x[1] = -torch.inf
    x[1, 7] = 0.0
    values, ids, _ = top_k_rows([x], 10)
    assert torch.equal(values, x.topk(10).values)
    assert ids[0, :3].tolist() == [5, 200, 299] and ids[1, 0] == 7
    assert all(len(set(row)) == 10 for row in ids.tolist())  # k distinct tokens, even among ties


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("built", [True, False], ids=["kernel", "torch"])
def test_top_k_rows_of_picked_rows_and_of_softmaxes(built, dtype, monkeypatch):
    """Picked rows of logits blocks give their softmax's top tokens, as torch's softmax and topk over
    those rows in float32 do (ids equal, no ties; probabilities to float32 rounding: the kernel sums
    exp in its own order), beside a block of probabilities taken as they are; masked logits too."""
    if built:
        kernels.load()
    else:
        monkeypatch.setattr(kernels, "built", lambda: None)
    g = torch.Generator().manual_seed(5)
    logits = 4.0 * torch.randn(6, 4099, generator=g)
    for row in logits:  # the largest values distinct in bfloat16 too, where they lie
        row[torch.randperm(4099, generator=g)[:16]] = 20.0 + 0.5 * torch.arange(16.0)
    logits = logits.to(dtype)
    probs = torch.randn(3, 4099, generator=g).softmax(-1)
    masked = torch.randn(2, 4099, generator=g)
    masked[:, 100:] = -torch.inf
    picks = [[0, 3, 5], [1], [1, 0]]
    values, ids, _ = top_k_rows([logits, probs, masked], 8, picks, [True, False, True])
    want = torch.cat([logits[[0, 3, 5]].float().softmax(-1), probs[[1]], masked[[1, 0]].softmax(-1)]).topk(8)
    assert torch.equal(ids, want.indices)
    torch.testing.assert_close(values, want.values, rtol=1e-5, atol=1e-7)
    assert torch.equal(values[3], want.values[3])  # a probabilities block's values are its own
    # A row's values are its own: the same bits alone, in another block or beside other rows.
    alone, _, _ = top_k_rows([logits[3:4]], 8, None, [True])
    assert torch.equal(alone[0], values[1])


def test_check_eos():
    rule = StopRule(EOS, (), 10)
    assert rule.check([1, 2, 0, 1, 2], TOK) == (3, "eos")
    assert rule.check([1, 2], TOK) == (2, None)


def test_check_length():
    rule = StopRule(EOS, (), 3)
    assert rule.check([1, 2], TOK) == (2, None)
    assert rule.check([1, 2, 1], TOK) == (3, "length")
    assert rule.check([1, 2, 1, 2, 2], TOK) == (3, "length")
    # EOS as the last allowed token is an EOS finish.
    assert rule.check([1, 2, 0], TOK) == (3, "eos")


@pytest.mark.parametrize(
    "generated, expected",
    [
        ([1, 3, 4, 2, 2], (3, "stop")),  # "a" "E" "ND": the stop string spans two tokens
        ([1, 5, 2, 2], (2, "stop")),  # "ENDx" holds it inside one token
        ([3, 8, 9, 1, 2], (3, "stop")),  # "E" "N" "D": three tokens
        ([1, 2, 2, 3, 4], (5, "stop")),  # completes with the last token
        ([3, 1, 8, 9, 2], (5, None)),  # "EaND..." never contains it
    ],
)
def test_stop_string_inside_multi_token_commit(generated, expected):
    rule = StopRule(EOS, ("END",), 20)
    assert rule.check(generated, TOK) == expected
    assert one_at_a_time(rule, generated) == expected


def test_stop_before_eos_and_length_in_one_commit():
    rule = StopRule(EOS, ("END", "xy"), 6)
    # "a" "xy" ... : the second stop string hits first, before the EOS later in the commit.
    assert rule.check([1, 7, 0, 3, 4], TOK) == (2, "stop")
    # A stop string completed by the last allowed token is a stop, not a length finish.
    assert rule.check([1, 1, 1, 1, 3, 4], TOK) == (6, "stop")
    assert rule.check([1, 1, 1, 1, 1, 1, 3, 4], TOK) == (6, "length")


def test_check_start_skips_checked_tokens():
    rule = StopRule(EOS, ("END",), 20)
    # Tokens before `start` were checked by an earlier call: an EOS there is not found again...
    assert rule.check([0, 1, 2], TOK, start=1) == (3, None)
    # ...nor a stop string that ended before `start`.
    assert rule.check([3, 4, 1, 2], TOK, start=2) == (4, None)
    # A stop string that spans the boundary, completed by the first new token, is found.
    assert rule.check([1, 3, 8, 9, 2], TOK, start=3) == (4, "stop")
    # Incremental calls as a speculative decoder makes them, two commits of two tokens.
    gen = [1, 3]
    assert rule.check(gen, TOK, start=0) == (2, None)
    gen += [4, 1]
    assert rule.check(gen, TOK, start=2) == (3, "stop")


def test_stop_string_longer_than_window_of_short_tokens():
    rule = StopRule(EOS, ("abab",), 50)
    gen = [2, 2, *([1, 2] * 2), 1]
    assert rule.check(gen, TOK) == (6, "stop")
    assert one_at_a_time(rule, gen) == (6, "stop")


def test_final_text():
    assert final_text([1, 3, 4, 2], "stop", ("END",), TOK) == "a"
    # Cut inside a token, before the earliest of several stop strings.
    assert final_text([1, 2, 5, 7], "stop", ("xy", "END"), TOK) == "ab"
    # Special tokens are dropped.
    assert final_text([1, 2, 0], "eos", (), TOK) == "ab"
    # Only a stop finish cuts.
    assert final_text([1, 3, 4], "length", ("END",), TOK) == "aEND"
    assert final_text([1, 3, 4], None, ("END",), TOK) == "aEND"


@pytest.mark.parametrize("built", [True, False], ids=["kernel", "torch"])
def test_top_k_rows_reads_a_row_divided_by_its_temperature_as_its_processed_logits(built, monkeypatch):
    """A raw row read at temperature t gives exactly (bits) what its processed logits give: the
    division is IEEE's, as torch's `logits / t`; float32 and bfloat16 rows alike."""
    if built:
        kernels.load()
    else:
        monkeypatch.setattr(kernels, "built", lambda: None)
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (5.0 * torch.randn(4, 4099, generator=g)).to(dtype)
        for t in (0.7, 0.3, 1.0):
            params = SamplingParams(temperature=t)
            got = top_k_rows([logits], 6, [[0, 2, 3]], [True], [t])
            want = top_k_rows([processed_logits(logits[[0, 2, 3]].float(), params)], 6, None, [True])
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def asks_of_every_kind() -> tuple[list, torch.Tensor]:
    from decoding.speculation.logprobs import Asked

    g = torch.Generator().manual_seed(12)
    logits = 4.0 * torch.randn(5, 3001, generator=g)
    top_p = SamplingParams(temperature=0.8, top_p=0.9)
    asks = [
        Asked(logits, [0, 1], [7, 8], SamplingParams(temperature=0.0), 3),  # greedy
        Asked(logits, [2, 4], [9, 10], SamplingParams(temperature=0.6), 5),  # its temperature alone
        Asked(logits, [1, 3, 4], [11, 12, 13], top_p, 0),  # top-p, processed here
        Asked(logits, [3], [14], top_p, 2, processed=processed_logits(logits.float(), top_p)),  # processed already
        Asked(logits, [], [], SamplingParams(temperature=0.6), 2),  # nothing kept
    ]
    # The tokens top-p keeps, so that their log-probabilities are finite.
    kept = top_p_kept(processed_logits(logits.float(), SamplingParams(temperature=0.8)), 0.9)
    for a in asks[2:4]:
        for i, r in enumerate(a.rows):
            a.tokens[i] = int(kept[r].nonzero()[i % 2])
    return asks, logits


def test_token_logprobs_of_a_step_in_one_call_are_torchs_log_softmax():
    """Every kind of ask (greedy, a temperature alone, top-p processed here or already) read in one
    kernel call gives torch's log-softmax of the processed rows (to float32 rounding: the kernel sums
    exp in its own order) and its top tokens; a row's values are the same bits alone."""
    from decoding.speculation.logprobs import Asked, one_logprobs, token_logprobs

    kernels.load()
    asks, logits = asks_of_every_kind()
    got = token_logprobs(asks)
    want = [one_logprobs(a) for a in asks[:4]]
    assert len(got) == 5 and got[4] == []  # an ask that kept nothing reads nothing, in its place
    for row_got, row_want in zip(got, want):
        assert [t.token for t in row_got] == [t.token for t in row_want]
        assert [t.logprob for t in row_got] == pytest.approx([t.logprob for t in row_want], abs=1e-5)
        for a, b in zip(row_got, row_want):
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
    alone = token_logprobs([Asked(logits, [4], [10], SamplingParams(temperature=0.6), 5)])[0][0]
    assert alone == got[1][1]


def raw_rows(vocab: int, dtype: torch.dtype, n: int = 12) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """Rows of raw logits (peaked, middling and flat, in `dtype`), their noise streams and temperatures."""
    g = torch.Generator().manual_seed(vocab)
    rows = [(torch.randn(vocab, generator=g) * [0.3, 3.0, 30.0][r % 3]).to(dtype) for r in range(n)]
    return rows, [key(r, 5 * r + 1) for r in range(n)], [[0.6, 1.0, 1.7, 0.123][r % 4] for r in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [10, 283, 49_159])
def test_a_draw_and_its_top_k_in_one_pass_are_the_two_calls(dtype, vocab):
    """csrc/draw_top.cpp: a raw row's Gumbel-max draw and its top k (their probabilities, ids and what
    was read of the row) from one pass are `gumbel_pick_rows`' token and `top_k_rows`' values bit for
    bit, at several temperatures, over widths that are no multiple of its blocks (64) or lanes (16, 8)."""
    kernels.load()
    rows, keys, temperatures = raw_rows(vocab, dtype)
    k = min(10, vocab)
    picks, values, ids, read = draw_top_rows(rows, keys, temperatures, k)
    assert picks == gumbel_pick_rows(rows, keys, temperatures)
    want_values, want_ids, want_read = top_k_rows([r[None] for r in rows], k, None, [True] * len(rows), temperatures)
    assert torch.equal(values, want_values) and torch.equal(ids, want_ids)
    assert read is not None and want_read is not None and torch.equal(read, want_read)


SAMPLING_BINDINGS = """#define TOT_SAMPLING_UNREGISTERED
#include <torch/extension.h>
#include "{csrc}/gumbel.cpp"
#include "{csrc}/topk.cpp"
#include "{csrc}/draw_top.cpp"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{
  m.def("gumbel_pick_rows", &gumbel_pick_rows);
  m.def("log_rows", &log_rows);
  m.def("draw_top_rows", &draw_top_rows);
}}
"""


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_the_sampling_kernels_give_every_builds_bits(build):
    """The draws, top k, sums of exp and log-probabilities of this machine's build (its widest lanes:
    16 exponentials at once and the draw's vector filter on AVX-512) are those of the portable and the
    AVX2 builds, bit for bit: a seed samples the same tokens, with the same log-probabilities, on
    every machine."""
    if not X86:
        pytest.skip("the portable and AVX2 builds are x86's")
    kernels.load()
    other = other_build("tot_sampling", build, SAMPLING_BINDINGS.format(csrc=kernels.CSRC))
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in (10, 283, 49_159):
            rows, keys, temperatures = raw_rows(vocab, dtype)
            streams = [_signed(c) for c in keys]
            k = min(10, vocab)
            want_picks = torch.ops.tot_sampling.gumbel_pick_rows(rows, streams, temperatures)
            assert other.gumbel_pick_rows(rows, streams, temperatures) == list(want_picks), (dtype, vocab)
            got = other.draw_top_rows(rows, streams, temperatures, k)
            want = torch.ops.tot_sampling.draw_top_rows(rows, streams, temperatures, k)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (dtype, vocab)
            blocks, tokens = [torch.stack(rows)], [(7 * r) % vocab for r in range(len(rows))]
            for t in (1.0, 0.7):
                args = (blocks, [len(rows)], list(range(len(rows))), [t], tokens, k)
                got = other.log_rows(*args)
                want = torch.ops.tot_sampling.log_rows(*args)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (dtype, vocab, t)
