"""Paged KV (decoding/runtime/paged_kv.py): blocks held by count and given back, copy on write at the
first divergent token, the prefix store's blocks under its budget, a row's logits the same bits
whoever shares its blocks, and every decoder's tokens `hf`'s with rows sharing a prompt."""

from __future__ import annotations

import inspect
import logging
import threading

import pytest
import torch
from conftest import DEVICE
from test_continuous import engine_for

from decoding.api.kinds import DECODERS
from decoding.base.values import GenRequest
from decoding.runtime.kv_bytes import Need, pool_bytes
from decoding.runtime.kv_cache import shared_reads
from decoding.runtime.memory import MemoryBudget
from decoding.runtime.paged_kv import BLOCK, BlockPool, siblings_of
from decoding.runtime.prefix_cache import PrefixCache
from decoding.runtime.runner import ModelRunner, _rows_of_their_own
from decoding.schedules.admission import rows_that_fit
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.verify import pack

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="paged KV is the CPU layers' layout")

# ToT's shape: a question long enough for whole shared blocks, four samples of one state and two
# evaluations of it.
QUESTION = "Q: what is the sum of the first few numbers we count with? Think step by step. " * 3
PROMPTS = [QUESTION + "Step 1:"] * 4 + [QUESTION + "Evaluate: sure", QUESTION + "Evaluate: maybe"]


def test_blocks_are_held_by_count_and_go_back_lowest_first():
    pool = BlockPool(2, 2, 16, torch.bfloat16, "cpu")
    a = pool.take(3)
    assert a == [1, 2, 3] and pool.used == 3  # block 0 is the null block, never handed out
    pool.hold([2, 2])
    pool.drop([2])
    assert pool.used == 3 and int(pool.refs[2]) == 2
    pool.drop([2, 2, 3])
    assert pool.used == 1 and pool.take(2) == [2, 3]  # freed blocks come back lowest first
    many = pool.take(60)  # past its 16 blocks: the pool grows, keeping what its blocks hold
    pool.keys[0][1].fill_(7)
    more = pool.take(40)
    assert pool.keys[0][1].eq(7).all()
    pool.drop(many + more)
    assert pool.used == 3 and pool.trim() and pool.blocks < 64 and pool.keys[0][1].eq(7).all()
    with pytest.raises(AssertionError, match="let go more often"):
        pool.drop([1, 1])


def test_siblings_are_set_where_most_is_read_once():
    """Eight samples of one state hold its 10 blocks, four evaluations only the question's first 3 with
    them: two sets of siblings (the samples reading their whole prompt once, the evaluations the
    question), not one set reading the question alone."""
    tables = torch.zeros(12, 16, dtype=torch.long)
    tables[:, :3] = torch.tensor([1, 2, 3])
    tables[:8, 3:10] = torch.arange(4, 11)
    tables[torch.arange(12), torch.tensor([10] * 8 + [3] * 4)] = torch.arange(100, 112)  # each its own next
    lens = torch.tensor([10 * BLOCK + 5] * 8 + [3 * BLOCK + 20] * 4)
    siblings = siblings_of(tables.numpy(), lens.numpy())
    assert siblings is not None
    assert siblings[:8, 1].tolist() == [10 * BLOCK] * 8 and siblings[8:, 1].tolist() == [3 * BLOCK] * 4
    assert siblings[:8, 0].unique().numel() == 1 and siblings[8:, 0].unique().numel() == 1
    assert siblings[0, 0] != siblings[8, 0]
    one = torch.stack([torch.ones(12, dtype=torch.long), torch.full((12,), 3 * BLOCK)], 1)
    assert shared_reads(siblings) > shared_reads(one)
    assert siblings_of(tables[:1].numpy(), lens[:1].numpy()) is None


def _prefilled(runner: ModelRunner, rows: int, n: int):
    """A cache of `rows` rows whose row 0 holds n computed positions."""
    cache = runner.new_cache(rows, n + 8)
    tokens = torch.arange(3, 3 + n)[None] % runner.vocab_size
    runner.forward(cache, tokens, torch.ones(n, n, dtype=torch.bool).tril()[None], torch.arange(n)[None], rows=[0])
    cache.advance(torch.tensor([n] + [0] * (rows - 1)))
    return cache


def test_a_write_into_a_shared_block_copies_it_first(loaded):
    """Rows given a prefix hold its blocks; the first forward writing into one (the partial last block)
    takes a copy holding the same positions, and the row it came from keeps its bits."""
    runner = ModelRunner(loaded.model)
    n = 2 * BLOCK - BLOCK // 2  # two blocks, the second partial
    cache = _prefilled(runner, 2, n)
    before = cache.read(0, 0, n)
    cache.copy_prefix(cache, 0, [1], n)
    assert torch.equal(cache.tables[0, :2], cache.tables[1, :2]) and runner.pool.used == 2
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    runner.forward(cache, torch.tensor([[5]]), one, torch.zeros(1, 1, dtype=torch.long), rows=[1])
    assert cache.tables[0, 0] == cache.tables[1, 0] and cache.tables[0, 1] != cache.tables[1, 1]
    assert runner.pool.used == 3
    after, copied = cache.read(0, 0, n), cache.read(1, 0, n)
    for a, b, c in zip(before[0] + before[1], after[0] + after[1], copied[0] + copied[1]):
        assert torch.equal(a, b) and torch.equal(a, c)
    cache.clear([0, 1])
    assert runner.pool.used == 0


