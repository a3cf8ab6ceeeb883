"""Token log-probabilities (`GenRequest.logprobs` / `top_logprobs`) and choices (`GenRequest.choices`)
from every decoder, in batches that mix them with plain requests, against `transformers`."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_continuous import engine_for
from test_decoders import encode
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from decoding.api.kinds import DECODERS
from decoding.base.values import GenRequest
from decoding.runtime import kernels
from decoding.runtime.runner import Scored
from decoding.speculation.draft_tree import DraftTree
from decoding.speculation.gumbel import gumbel_pick_rows, key
from decoding.speculation.logprobs import Asked, from_reading, read_before, token_logprobs
from decoding.speculation.row_sampling import RowSampling
from decoding.speculation.sampling import SamplingParams
from decoding.speculation.sequence import Sequence
from decoding.speculation.stopping import StopRule
from decoding.speculation.verify import host_targets, top_tokens

SAMPLED = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}


def mixed_requests() -> list[GenRequest]:
    """Greedy and sampled rows asking log-probabilities (with and without alternatives), rows not
    asking, and a choice, in one batch."""
    return [
        GenRequest("the cat", max_new_tokens=12, logprobs=True, top_logprobs=3),
        GenRequest("once upon a time", max_new_tokens=9, logprobs=True, seed=5, **SAMPLED),
        GenRequest("hello world and more", max_new_tokens=7),
        GenRequest("a", max_new_tokens=10, logprobs=True, top_logprobs=5, seed=2, temperature=1.0),
        GenRequest("1 2 3 4", choices=(" 5", " 56", " five", "x")),
        GenRequest("1 2 3 4", max_new_tokens=6, seed=9, **SAMPLED),
    ]


def reference(model, prompt: list[int], tokens: list[int], request: GenRequest) -> torch.Tensor:
    """`transformers`' log-probabilities of `tokens` after `prompt` [len(tokens), V]: its forward,
    then (sampled) its own warpers, as `generate(output_scores=True)` reports the sampled scores."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    if request.temperature > 0:
        warpers = LogitsProcessorList([TemperatureLogitsWarper(request.temperature)])
        if request.top_k:
            warpers.append(TopKLogitsWarper(request.top_k))
        if request.top_p < 1:
            warpers.append(TopPLogitsWarper(request.top_p))
        logits = torch.stack([warpers(ids[:, : len(prompt) + i], row[None])[0] for i, row in enumerate(logits)])
    return logits.log_softmax(-1).cpu()


def plain_choice(model, prompt: list[int], answer: list[int]) -> float:
    ids = torch.tensor([prompt + answer], device=model.device)
    with torch.inference_mode():
        logp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    return sum(logp[i, t].item() for i, t in enumerate(answer))


@pytest.mark.parametrize("name", list(DECODERS))
def test_logprobs_and_choices_are_transformers_for_every_decoder(name, tiny_model, tokenizer, loaded, perturbed):
    """Every decoder's log-probabilities of the tokens it generated are `transformers`' for them
    (to float32 rounding: its forward is another kernel), the top alternatives are the reference's
    most likely tokens, and a choice's answers score what a plain forward gives them; rows that did
    not ask get none, and asking changes no token."""
    requests = mixed_requests()
    engine = engine_for(name, loaded, perturbed)
    results = engine.generate(requests)
    plain = engine_for(name, loaded, perturbed).generate([r for r in requests if not r.choices])
    # A forward of choices alone: the same bits on the CPU (batch-invariant), float32 rounding on a GPU.
    alone = [r.choice_logprobs for r in engine.generate([r for r in requests if r.choices])]
    mixed = [r.choice_logprobs for r in results if r.choice_logprobs]
    assert alone == (mixed if loaded.device.type == "cpu" else [pytest.approx(m, abs=1e-4) for m in mixed])
    assert [r.token_ids for r in results if r.choice_logprobs is None] == [r.token_ids for r in plain]
    for request, result in zip(requests, results):
        prompt = encode(tokenizer, request.prompt)
        if request.choices:
            assert result.token_ids == [] and result.logprobs is None
            answers = [engine._answer(request, prompt, a) for a in request.choices]
            expected = [plain_choice(tiny_model, prompt, a) for a in answers]
            assert result.choice_logprobs == pytest.approx(expected, abs=1e-4)
            continue
        assert result.choice_logprobs is None
        if not request.logprobs:
            assert result.logprobs is None
            continue
        assert result.logprobs is not None and [t.token for t in result.logprobs] == result.token_ids
        ref = reference(tiny_model, prompt, result.token_ids, request)
        for i, entry in enumerate(result.logprobs):
            assert entry.logprob == pytest.approx(ref[i, entry.token].item(), abs=1e-4)
            assert math.isfinite(entry.logprob)  # a generated token is inside top-k / top-p
            assert len(entry.top) == request.top_logprobs
            top = ref[i].topk(request.top_logprobs)
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert all(entry.top[j][1] >= entry.top[j + 1][1] for j in range(len(entry.top) - 1))


