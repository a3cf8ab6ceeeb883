"""`python -m decoding.profile_forward` on the tiny model: every (tree size, batch) cell is measured, and split."""

from __future__ import annotations

import pytest
from conftest import build_model
from test_quant import int4_copy, k_quant_blocks

from decoding.base.errors import ConfigError
from decoding.profile_forward import (
    ProfileConfig,
    _cell,
    add_fitted,
    add_floor,
    compare_k_blocks,
    forward_over_read,
    forward_tensors,
    k_block_cell,
    profile,
    read_bandwidth,
    sharing_table,
    split_table,
    table,
)
from decoding.runtime.models import ModelSpec
from decoding.runtime.runner import ModelRunner
from decoding.runtime.time_split import PARTS
from decoding.speculation.cost import profile as profile_cost
from decoding.speculation.timing import verification


def test_profile_measures_every_cell(tiny_model):
    cfg = ProfileConfig(ModelSpec(), tree_sizes=(1, 4, 16), batch_sizes=(1, 3), context=20, repeats=2, out=None)
    target = ModelRunner(tiny_model)
    rows = profile(cfg, target)
    assert [(r["batch"], r["tree_tokens"]) for r in rows] == [(1, 1), (1, 4), (1, 16), (3, 1), (3, 4), (3, 16)]
    assert all(r["ms"] > 0 and r["ms_min"] <= r["ms"] for r in rows)
    assert rows[0]["relative"] == 1.0
    # the context once for every cell; per cell a warm-up, two timed forwards, then a warm-up and two profiled ones
    assert target.forwards == 1 + 6 * (1 + 2 + 1 + 2)
    text = table(rows)
    assert text.splitlines()[0] == "| batch | T=1 | T=4 | T=16 |"
    assert len(text.splitlines()) == 4
    for r in rows:  # the parts are shares of the forward: each measured, together the whole
        assert set(r["split"]) == set(PARTS) and all(v >= 0 for v in r["split"].values())
        assert r["split"]["linears"] > 0 and r["split"]["attention"] > 0 and r["split"]["lm_head"] > 0
        assert sum(r["split"].values()) == pytest.approx(1.0)
    assert split_table(rows).splitlines()[2].startswith("| 1 x 1 | ")
    # The step planner's fitted cost beside each measured cell; its profile leaves the runner's peaks
    # what its own forwards reached (a run's peak KV is its requests', not the profile's 64 rows).
    peaks = target.peak_cache_bytes, target.peak_shared_blocks
    add_fitted(rows, profile_cost(target, repeats=1))
    assert (target.peak_cache_bytes, target.peak_shared_blocks) == peaks and target.forwards > 1 + 6 * 6
    assert all(r["fitted_ms"] > 0 for r in rows) and ", fitted " in table(rows)


def test_profile_without_the_split(tiny_model):
    cfg = ProfileConfig(ModelSpec(), (1,), (1,), context=20, repeats=2, out=None, split=False)
    target = ModelRunner(tiny_model)
    assert "split" not in profile(cfg, target)[0] and target.forwards == 1 + 1 + 2


def test_siblings_are_timed_reading_their_context_once_beside_per_row(tiny_model):
    """siblings=N shared=S: each cell three times in lockstep, rows in groups of N reading S positions
    once (the forward is given the groups), every row reading its own blocks, and rows of their own
    holding copies; the table sets them side by side."""
    cfg = ProfileConfig(ModelSpec(), (1,), (4,), context=20, repeats=2, out=None, siblings=2, shared=16)
    target = ModelRunner(tiny_model)
    rows = profile(cfg, target, ModelRunner(tiny_model, paged=False))
    assert [r["reads"] for r in rows] == ["copies", "per row", "shared"]
    text = sharing_table(rows, 2, 16)
    assert "| 4 x 1 | " in text and text.count("\n| 4 x 1 ") == 1 and "| - |" not in text.split("\n")[-1]
    assert "| 4, shared |" in table(rows) and "| 4, copies |" in table(rows)
    assert [r["reads"] for r in profile(cfg, target)] == ["per row", "shared"]  # no copies runner: two
    with pytest.raises(ConfigError, match=r"shared=30 between 0 and context=20"):
        ProfileConfig(ModelSpec(), (1,), (4,), context=20, repeats=2, out=None, siblings=2, shared=30)


