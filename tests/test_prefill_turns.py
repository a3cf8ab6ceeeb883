"""Admission computes prompts in forwards of at most `ModelRunner.prefill_tokens` tokens (its
activations grow with them): a row's KV and logits, and every decoder's tokens, are the same however
its prompt was cut."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from helpers import admit_prompts

from decoding.base.values import GenRequest
from decoding.runtime.packing import pack
from decoding.runtime.runner import ModelRunner, prefill_turns


def test_turns_hold_at_most_the_limit_rows_whole_or_alone_in_pieces():
    todo = [(3, [0, 1, 2]), (1, [0]), (7, list(range(9))), (2, [40, 41]), (5, [50, 51, 52])]
    turns = prefill_turns(todo, 4)
    assert turns == [
        [(3, [0, 1, 2]), (1, [0])],
        [(7, [0, 1, 2, 3])],  # longer than the limit: alone, in pieces
        [(7, [4, 5, 6, 7])],
        [(7, [8])],
        [(2, [40, 41])],
        [(5, [50, 51, 52])],  # does not fit beside row 2: the next forward
    ]
    assert prefill_turns(todo, 4, cut=False)[1:3] == [[(7, list(range(9)))], [(2, [40, 41])]]  # whole, alone
    assert prefill_turns(todo, 100) == [todo]  # under the limit: one forward, as before
    assert prefill_turns([], 4) == []


@pytest.mark.skipif(DEVICE.type != "cpu", reason="bits: the CPU's row- and batch-invariant forward")
def test_a_prompt_cut_into_turns_gives_the_same_kv_and_logits(loaded, tokenizer):
    """Prompts sharing a long question (its head computed once, also cut) and each its own tail,
    admitted whole and in forwards of 7 tokens: the next forward's logits have the same bits."""
    question = tokenizer("a question every prompt shares, long enough for a head of its own " * 2)["input_ids"]
    prompts = [question + tokenizer(tail)["input_ids"] for tail in (" one", " two three four five six", " seven")]
    logits = []
    forwards = []
    for limit in (4096, 7):
        runner = ModelRunner(loaded.model)
        runner.prefill_tokens = limit
        cache, pending = admit_prompts(runner, prompts, capacity=128)
        forwards.append(runner.forwards)
        packed = pack(pending, [])
        logits.append(runner.score(cache, packed, None).logits)
    assert forwards[1] > forwards[0]  # it was cut
    for whole, cut in zip(*logits):
        assert torch.equal(whole, cut)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tokens_are_hfs_with_prompts_cut_into_turns(make_engine, temperature):
    requests = [
        GenRequest(
            f"Prompt {i}: " + "count the apples and the pears " * (3 + 2 * i),
            max_new_tokens=10,
            temperature=temperature,
            seed=i,
        )
        for i in range(4)
    ]
    reference = [r.token_ids for r in make_engine("hf").generate(requests)]
    engine = make_engine("seed_stand")
    engine.target.prefill_tokens = 9
    assert [r.token_ids for r in engine.generate(requests)] == reference