def test_logprobs_are_bitwise_the_same_whatever_the_batch(loaded, perturbed):
    """The CPU forward is batch-invariant, so a row's log-probabilities do not depend on the decoder,
    its drafts or the rows beside it: alone under `ar` they are bitwise those of every decoder's
    mixed batch. On a GPU, whose kernels round by shape, the tokens are the same and the values
    agree to float32 rounding."""
    exact = loaded.device.type == "cpu"
    requests = mixed_requests()
    alone = {i: engine_for("ar", loaded, perturbed).generate([r])[0] for i, r in enumerate(requests)}
    for name in DECODERS:
        if DECODERS[name].schedule == "hf":
            continue  # transformers' own forward: another kernel
        results = engine_for(name, loaded, perturbed).generate(requests)
        for i, result in enumerate(results):
            if exact:  # whole entries: tokens, values and alternatives, bit for bit
                assert (result.logprobs, result.choice_logprobs) == (alone[i].logprobs, alone[i].choice_logprobs)
                continue
            got, want = result.logprobs or [], alone[i].logprobs or []
            assert [t.token for t in got] == [t.token for t in want], name
            assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-4), name
            if want_choices := alone[i].choice_logprobs:
                assert result.choice_logprobs == pytest.approx(want_choices, abs=1e-4), name


def test_choices_share_their_prompt_and_tokenize_in_context(loaded, perturbed, tokenizer):
    """Answers that share first tokens share nodes of one tree; each is tokenized as it reads after
    the prompt; their probabilities, exponentiated and normalised, form a distribution."""
    engine = engine_for("ar", loaded, perturbed)
    request = GenRequest("1 2 3 4", choices=[" 5", " 56", " 567"])
    seq = engine._sequence(request)
    assert seq.choices is not None
    paths = seq.choices.paths
    assert paths[1][: len(paths[0])] == paths[0] and paths[2][: len(paths[1])] == paths[1]
    assert len(seq.choices.tree) == len(paths[2])  # one node per distinct token
    (result,) = engine.generate([request])
    lp = result.choice_logprobs
    assert lp is not None and lp[0] >= lp[1] >= lp[2]  # each extends the one before
    with pytest.raises(ValueError, match="distinct, non-empty answers"):
        GenRequest("x", choices=(" a", " a"))
    with pytest.raises(ValueError, match="needs logprobs=True"):
        GenRequest("x", top_logprobs=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_read_by_the_acceptance_gives_log_rows_bits(dtype):
    """The commit's log-probabilities of rows the acceptance's top-k pass already read (`RowReading`,
    from csrc/topk.cpp's `top_k_rows`) are `log_rows`' for those rows bit for bit, at a temperature
    and at 1, the top alternatives included; an ask of more alternatives than were read, of another
    block or of other rows takes the pass as before."""
    kernels.load()  # the reading is the kernel's
    torch.manual_seed(3)
    logits = (torch.randn(6, 5000) * 4).to(dtype)
    for temperature in (1.0, 0.7):
        rows, tokens = [0, 2, 5], [17, 4999, 123]
        sampling = RowSampling.of([SamplingParams(temperature=temperature)])
        tops, readings = top_tokens([([1, 4], None, None, logits)], sampling, 8)
        reading = readings[0]
        assert reading is not None and reading.rows == rows and len(tops[0][0]) == 3
        asked = Asked(logits, rows, tokens, SamplingParams(temperature=temperature), 5)
        want = token_logprobs([asked])[0]  # log_rows: no reading given
        assert from_reading(reading, tokens, 5) == want
        assert token_logprobs([replace(asked, reading=reading)])[0] == want
        # the probabilities the pass gave STAND are the same distribution's
        assert tops[0][1][0][:5] == pytest.approx([math.exp(lp) for _, lp in want[0].top], rel=1e-5)
        assert read_before(reading, logits, temperature, rows[:2], 8)
        assert not read_before(reading, logits, temperature, rows, 9)  # more alternatives than were read
        assert not read_before(reading, logits.clone(), temperature, rows, 5)  # another block
        assert not read_before(reading, logits, temperature, [2], 5)  # other rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_drawn_rows_top_tokens_come_from_its_draw_as_top_tokens_gives_them(dtype):
    """The acceptance's host targets with STAND's `top`: an undrafted row sampled at its temperature
    alone gets its draw, its top tokens and what was read of it from one pass (`draw_top_rows`), the
    same as the draw alone and `top_tokens`' pass over that row give them."""
    kernels.load()  # the one-pass op is the kernel's
    torch.manual_seed(5)
    logits = [(torch.randn(1, 5000) * 4).to(dtype) for _ in range(3)]
    params = SamplingParams(temperature=0.7)
    seqs = [Sequence.create([1, 2], StopRule(frozenset(), (), 4), params, seed) for seed in range(3)]
    sampling = RowSampling.of([params] * 3)
    targets, drawn = host_targets(
        Scored(logits, None, 0.0), [DraftTree()] * 3, seqs, sampling, [None] * 3, [True] * 3, "match_gumbel", 8
    )
    want, readings = top_tokens([([], None, None, row) for row in logits], sampling, 8)
    keys = [key(s.seed, s.position) for s in seqs]
    assert targets == [[t] for t in gumbel_pick_rows([row[0] for row in logits], keys, [0.7] * 3)]
    for b in range(3):
        top, reading = drawn[b]
        assert top == want[b] and reading is not None and readings[b] is not None
        assert reading.block is readings[b].block and reading.rows == readings[b].rows == [0]
        assert (reading.most, reading.log_sum, reading.values, reading.ids) == (
            readings[b].most,
            readings[b].log_sum,
            readings[b].values,
            readings[b].ids,
        )