def test_a_shared_verification_forward_gives_its_rows_groups(loaded):
    """The forward `verification` times with siblings reads each group's shared positions once."""
    runner = ModelRunner(loaded.model)
    seen = []
    score = runner.score

    def spy(cache, packed, rows=None):
        seen.append(cache.prepare(1).share)
        return score(cache, packed, rows)

    runner.score = spy
    verification(runner, 70, 1, 4, 2, 64)()
    verification(runner, 70, 1, 4)()
    shared, alone = seen
    assert shared is not None and shared[:, 0].unique().numel() == 2 and shared[:, 1].tolist() == [64] * 4
    assert alone is None


def test_profile_rejects_bad_sizes():
    with pytest.raises(ConfigError, match=r"tree_sizes=\[0, 4\] must be a non-empty list of positive integers"):
        ProfileConfig(ModelSpec(), tree_sizes=(0, 4), batch_sizes=(1,), context=20, repeats=2, out=None)


def test_floor_reads_the_weights_and_each_rows_context_once(tiny_model):
    """A forward's floor (decoding.profile_forward): the bytes it reads whole once (every parameter and
    buffer but an untied embedding table, of which it reads a row a token), plus per row the keys and values of
    every layer over the context, at the measured bandwidth."""
    rows = [{"batch": 1, "context": 100}, {"batch": 4, "context": 100}]
    add_floor(rows, tiny_model, bandwidth=1e9)
    c, size = tiny_model.config, next(tiny_model.parameters()).element_size()
    table = tiny_model.get_input_embeddings().weight
    tied = tiny_model.get_output_embeddings().weight.data_ptr() == table.data_ptr()
    weights = (sum(p.numel() for p in tiny_model.parameters()) - (0 if tied else table.numel())) * size
    weights += sum(b.numel() * b.element_size() for b in tiny_model.buffers())  # the rotary frequencies
    per_position = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * size
    assert rows[0]["floor_ms"] == pytest.approx(1000 * (weights + 100 * per_position) / 1e9)
    assert rows[1]["floor_ms"] - rows[0]["floor_ms"] == pytest.approx(1000 * 3 * 100 * per_position / 1e9)
    assert ", floor " in _cell({"ms": 2.0, "relative": 1.0, **rows[0]})


def test_an_int8_forward_reads_its_codes_not_the_heads_kept_matrix(tiny_model):
    """On the int8 path the head multiplies its Q8 codes: the bfloat16 matrix it keeps (EDD's) and the
    embedding table it is tied to are not what a forward reads whole; a timed read of the rest gives a
    positive rate."""
    model = int4_copy(tiny_model, "int8")
    read = forward_tensors(model)
    head = model.get_output_embeddings()
    pointers = {t.data_ptr() for t in read}
    assert head.packed8.data_ptr() in pointers and head.weight.data_ptr() not in pointers
    assert model.get_input_embeddings().weight.data_ptr() not in pointers
    assert read_bandwidth(read) > 0
    # A forward timed right after each read: the ratio of the two, which a slower forward raises.
    quick = forward_over_read(lambda: None, read, 5)
    slow = forward_over_read(lambda: [t.clone() for t in read], read, 5)
    assert 0 < quick < slow


def test_k_blocks_time_both_activation_formats_in_one_process(tiny_model):
    """profile_forward's k_blocks: each cell's forward under each format, alternated round by round, on
    the model and a copy at the other k_block (the model's own layers keep theirs)."""
    model = k_quant_blocks(build_model(tiny_model.config.vocab_size, arch="qwen2", hidden=256))
    cfg = ProfileConfig(ModelSpec(), (1, 2), (1,), 8, 2, None, False, k_blocks=(32, 256))
    rows = compare_k_blocks(cfg, model)
    assert [(r["batch"], r["tree_tokens"]) for r in rows] == [(1, 1), (1, 2)]
    assert all(set(r["ms_by_k_block"]) == {32, 256} and min(r["ms_min_by_k_block"].values()) > 0 for r in rows)
    assert k_block_cell(rows[0]).endswith("x") and " / " in k_block_cell(rows[0])
    assert {m.k_block for m in model.modules() if hasattr(m, "k_block")} == {32}
    with pytest.raises(ConfigError, match=r"k_blocks=\[64\] must list 32 or 256"):
        ProfileConfig(ModelSpec(), (1,), (1,), 8, 2, None, k_blocks=(64,))