def test_a_rows_logits_have_the_same_bits_paged_and_in_rows_of_their_own(loaded):
    """ToT-shaped rows admitted and verified with a draft tree: the paged cache (blocks shared, read
    once for a group) and rows of their own give every logit the same bits."""
    tok = loaded.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    tree = DraftTree()
    tree.add(tree.add(11, ROOT), 0)
    tree.add(12, ROOT)
    out = []
    for paged in (True, False):
        runner = ModelRunner(loaded.model, paged=paged)
        assert (runner.pool is not None) == paged
        cache = runner.new_cache(len(prompts), 64)
        admitted = runner.admit(cache, list(range(len(prompts))), prompts, room=16)
        scored = runner.score(cache, pack(admitted.pending, [tree] * len(prompts)))
        out.append((scored.logits, scored.reads))
    (paged_logits, paged_reads), (own_logits, own_reads) = out
    assert all(torch.equal(a, b) for a, b in zip(paged_logits, own_logits, strict=True))
    assert paged_reads[0] == own_reads[0] and paged_reads[1] >= 5 * BLOCK  # the question's blocks, once


def test_the_stores_blocks_count_against_its_budget_once_no_row_holds_them(loaded):
    """A block the store and a row hold counts against the KV pool; once the row lets go, against
    the store's budget; past it the least recently used leaves go and their blocks back to the pool."""
    runner = ModelRunner(loaded.model)
    pool = runner.pool
    store = runner.prefixes = PrefixCache(MemoryBudget(5 * pool.block_bytes), pool)
    cache = _prefilled(runner, 1, 4 * BLOCK)
    runner.remember(cache, 0, list(range(4 * BLOCK)))
    assert store.nbytes == 0 and pool.used == 4  # the row holds them too
    runner.release(cache, [0])
    assert store.nbytes == 4 * pool.block_bytes and pool.used == 4
    other = _prefilled(runner, 1, 3 * BLOCK)
    runner.remember(other, 0, list(range(1000, 1000 + 3 * BLOCK)))
    assert store.sequences() == [tuple(range(4 * BLOCK)), tuple(range(1000, 1000 + 3 * BLOCK))]
    runner.release(other, [0])
    # 7 blocks the store alone holds, 5 allowed: the older sequence went, its blocks to the pool
    assert store.sequences() == [tuple(range(1000, 1000 + 3 * BLOCK))]
    assert store.nbytes == 3 * pool.block_bytes and pool.used == 3
    match = store.match(tuple(range(1000, 1000 + 2 * BLOCK + 5)))
    row = runner.new_cache(1, 4 * BLOCK)
    store.restore(match, row, 0, 0, match.length)  # by reference: nothing copied, nothing taken
    assert pool.used == 3 and int(row.lens[0]) == 2 * BLOCK + 5
    store.clear()
    row.clear([0])
    assert pool.used == 0


def _waits_for(lock, call) -> bool:
    """Whether `call`, run in another thread while this one holds `lock`, waits for it."""
    done = threading.Event()
    with lock:
        thread = threading.Thread(target=lambda: (call(), done.set()))
        thread.start()
        waited = not done.wait(0.2)
    thread.join(5)
    return waited and done.is_set()


def test_another_thread_reads_the_counts_and_the_stores_under_their_locks(loaded, perturbed):
    """With `seed.overlap` a drafting thread admits into the draft model's store and evicts across the
    budget it shares with the target's, while the main thread grows the target's pool (it once read
    the counts between the pool's two resized tensors): every read and change waits for the locks."""
    target = ModelRunner(loaded.model)
    draft = ModelRunner(perturbed.model, target.prefixes.budget)
    pool, budget = target.pool, target.prefixes.budget
    assert _waits_for(pool.lock, pool.held_by_store_alone)
    assert _waits_for(pool.lock, lambda: pool.used)
    assert _waits_for(pool.lock, pool.shared)
    assert _waits_for(budget.lock, budget.make_room)
    assert _waits_for(budget.lock, lambda: target.prefixes.match((1, 2, 3)))
    assert _waits_for(budget.lock, lambda: draft.admit(draft.new_cache(1, 16), [0], [[5, 6, 7, 8]], 4))
    assert not _waits_for(threading.Lock(), lambda: None)  # the probe itself can tell


