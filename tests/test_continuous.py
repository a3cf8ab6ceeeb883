"""Continuous batching: sequences join the running batch between forwards and leave it when they
stop, for every decoder; awaited calls share one engine; searches over it give the same trees
however many problems run at once."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import json
import weakref

import pytest
from test_decoders import EOS_ID, encode, reference_greedy

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine, apportion
from decoding.api.kinds import DECODERS
from decoding.base.errors import BackendError
from decoding.base.values import GenRequest
from decoding.drafters.draft_model import ModelDrafter
from decoding.runtime.kv_bytes import pool_bytes
from decoding.runtime.models import ModelSpec
from decoding.speculation.options import Rule, VerifyOptions
from decoding.speculation.sequence import needs
from tasks.base import Problem
from tasks.gsm8k import GSM8K
from tot.runs.run import solve_all
from tot.search.base import GenSettings, run_sync
from tot.search.bfs import BFS, BFSSettings

SPECS = [
    ("the cat", 18),
    ("hello world and more", 6),
    ("a", 25),
    ("the cat", 9),
    ("once upon a time", 12),
    ("the dog sat on the mat", 20),
    ("hello world and more", 14),
]


def engine_for(name: str, loaded, perturbed, rule: Rule = "match_gumbel") -> Engine:
    draft = perturbed if DECODERS[name].draft_model == "required" else None
    spec = ModelSpec(key="draft") if draft else None
    return Engine(loaded, DecoderConfig(name, draft=spec, verify=VerifyOptions(rule=rule)), draft)


def models(request: pytest.FixtureRequest, forward: str) -> tuple:
    """(target, draft) with the forward `forward`: unpadded (the product's CPU path), or bucketed
    (padded to the tests' buckets, as CUDA graphs run it; eager on the CPU)."""
    if forward == "bucketed":
        return request.getfixturevalue("bucketed"), request.getfixturevalue("bucketed_draft")
    return request.getfixturevalue("loaded"), request.getfixturevalue("perturbed")


@pytest.mark.parametrize("forward", ["unpadded", "bucketed"])
@pytest.mark.parametrize("name", list(DECODERS))
def test_rows_join_and_leave_mid_decode(name, forward, tiny_model, tokenizer, request):
    """Sequences admitted while others decode, into rows that finished sequences left, come out as
    `transformers` greedy decoding gives them (the default verify budget cuts the trees too); also
    through the bucketed forward, where pads must change no real row."""
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in SPECS]
    loaded, perturbed = models(request, forward)
    engine = engine_for(name, loaded, perturbed)
    decoder = engine.decoder
    seqs = [engine._sequence(GenRequest(p, max_new_tokens=m)) for p, m in SPECS]
    arrivals = {0: seqs[:2], 2: seqs[2:4], 4: seqs[4:5], 9: seqs[5:]}
    joined_mid_decode, finished, step = 0, [], 0
    while decoder.busy or step <= max(arrivals):
        if step in arrivals:
            joined_mid_decode += decoder.live > 0
            decoder.admit(arrivals[step])
        finished += decoder.step().finished if decoder.busy else []
        step += 1
    assert [s.generated for s in seqs] == refs
    assert sorted(map(id, finished)) == sorted(map(id, seqs))  # each reported once, when it stopped
    if name != "hf":  # (hf decodes each sequence whole within one step)
        assert joined_mid_decode >= 2
        log = decoder.rounds.log
        reused = [r for i, (e, r) in enumerate(log) if e == "admitted" and ("done", r) in log[:i]]
        assert reused, "no row was reused after its sequence left"
        assert decoder.rounds.size < len(seqs)  # the pool holds fewer rows than sequences seen


@pytest.mark.parametrize("name", [n for n, kind in DECODERS.items() if kind.schedule != "hf"])
def test_a_released_slot_leaves_no_trace(name, loaded, perturbed):
    """Everything the batch knows of a live sequence lives in its slot: once the sequence stopped
    (and the drafter heard, at the end of that step), no object holds the slot any more (the
    scheduler, its rounds and queue, the planner, the drafters and their pools), while the others
    decode on."""
    engine = engine_for(name, loaded, perturbed)
    decoder = engine.decoder
    specs = [("the cat", 3), ("a", 16), ("hello world and more", 12)]
    seqs = [engine._sequence(GenRequest(p, max_new_tokens=m)) for p, m in specs]
    seen: dict[int, weakref.ref] = {}  # id(sequence) -> its slot, from its admission on
    arrive = decoder.rounds.arrive

    def watched(slots: list) -> None:
        seen.update((id(s.seq), weakref.ref(s)) for s in slots)
        arrive(slots)

    decoder.rounds.arrive = watched
    decoder.admit(seqs)
    released = 0
    while decoder.busy:
        finished = decoder.step().finished
        gc.collect()
        for seq in finished:
            assert seen[id(seq)]() is None, f"{name}: the slot of a finished sequence is still held"
            assert all(slot.seq is not seq for slot in decoder.slots.values())
            released += 1
    assert released == len(seqs) and len(seen) == len(seqs)
    assert not decoder.rounds.live and not decoder.rounds.queue and decoder.rounds.finished


@pytest.mark.parametrize("name", [n for n, kind in DECODERS.items() if kind.schedule in ("batch", "seed")])
def test_the_pool_gives_memory_back_after_a_burst(name, tiny_model, tokenizer, loaded, perturbed):
    """A long sequence decodes on while a burst of ten short ones with long prompts comes and goes:
    once they left, the KV pool (and a draft model's) shrinks to the one live row and the positions it
    needs, and the long sequence's tokens are still `transformers`' (its row moved intact)."""
    long_spec = ("a", 25)
    burst = [(f"the dog sat on the mat number {i} and the cat sat on the dog", 2) for i in range(10)]
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in [long_spec, *burst]]
    engine = engine_for(name, loaded, perturbed)
    decoder = engine.decoder
    seqs = [engine._sequence(GenRequest(p, max_new_tokens=m)) for p, m in [long_spec, *burst]]
    decoder.admit(seqs[:1])
    decoder.step()
    decoder.admit(seqs[1:])
    decoder.step()
    widest = decoder.cache.nbytes
    shrunk = []
    while decoder.busy:
        decoder.step()
        shrunk.append(decoder.live == 1 and decoder.cache.batch == 1 and decoder.cache.nbytes * 4 < widest)
    assert [s.generated for s in seqs] == refs
    assert any(shrunk), "the pool kept the burst's rows after it left"
    assert decoder.cache.nbytes == 0  # nothing live at the end: everything went back
    if isinstance(decoder.drafter, ModelDrafter):
        assert decoder.drafter.cache.nbytes == 0


