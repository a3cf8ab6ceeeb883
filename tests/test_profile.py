"""`python -m decoding.profile` on the tiny model: every (tree size, batch) cell is measured."""

from __future__ import annotations

import pytest

from decoding.core.errors import ConfigError
from decoding.core.models import ModelSpec
from decoding.core.runner import ModelRunner
from decoding.profile_forward import ProfileConfig, profile, table


def test_profile_measures_every_cell(tiny_model):
    cfg = ProfileConfig(ModelSpec(), tree_sizes=(1, 4, 16), batch_sizes=(1, 3), context=20, repeats=2, out=None)
    target = ModelRunner(tiny_model)
    rows = profile(cfg, target)
    assert [(r["batch"], r["tree_tokens"]) for r in rows] == [(1, 1), (1, 4), (1, 16), (3, 1), (3, 4), (3, 16)]
    assert all(r["ms"] > 0 and r["ms_min"] <= r["ms"] for r in rows)
    assert rows[0]["relative"] == 1.0
    assert target.forwards == 6 * (1 + 1 + 2)  # per cell: the context, a warm-up, two timed forwards
    text = table(rows)
    assert text.splitlines()[0] == "| batch | T=1 | T=4 | T=16 |"
    assert len(text.splitlines()) == 4


def test_profile_rejects_bad_sizes():
    with pytest.raises(ConfigError, match=r"tree_sizes=\[0, 4\] must be a non-empty list of positive integers"):
        ProfileConfig(ModelSpec(), tree_sizes=(0, 4), batch_sizes=(1,), context=20, repeats=2, out=None)