def test_admission_counts_a_prompts_shared_blocks_once(loaded):
    """Under one `model.kv_memory`, the samples of one state (a 350-token prompt, room for 80 more)
    fit 3x as many in flight paged as with a copy per row: the prompt's whole blocks count once, each
    sample adds its own; a copy per row is 431 positions a row."""
    prompt = tuple(range(3, 353))
    sample = Need(len(prompt), 80, prompt)
    own = ModelRunner(loaded.model, paged=False, kv_budget=1)
    own.kv_budget = pool_bytes(own.kv_layout, [sample] * 8)  # room for 8 rows of their own
    paged = ModelRunner(loaded.model, kv_budget=own.kv_budget)
    assert rows_that_fit(own.kv_layout, own.kv_budget, [], [sample] * 100) == 8
    whole, own_blocks = 349 // BLOCK, -(-431 // BLOCK) - 349 // BLOCK
    fit = (own.kv_budget // paged.pool.block_bytes - whole) // own_blocks
    assert rows_that_fit(paged.kv_layout, paged.kv_budget, [], [sample] * 100) == fit >= 24
    # Prompts that share nothing count every block: no more than rows of their own, give or take a block.
    strangers = [Need(350, 80, tuple(range(i, i + 350))) for i in range(100)]
    assert rows_that_fit(paged.kv_layout, paged.kv_budget, [], strangers) in (7, 8)
    assert pool_bytes(paged.kv_layout, [sample] * 8) == (whole + 8 * own_blocks) * paged.pool.block_bytes


@pytest.mark.parametrize("name", list(DECODERS))
def test_every_decoder_gives_hfs_tokens_with_rows_sharing_a_prompt_and_leaves_no_block_held(
    name, loaded, perturbed, make_engine
):
    """Greedy, every decoder on ToT-shaped rows whose prompt blocks are shared: `hf`'s tokens; after
    the run no row holds a block (the store's alone are held), and none once the store is cleared."""
    requests = [GenRequest(p, max_new_tokens=10) for p in PROMPTS]
    reference = [r.token_ids for r in make_engine("hf").generate(requests)]
    engine = engine_for(name, loaded, perturbed)
    assert [r.token_ids for r in engine.generate(requests)] == reference
    runners = [engine.target, getattr(engine.decoder.drafter, "model", None)]
    for runner in [r for r in runners if isinstance(r, ModelRunner) and r.pool is not None]:
        pool = runner.pool
        assert pool.used == int((pool.stored > 0).sum()), f"{name}: a row still holds blocks"
        runner.prefixes.clear()
        assert pool.used == 0


def test_a_paged_layout_that_cannot_be_used_says_why(loaded, bucketed, caplog):
    """model.paged_kv=true where the forward reads rows of their own (here the bucketed forward; on a
    GPU every forward) is one log line naming the reason, not a silent change of layout."""
    with caplog.at_level(logging.INFO, logger="decoding.runtime.runner"):
        assert ModelRunner(loaded.model).pool is not None
        assert not caplog.records
        assert ModelRunner(bucketed.model, static=bucketed.static, paged=True).pool is None
    assert [r.getMessage() for r in caplog.records] == [
        "model.paged_kv: KV in rows of their own, not in shared blocks: the bucketed forward (model.cuda_graphs) "
        "reads rows of their own"
    ]
    assert "on cuda" in _rows_of_their_own(True, False, torch.device("cuda"))
    assert "transformers' own forward" in _rows_of_their_own(False, False, torch.device("cpu"))


def test_both_layouts_implement_the_kv_cache_interface(loaded):
    """`KVCache` is what every signature names: rows of their own and paged blocks each implement all
    of it, with its parameters (names and defaults) as the protocol declares them."""
    from decoding.runtime.kv_cache import KVCache, RowKVCache
    from decoding.runtime.paged_kv import PagedKVCache

    caches = [ModelRunner(loaded.model).new_cache(2, 64), ModelRunner(loaded.model, paged=False).new_cache(2, 64)]
    assert [type(c) for c in caches] == [PagedKVCache, RowKVCache]
    declared = {n: m for n, m in vars(KVCache).items() if not n.startswith("_") or n == "__len__"}
    methods = {n: m for n, m in declared.items() if inspect.isfunction(m)}
    properties = {n for n, m in declared.items() if isinstance(m, property)}
    assert {"prepare", "advance", "commit", "copy_prefix", "restore"} <= set(methods) and "nbytes" in properties
    for cache in caches:
        assert isinstance(cache, KVCache)
        for name in [*KVCache.__annotations__, *properties]:  # attributes or properties alike
            assert hasattr(cache, name), f"{type(cache).__name__} has no {name}"
        for name, method in methods.items():
            want = [(p.name, p.default) for p in inspect.signature(method).parameters.values()]
            got = [(p.name, p.default) for p in inspect.signature(getattr(type(cache), name)).parameters.values()]
            assert got == want, f"{type(cache).__name__}.{name}{got} against KVCache's {want}"