@pytest.mark.parametrize("name", ["ar", "seed_stand", "sd"])
def test_awaited_calls_share_the_engine(name, tiny_model, tokenizer, loaded, perturbed):
    """Two callers submit one request after another; each call joins while the other's decode:
    greedy outputs are `transformers`', and the calls' cost shares add up to the engine's."""
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in SPECS]
    engine = engine_for(name, loaded, perturbed)
    forwards, rows = engine.target.forwards, engine.target.rows

    async def chain(specs):
        return [await engine.agenerate([GenRequest(p, max_new_tokens=m)]) for p, m in specs]

    async def both():
        return await asyncio.gather(chain(SPECS[:4]), chain(SPECS[4:]))

    first, second = run_sync(both())
    done = first + second
    assert [c.results[0].token_ids for c in done] == refs
    shares = sum((c.stats.target_forwards for c in done), 0)
    assert shares == engine.target.forwards - forwards
    assert sum(c.stats.target_rows for c in done) == engine.target.rows - rows
    assert sum(c.stats.generated_tokens for c in done) == sum(map(len, refs))
    assert engine.total_stats.target_forwards == shares
    # The synchronous call works on the same engine once the awaited ones are done.
    assert engine.generate([GenRequest("the cat", max_new_tokens=18)])[0].token_ids == refs[0]


