"""Each row's sampling settings copied once at admission into arrays (decoding/speculation/row_sampling.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.speculation.row_sampling import RowSampling, SamplingTable
from decoding.speculation.sampling import SamplingParams


@dataclass
class Admitted:
    params: SamplingParams


def test_a_steps_rows_read_the_settings_their_sequences_were_admitted_with():
    table = SamplingTable()
    greedy, warm, nucleus = SamplingParams(), SamplingParams(0.7), SamplingParams(0.7, 20, 0.9)
    table.admit([0, 2], [Admitted(warm), Admitted(nucleus)])
    table.admit([1], [Admitted(greedy)])
    step = table.rows([2, 0, 1])
    assert step.params == (nucleus, warm, greedy)
    assert step.greedy == [False, False, True]
    assert step.temperatures == [0.7, 0.7, 0.0]  # float64: the request's own value, not float32's 0.69999...
    assert step.plain == [False, True, False]  # only the temperature's division: read raw by the kernels
    assert step.top_k.tolist() == [20, 0, 0] and step.top_p.tolist() == [0.9, 1.0, 1.0]
    assert step.by_setting() == {nucleus: [0], warm: [1]}
    assert step.by_setting(skip=[False, True, False]) == {nucleus: [0]}


def test_a_row_admitted_again_takes_its_new_sequences_settings():
    table = SamplingTable()
    table.admit([0, 1], [Admitted(SamplingParams(1.3)), Admitted(SamplingParams(0.5))])
    assert table.rows([0, 1]).temperatures == [1.3, 0.5]
    table.admit([0], [Admitted(SamplingParams())])  # row 0 released and reused: the same rows read anew
    assert table.rows([0, 1]).temperatures == [0.0, 0.5]
    table.admit([5], [Admitted(SamplingParams(0.9, 4))])  # the arrays grow to the pool's rows
    assert table.rows([5, 1]).params == (SamplingParams(0.9, 4), SamplingParams(0.5))


def test_take_is_rowsampling_of_those_rows():
    settings = [SamplingParams(0.0), SamplingParams(1.1, 3, 0.8), SamplingParams(0.6)]
    rows = RowSampling.of(settings).take([2, 1])
    alone = RowSampling.of([settings[2], settings[1]])
    assert rows.params == alone.params
    for a, b in ((rows.temperature, alone.temperature), (rows.top_k, alone.top_k), (rows.top_p, alone.top_p)):
        assert torch.equal(a, b)
