"""Each row's sampling settings, copied from its request once, when it is admitted, into arrays.

vLLM's input batch keeps every request's temperature, top-k and top-p in per-row arrays beside its
block table, written when the request joins the batch. `SamplingTable` does so per row of the KV pool,
and a step reads its rows' settings as one `RowSampling`, in the forward's row order: verification,
acceptance, the step planner and the log-probabilities read them there, never from a request
(tests/test_layout.py holds it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from decoding.speculation.sampling import SamplingParams


class Sampled(Protocol):
    """What admission copies from: a sequence, or anything carrying its request's settings."""

    params: SamplingParams


@dataclass(frozen=True)
class RowSampling:
    """The sampling settings of a step's rows: `params[b]` row b's record (rows with equal records are
    processed together), and the same settings as arrays, float64 so each value is the request's own."""

    params: tuple[SamplingParams, ...]
    temperature: torch.Tensor  # [B] float64; 0: greedy
    top_k: torch.Tensor  # [B] int64; 0: off
    top_p: torch.Tensor  # [B] float64; 1: off

    @classmethod
    def of(cls, params: Iterable[SamplingParams]) -> RowSampling:
        kept = tuple(params)
        return cls(
            kept,
            torch.tensor([p.temperature for p in kept], dtype=torch.float64),
            torch.tensor([p.top_k for p in kept], dtype=torch.int64),
            torch.tensor([p.top_p for p in kept], dtype=torch.float64),
        )

    def __len__(self) -> int:
        return len(self.params)

    @cached_property
    def greedy(self) -> list[bool]:
        """Per row: temperature 0 (only the argmax matters)."""
        flags: list[bool] = (self.temperature == 0).tolist()
        return flags

    @cached_property
    def temperatures(self) -> list[float]:
        values: list[float] = self.temperature.tolist()
        return values

    @cached_property
    def plain(self) -> list[bool]:
        """Per row: sampled, and processed by its temperature's division alone (no top-k, no top-p):
        what the kernels read from the raw logits, dividing as they go."""
        flags: list[bool] = ((self.temperature > 0) & (self.top_k == 0) & (self.top_p >= 1)).tolist()
        return flags

    def take(self, rows: Sequence[int]) -> RowSampling:
        """These rows' settings, in this order."""
        at = torch.tensor(list(rows), dtype=torch.int64)
        return RowSampling(tuple(self.params[r] for r in rows), self.temperature[at], self.top_k[at], self.top_p[at])

    def by_setting(self, skip: Sequence[bool] | None = None) -> dict[SamplingParams, list[int]]:
        """The sampled rows (but those `skip` says) by their settings: each group is processed in one call."""
        out: dict[SamplingParams, list[int]] = {}
        for b, (p, greedy) in enumerate(zip(self.params, self.greedy)):
            if not greedy and not (skip and skip[b]):
                out.setdefault(p, []).append(b)
        return out


class SamplingTable:
    """Per row of the KV pool, the settings of the sequence admitted there: written once at
    admission (`admit`), read by each step's rows (`rows`). A released row keeps its last settings
    until the next admission overwrites them; no step reads a row that is not live."""

    def __init__(self) -> None:
        self._rows = RowSampling.of([])
        # The last step's rows and their settings: a busy batch verifies the same rows step after step,
        # and their lists (greedy, plain, ...) are then made once, not a step (~30 us each time).
        self._last: tuple[tuple[int, ...], RowSampling] | None = None

    def admit(self, rows: Sequence[int], seqs: Sequence[Sampled]) -> None:
        """Copy each admitted sequence's settings into its row (the arrays grow to the pool's rows)."""
        if not rows:
            return
        self._last = None
        params = list(self._rows.params)
        params += [SamplingParams()] * (max(rows) + 1 - len(params))
        for row, s in zip(rows, seqs):
            params[row] = s.params
        new = RowSampling.of(s.params for s in seqs)
        grown = len(params) - len(self._rows)
        at = torch.tensor(list(rows), dtype=torch.int64)

        def written(old: torch.Tensor, values: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.cat([old, torch.full((grown,), fill, dtype=old.dtype)])
            out[at] = values
            return out

        self._rows = RowSampling(
            tuple(params),
            written(self._rows.temperature, new.temperature, 0.0),
            written(self._rows.top_k, new.top_k, 0),
            written(self._rows.top_p, new.top_p, 1.0),
        )

    def rows(self, rows: Sequence[int]) -> RowSampling:
        """The settings of these rows of the pool, in this order (a step's rows)."""
        key = tuple(rows)
        if self._last is None or self._last[0] != key:
            self._last = (key, self._rows.take(rows))
        return self._last[1]