def test_apportion_adds_up():
    assert apportion(7, [1, 1, 1]) == [3, 2, 2]
    assert apportion(1, [1, 3]) == [0, 1]
    assert apportion(10, [5, 0, 5]) == [5, 0, 5]
    assert sum(apportion(13, [3, 4, 2, 9])) == 13
    # Carrying what each was owed, equal callers take turns at one-unit steps.
    owed, got = [0.0, 0.0, 0.0], [0, 0, 0]
    for _ in range(30):
        parts = apportion(1, [1, 1, 2], owed)
        for i, (w, part) in enumerate(zip([1, 1, 2], parts)):
            owed[i] += w / 4 - part
            got[i] += part
    assert got == [8, 7, 15]  # 7.5, 7.5 and 15 exactly


PROBLEMS = [
    Problem(id=f"p{i}", question=q, gold="0")
    for i, q in enumerate(["Tom has 3 apples and buys 4 more.", "A box holds 6 eggs.", "Sam runs 2 miles.", "x"])
]


def trees_at(engine: Engine, concurrency: int, temperature: float) -> dict[str, str]:
    gen = GenSettings(temperature, max_thought_tokens=12, max_eval_tokens=6, eval_temperature=temperature)
    task = GSM8K(thoughts="subquestions", depth=2, value="sampled")
    search = BFS.over(task, BFSSettings(n_thoughts=3, breadth=2), gen, seed=5)
    trees: dict[str, str] = {}

    async def one(problem: Problem) -> None:
        trees[problem.id] = json.dumps((await search.solve(problem, engine)).tree.to_dict(), sort_keys=True)

    run_sync(solve_all(PROBLEMS, one, concurrency))
    return trees


@pytest.mark.parametrize(
    "name, temperature",
    [("ar", 0.0), ("seed_stand", 0.0), ("ar", 0.8), ("seed_stand", 0.8)],
    ids=["ar-greedy", "seed_stand-greedy", "ar-sampled", "seed_stand-sampled"],
)
def test_same_trees_whatever_the_concurrency(name, temperature, loaded, perturbed):
    """Four problems one at a time and all at once give the same trees (per-request seeds, logits that
    do not depend on the batch), and the concurrent run fills the forwards more."""
    alone = engine_for(name, loaded, perturbed)
    together = engine_for(name, loaded, perturbed)
    assert trees_at(alone, 1, temperature) == trees_at(together, 4, temperature)
    assert together.total_stats.rows_per_forward > alone.total_stats.rows_per_forward


@pytest.mark.parametrize("name", ["ar", "seed_stand"])
def test_a_failed_search_leaves_a_clean_engine(name, tiny_model, tokenizer, loaded, perturbed):
    """A search that fails while other calls decode cancels them; the engine's next calls decode on a
    clean batch (nothing of the abandoned sequences left over) with the same greedy outputs."""
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in SPECS]
    engine = engine_for(name, loaded, perturbed)

    async def failing():
        await engine.agenerate([GenRequest("a", max_new_tokens=2)])
        raise RuntimeError("a task's parser failed")

    async def both():
        await asyncio.gather(engine.agenerate([GenRequest("the cat", max_new_tokens=40)]), failing())

    with pytest.raises(RuntimeError, match="parser failed"):
        run_sync(both())
    assert not engine.decoder.busy

    async def again():
        return await engine.agenerate([GenRequest(p, max_new_tokens=m) for p, m in SPECS])

    assert [r.token_ids for r in run_sync(again()).results] == refs
    assert [r.token_ids for r in engine.generate([GenRequest(p, max_new_tokens=m) for p, m in SPECS])] == refs


