"""`decoder=seed`: SEED's rounds scheduler on the shared verification core (tiny models)."""

from __future__ import annotations

import random
import time

import pytest
from helpers import UNCAPPED
from test_decoders import BUDGETS, EOS_ID, PROMPTS, _stop_string_case, encode, reference_greedy
from test_speculative import PARAMS, RULES, ScriptedDrafter, check_three_tokens, sample_three

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine
from decoding.base.values import GenRequest, Group
from decoding.runtime.models import ModelSpec
from decoding.schedules.planner import goodput_planner
from decoding.schedules.rounds import Rounds, RoundsOptions
from decoding.schedules.scheduler import Scheduler
from decoding.speculation.draft_tree import DraftTree
from decoding.speculation.sampling import SamplingParams
from decoding.speculation.sequence import Sequence
from decoding.speculation.slot import Slot
from decoding.speculation.stopping import StopRule
from decoding.trees.policies import DraftTreeOptions


def seed_engine(loaded, draft, k_config=(2, 2, 1), verify_batch=1, overlap=False, **options) -> Engine:
    cfg = DecoderConfig(
        "seed",
        DraftTreeOptions(k_config=k_config, key="seed", **options),
        RoundsOptions(verify_batch, overlap),
        draft=ModelSpec(key="draft"),
        verify=UNCAPPED,
    )
    return Engine(loaded, cfg, draft)


def requests_for(n: int) -> tuple[list[tuple[str, int]], list[GenRequest]]:
    """n ragged requests that finish at different points (the first two share a prompt)."""
    pool = [("the cat", 18), ("the cat", 9), *zip(PROMPTS[1:], BUDGETS[1:]), ("a", 25), ("once upon a time", 3)]
    specs = pool[:n]
    return specs, [GenRequest(p, max_new_tokens=m) for p, m in specs]


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("verify_batch", [1, 3])
@pytest.mark.parametrize("n", range(1, 9))
def test_greedy_identity(tiny_model, tokenizer, loaded, perturbed, n, verify_batch, overlap):
    specs, requests = requests_for(n)
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    for draft in (loaded, perturbed):
        engine = seed_engine(loaded, draft, (2, 2, 1), verify_batch, overlap)
        results = engine.generate(requests)
        assert [r.token_ids for r in results] == refs
        stats = engine.last_stats
        assert stats.schedule.verified_drafts == stats.verify_steps
        assert 0 < stats.target_busy_fraction <= 1


@pytest.mark.parametrize("k_config", [(1, 1, 1), (4, 2, 1)], ids=str)
def test_greedy_identity_k_configs_and_stop_strings(tiny_model, tokenizer, loaded, perturbed, k_config):
    prompt, budget, gen, stop = _stop_string_case(tiny_model, tokenizer)
    n = next(i for i in range(1, len(gen) + 1) if stop in tokenizer.decode(gen[:i]))
    specs, requests = requests_for(6)
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    requests.append(GenRequest(prompt, max_new_tokens=budget, stop=stop))
    refs.append(gen[:n])
    for overlap in (False, True):
        engine = seed_engine(loaded, perturbed, k_config, 2, overlap, multi_candidate=max(k_config) > 1)
        results = engine.generate(requests)
        assert [r.token_ids for r in results] == refs
        assert results[-1].finish_reason == "stop"


def test_scheduler_statistics(loaded):
    _, requests = requests_for(6)
    engine = seed_engine(loaded, loaded, (1, 1, 1), verify_batch=1, multi_candidate=False)
    results = engine.generate(requests)
    stats = engine.last_stats
    # verify_batch 1: one target forward per queued draft, after one computing every prompt.
    assert stats.target_forwards == stats.schedule.verified_drafts + 1
    assert stats.acceptance_length > 3.0  # the target drafting for itself at temperature 0
    assert stats.schedule.mean_queue_wait_s > 0 and stats.schedule.drafts_per_round >= 1
    assert stats.sequences == 6
    assert stats.mean_sequence_acceptance_length == pytest.approx(sum(r.stats.acceptance_length for r in results) / 6)
    d = stats.to_dict()
    for key in ("target_busy_fraction", "mean_queue_wait_s", "drafts_per_round", "mean_sequence_acceptance_length"):
        assert key in d
    batched = seed_engine(loaded, loaded, (1, 1, 1), verify_batch=6, multi_candidate=False)
    assert [r.token_ids for r in batched.generate(requests)] == [r.token_ids for r in results]
    assert batched.last_stats.target_forwards < stats.target_forwards


# --- the schedule itself ----------------------------------------------------------------------------


class SlowScriptedDrafter(ScriptedDrafter):
    """Scripted drafts that take a random time, checking that only drafting rows are drafted."""

    def __init__(self, refs, rounds_of, **kwargs):
        super().__init__(refs, (2, 1), "random", **kwargs)
        self.rounds_of = rounds_of
        self.rng = random.Random(0)

    def draft(self, slots):
        rounds = self.rounds_of()
        with rounds.cond:
            assert all(s.phase == "drafting" and rounds.live[s.row] is s for s in slots)
        time.sleep(self.rng.uniform(0, 0.004) * len(slots))
        return super().draft(slots)


