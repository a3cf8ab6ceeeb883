"""Where a decode step's time goes: admission, the verification forward, and the host's work around
it by stage (`DecodeStats.host_*_s`), adding up to the step's wall time as the engine clocks it."""

from __future__ import annotations

import itertools

import pytest
from conftest import DEVICE
from test_continuous import engine_for

from decoding.base.values import HOST_STAGES, DecodeStats, GenRequest
from decoding.engine import run_sync
from decoding.schedules.step import Laps

PROMPTS = ["the cat", "hello world and more", "a", "once upon a time", "the dog sat on the mat"]


def test_laps_charge_each_stage_the_time_since_the_last():
    ticks = itertools.count(0.0, 0.5)
    laps = Laps(lambda: next(ticks))  # 0.0 at the start, then 0.5 a call
    laps.lap("pack")
    laps.lap("launch", less=0.25)  # 0.5 s, of it 0.25 the forward's
    laps.lap("pack")
    assert laps.seconds == {"pack": 1.0, "launch": 0.25} and laps.total == 1.5


@pytest.mark.parametrize("name", ["ar", "stand", "seed_stand", "sd"])
def test_a_steps_stages_add_up_to_its_wall_time(name, loaded, perturbed):
    engine = engine_for(name, loaded, perturbed)
    requests = [
        GenRequest(p, max_new_tokens=10 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=i)
        for i, p in enumerate(PROMPTS)
    ]
    run_sync(engine.agenerate(requests))  # as a search calls it: the engine clocks each step
    s = engine.total_stats
    assert s.steps >= 10 and s.forward_s > 0 and s.admit_s > 0
    # The stages are laps of one clock: they and the forward make the step, exactly.
    assert s.admit_s + s.forward_s + s.host_s == pytest.approx(s.step_s, rel=1e-9)
    # ... and the step is what the engine's own clock saw around it, bar the call itself (20 us).
    assert 0 <= engine.step_s - s.step_s <= 0.01 * engine.step_s + 2e-5 * s.steps
    stages = s.host_by_stage
    assert set(stages) == set(HOST_STAGES)
    if DEVICE.type == "cpu":  # on a GPU the forward's kernels run on after its call returns
        assert all(v >= 0 for v in stages.values()), stages
    assert stages["accept"] > 0 and stages["commit"] > 0 and stages["pack"] > 0
    summary = s.host_summary()
    assert summary["steps"] == s.steps
    assert summary["host_ms_per_step"] == pytest.approx(sum(summary["host_ms_per_step_by_stage"].values()))
    assert summary["host_ms_per_step"] == pytest.approx(1000 * s.host_s / s.steps)


def test_step_times_survive_the_records_and_add_across_calls():
    a = DecodeStats()
    a.add_step(0.010, 0.004, {"admit": 0.001, "pack": 0.002, "accept": 0.003})
    b = DecodeStats.from_dict(a.to_dict())
    assert b == a
    b += a
    assert (b.steps, b.host_pack_s, b.admit_s) == (2, 0.004, 0.002)
    assert b.host_ms_per_step == pytest.approx(5.0) and b.forward_ms_per_step == pytest.approx(4.0)