@pytest.mark.parametrize("forward", ["unpadded", "bucketed"])
@pytest.mark.parametrize("rule", ["match_gumbel", "match_multinomial"])
@pytest.mark.parametrize("name", list(DECODERS))
def test_sampled_outputs_are_plain_decodings_samples(name, rule, forward, request):
    """At temperature > 0 (with top-k and top-p) every decoder, rows joining mid-decode, returns the
    very tokens `hf` samples for the same request seeds under each matched rule (match_gumbel, the
    default, and match_multinomial): what was drafted, and what else ran, changes no output; also
    through the bucketed forward (`hf` there runs the unpadded model: the reference stays plain)."""
    loaded, perturbed = models(request, forward)
    specs = [(p, m, 0.9, 40, 0.95) for p, m in SPECS] + [("the cat", 30, 1.3, 0, 1.0)]
    requests = [
        GenRequest(p, max_new_tokens=m, temperature=t, top_k=k, top_p=q, seed=i)
        for i, (p, m, t, k, q) in enumerate(specs)
    ]
    hf = engine_for("hf", request.getfixturevalue("loaded"), None, rule)
    plain = [r.token_ids for r in hf.generate(requests)]
    assert len({tuple(t) for t in plain}) == len(plain)
    engine = engine_for(name, loaded, perturbed, rule)

    async def staggered():
        async def later(i, r):
            for _ in range(8 * i):  # joins after others have taken some steps
                await asyncio.sleep(0)
            return (await engine.agenerate([r])).results[0].token_ids

        return await asyncio.gather(*(later(i, r) for i, r in enumerate(requests)))

    assert run_sync(staggered()) == plain
    if name in ("sd", "seed"):  # (the model-free drafters find little to accept in this random text)
        assert engine.total_stats.accepted_tokens > 0  # drafts were accepted, and changed nothing


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("name", ["ar", "seed_stand", "seed"])
def test_the_kv_memory_bounds_the_sequences_decoding_at_once(name, paged, loaded, perturbed):
    """With room in model.kv_memory for any two sequences, the others wait their turn (counted in
    kv_waits) and every output is what the unbounded engine gives; a budget too small for one
    sequence is one error naming the settings. Rows of their own: a third never fits. Paged, the
    sequences in flight never need more blocks than the budget holds (a short one may join two). Paging
    is the CPU attention's (it reads rows through their block tables): on a GPU rows keep their own."""
    loaded = dataclasses.replace(loaded, paged_kv=paged)
    paged = paged and loaded.device.type == "cpu"
    requests = [GenRequest(p, max_new_tokens=m) for p, m in SPECS]
    free = engine_for(name, loaded, perturbed)
    expected = [r.token_ids for r in free.generate(requests)]
    seqs = [free._sequence(r) for r in requests]
    max_nodes = free.decoder.drafter.max_nodes
    two = max(pool_bytes(free.target.kv_layout, needs([a, b], max_nodes)) for a, b in itertools.combinations(seqs, 2))
    bounded = engine_for(name, dataclasses.replace(loaded, kv_budget=two), perturbed)
    assert (bounded.target.pool is not None) == paged
    decoder = bounded.decoder
    decoder.admit([bounded._sequence(r) for r in requests])
    most = waits = 0
    while decoder.busy:
        waits += decoder.step().cost.kv_waits
        live = [slot.seq for slot in decoder.rounds.live.values()]
        assert not live or pool_bytes(bounded.target.kv_layout, needs(live, max_nodes)) <= two
        most = max(most, decoder.live)
    assert most == 2 if not paged else 2 <= most < len(requests)
    assert waits >= len(requests) - most
    assert [r.token_ids for r in bounded.generate(requests)] == expected
    tiny = engine_for(name, dataclasses.replace(loaded, kv_budget=1024), perturbed)
    with pytest.raises(BackendError, match=r"MB of KV cache .* raise model.kv_memory or model.kv_memory_mb"):
        tiny.generate(requests[:1])