def check_schedule(log: list[tuple[str, int]], n: int) -> None:
    """Every row is admitted, cycles queued -> verifying -> drafting|done, ends done, and the queue
    is FCFS."""
    state: dict[int, str] = {}
    arrivals, served = [], []
    for event, row in log:
        expected = {
            "admitted": None,
            "queued": "drafting",
            "verifying": "queued",
            "drafting": "verifying",
            "done": "verifying",
        }
        assert state.get(row) == expected[event], (event, row, state.get(row))
        if event == "admitted":
            event = "drafting"
        state[row] = event
        if event == "queued":
            arrivals.append(row)
        if event == "verifying":
            served.append(row)
    assert len(state) == n and all(s == "done" for s in state.values())
    assert served == arrivals  # first come, first served


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("verify_batch", [1, 2, 5])
def test_schedule_properties(tiny_model, tokenizer, loaded, verify_batch, overlap):
    specs, requests = requests_for(8)
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    engine = Engine(loaded, "ar")
    drafter = SlowScriptedDrafter(refs, lambda: decoder.rounds, vocab=len(tokenizer))
    planner = goodput_planner(engine.target)  # the product default plan, as decoding/api/decoders.py builds it
    decoder = Scheduler("seed", engine.target, tokenizer, drafter, verify_batch, overlap, planner=planner)
    engine.decoder = decoder
    results = engine.generate(requests)
    assert [r.token_ids for r in results] == refs
    check_schedule(decoder.rounds.log, len(requests))
    assert engine.last_stats.schedule.verified_drafts == sum(1 for e, _ in decoder.rounds.log if e == "verifying")


def test_check_schedule_catches_violations():
    with pytest.raises(AssertionError):
        log = [("queued", 0), ("queued", 1), ("verifying", 1), ("done", 1), ("verifying", 0), ("done", 0)]
        check_schedule([("admitted", 0), ("admitted", 1), *log], 2)
    with pytest.raises(AssertionError):
        check_schedule([("admitted", 0), ("queued", 0), ("verifying", 0), ("drafting", 0)], 1)  # never finished
    with pytest.raises(AssertionError):
        check_schedule([("queued", 0), ("verifying", 0), ("done", 0)], 1)  # never admitted
    rounds = Rounds()
    slot = Slot(0, Sequence.create([1], StopRule(frozenset(), (), 4), SamplingParams(0.0), 0))
    rounds.arrive([slot])
    with pytest.raises(AssertionError, match="drafted while queued"):
        rounds.enqueue([slot], [DraftTree()], 0.0)
        rounds.enqueue([slot], [DraftTree()], 0.0)


# --- statistical losslessness ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rule, params_name, overlap",
    [("multi", "t1.0", True), ("without-replacement", "t0.7-k20-p0.9", False), ("single", "t1.0", False)],
)
def test_sampling_follows_the_target(tiny_model, tokenizer, loaded, perturbed, rule, params_name, overlap):
    """8,000 seeded 3-token runs through the rounds scheduler; tolerance as in test_speculative."""
    params = PARAMS[params_name]
    prompt = encode(tokenizer, "once upon a time")
    engine = seed_engine(loaded, perturbed, verify_batch=4, overlap=overlap, **RULES[rule])
    samples = sample_three(engine, prompt, params, 8000)
    assert engine.total_stats.accepted_tokens > 0
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))


# --- seed_stand with a draft model: the union of both trees ---------------------------------------


def union_engine(loaded, draft, tree: str, verify_batch: int = 4) -> Engine:
    from decoding.drafters.stand import StandOptions

    cfg = DecoderConfig(
        "seed_stand",
        DraftTreeOptions(k_config=(2, 1), key="seed"),
        RoundsOptions(verify_batch),
        options={"stand": StandOptions(tree=tree)},
        draft=ModelSpec(key="draft"),
        verify=UNCAPPED,
    )
    return Engine(loaded, cfg, draft)


@pytest.fixture(scope="module")
def chain_tree(tmp_path_factory) -> str:
    from decoding.speculation.draft_tree import k_config_parents
    from decoding.trees.static import StaticTree

    path = tmp_path_factory.mktemp("trees") / "chain.json"
    StaticTree(tuple(k_config_parents((2, 1, 1))), {"made_by": "test"}).save(path)
    return str(path)


def test_union_greedy_identity(tiny_model, tokenizer, loaded, perturbed, chain_tree):
    specs, requests = requests_for(8)
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    engine = union_engine(loaded, perturbed, chain_tree)
    assert type(engine.decoder.drafter).__name__ == "UnionDrafter"
    for _ in range(2):
        assert [r.token_ids for r in engine.generate(requests)] == refs
    assert engine.last_stats.accepted_tokens > 0


def test_union_sampling_follows_the_target(tiny_model, tokenizer, loaded, perturbed, chain_tree):
    """8,000 seeded 3-token runs; tolerance as in test_speculative."""
    params = PARAMS["t1.0"]
    prompt = encode(tokenizer, "once upon a time")
    engine = union_engine(loaded, perturbed, chain_tree, verify_batch=64)
    samples = sample_three(engine, prompt, params, 8000)
    assert engine.total_stats.accepted_tokens > 0
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))


@pytest.mark.parametrize("decoder", ["seed_stand", "seed"])
def test_first_draft_verified_beside_rows_far_along(tiny_model, tokenizer, loaded, decoder):
    """More rows than seed.verify_batch, each with a long unshared prompt part: a row's first
    verification (its whole pending part) shares a forward with rows already a round along. The
    cache must hold that (it once ran out of positions on Creative Writing's evaluations)."""
    head = "Rate this passage. "
    bodies = [" ".join(f"word{i}x{j}" for j in range(40 + (9 if i == 8 else 0))) for i in range(9)]
    prompts = [head + b for b in bodies]
    requests = [GenRequest(p, max_new_tokens=6, temperature=0.0, group=Group("g")) for p in prompts]
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), 6, {EOS_ID}) for p in prompts]
    if decoder == "seed":
        engine = seed_engine(loaded, loaded, (2, 2, 1), 8, False)
    else:
        engine = Engine(loaded, DecoderConfig(name="seed_stand", rounds=RoundsOptions(verify_batch=8), verify=UNCAPPED))
    assert [r.token_ids for r in engine.generate(requests)] == refs
