"""KV in blocks shared by reference: a model's pool of blocks, rows as tables of blocks, and the
prefix store's segments holding blocks too.

A block holds BLOCK positions of every layer's keys and values. A row is a table naming, for each
BLOCK of its positions, a block of the pool; rows and stored prefixes hold blocks by count. A row
given a prefix (the samples of one ToT state, a prompt found in the prefix store) takes the blocks
that hold it, copying nothing; it writes only into blocks it alone holds: before a forward writes
into a block that another row or the store also holds, the row takes a copy of it (copy on write,
at the first divergent token). A block goes back to the pool when nothing holds it. The CPU
attention (csrc/attention.cpp) reads the rows through their tables, a block shared by several rows
of a forward once for all of them, each query's reductions in position order as for a row of its
own: a token's logits have the same bits whoever shares its blocks.

Only the project's layers read tables (decoding/runtime/llama.py); the runner gives every other
forward (transformers' own, the bucketed GPU forward) the rows of their own in kv_cache.py.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from decoding.runtime.kv_cache import POOL_SLACK, SHARED_BLOCK, ForwardView, KVCache, cache_geometry, moves, reads_of

# The counts and tables are made outside inference mode (where a forward may grow them), so that
# code outside it can change them too.
_bookkeeping = torch.inference_mode(False)
# Positions a block holds: a divisor of the CPU attention's block of positions (csrc/attention.cpp's BL,
# SHARED_BLOCK), which reads a block's positions of one dimension as one 64-byte line. Smaller blocks
# waste less where sequences part mid-block (the store's short edges, a row's last block), larger ones
# read longer runs.
BLOCK = 32
NULL = 0  # the block a table names where a row has none: never handed out, never written


class BlockPool:
    """Keys/values in blocks [N, H_kv, BLOCK, D] per layer (keys stored [N, H_kv, D, BLOCK], seen
    transposed: the attention reads a block's positions of one dimension as a vector), and per
    block how many hold it (`refs`) and how many of those are the prefix store's (`stored`).

    Blocks are handed out lowest first, so the pool's tail empties and can be given back. Every
    change of the counts runs under the pool's lock: a drafting thread (`seed.overlap`) may admit
    and release rows of a draft model's pool while the main thread runs."""

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.shape = (n_layers, n_kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.refs = torch.zeros(0, dtype=torch.int32)
        self.stored = torch.zeros(0, dtype=torch.int32)
        self._free: list[int] = []  # a heap of free block ids
        self.lock = threading.RLock()  # reentrant: `take` reads `used` under it
        self.peak_used = 0
        self._resize(16)
        self.refs[NULL] = 1  # held forever: never handed out
        self._free.remove(NULL)
        heapq.heapify(self._free)

    @classmethod
    def for_model(cls, config: object, dtype: torch.dtype, device: torch.device | str) -> BlockPool:
        return cls(*cache_geometry(config), dtype, device)

    @property
    def blocks(self) -> int:
        return self.refs.shape[0]

    @property
    def block_bytes(self) -> int:
        n_layers, n_kv, head_dim = self.shape
        return 2 * n_layers * n_kv * head_dim * BLOCK * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def used(self) -> int:
        """Blocks held by a row or the store (the null block not counted)."""
        with self.lock:
            return int((self.refs > 0).sum()) - 1

    def held_by_store_alone(self) -> int:
        """Blocks only the prefix store holds (what counts against `model.prefix_memory`). Read under
        the lock: another thread's `take` may be growing the counts, one tensor after the other."""
        with self.lock:
            stored = self.stored.numpy()
            return int(np.count_nonzero((stored > 0) & (self.refs.numpy() == stored)))

    def shared(self) -> int:
        """Blocks held by more than one row."""
        with self.lock:
            return int(np.count_nonzero((self.refs.numpy() - self.stored.numpy()) > 1))

    def take(self, n: int) -> list[int]:
        """n fresh blocks, each held once."""
        with self.lock:
            if len(self._free) < n:  # a quarter more: what the pool holds past its blocks in use stays small
                self._resize(max(self.blocks + self.blocks // 4, self.blocks + n - len(self._free)))
            ids = [heapq.heappop(self._free) for _ in range(n)]
            refs = self.refs.numpy()
            refs[ids] = 1
            self.peak_used = max(self.peak_used, int(np.count_nonzero(refs)) - 1)
            return ids

    def hold(self, ids: torch.Tensor | list[int], stored: bool = False) -> None:
        """One more holder of each of `ids` (repeats count), the store if `stored`."""
        held = _held(ids)
        with self.lock:
            np.add.at(self.refs.numpy(), held, 1)
            if stored:
                np.add.at(self.stored.numpy(), held, 1)

    def drop(self, ids: torch.Tensor | list[int], stored: bool = False) -> None:
        """One holder fewer of each of `ids`; a block nothing holds goes back to the pool."""
        held = _held(ids)
        if not len(held):
            return
        with self.lock:
            refs = self.refs.numpy()
            np.subtract.at(refs, held, 1)
            if stored:
                np.subtract.at(self.stored.numpy(), held, 1)
            assert int(refs[held].min()) >= 0, "a block was let go more often than it was held"
            for b in np.unique(held[refs[held] == 0]).tolist():
                heapq.heappush(self._free, b)

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Blocks `dst` take the contents of blocks `src`."""
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for t in self.keys + self.values:
            t[d] = t[s]

    def trim(self, slack: float = POOL_SLACK) -> bool:
        """Give back the free tail once the pool holds more than `slack` times the blocks up to its
        last held one; whether it shrank."""
        with self.lock:
            nonzero = np.flatnonzero(self.refs.numpy())  # a call each step: numpy's, a tenth of torch's
            held = int(nonzero[-1]) + 1 if len(nonzero) else 0
            if self.blocks <= slack * max(held, 16):
                return False
            self._resize(max(2 * held, 16))
            return True

    @_bookkeeping
    def _resize(self, n: int) -> None:
        """n blocks, keeping what the first ones hold (the caller vouches no block past n is held)."""
        n_layers, n_kv, head_dim = self.shape
        old, keep = self.blocks, min(n, self.blocks)

        def resized(t: torch.Tensor | None, by_position: bool) -> torch.Tensor:
            store = (n, n_kv, head_dim, BLOCK) if by_position else (n, n_kv, BLOCK, head_dim)
            out = torch.zeros(store, dtype=self.dtype, device=self.device)
            if t is not None:
                out[:keep] = t.transpose(2, 3)[:keep] if by_position else t[:keep]
            return out.transpose(2, 3) if by_position else out

        # Layer after layer, each old tensor let go before the next is made: the copy needs one layer more.
        if not self.keys:
            self.keys, self.values = [None] * n_layers, [None] * n_layers  # type: ignore[list-item]  # each filled just below
        for i in range(n_layers):
            self.keys[i] = resized(self.keys[i], True)
            self.values[i] = resized(self.values[i], False)
        grow = torch.zeros(max(0, n - old), dtype=torch.int32)
        self.refs = torch.cat([self.refs[:keep], grow])
        self.stored = torch.cat([self.stored[:keep], grow])
        self._free = [b for b in self._free if b < n] + list(range(old, n))
        heapq.heapify(self._free)


@dataclass(eq=False)
class _Tables:
    """A cache's tables, apart from it so that what they hold is let go when the cache is collected."""

    tables: torch.Tensor  # [rows, blocks] int64 block ids, NULL where a row has none

    def release(self, pool: BlockPool) -> None:
        pool.drop(self.tables[self.tables != NULL])
        self.tables.zero_()


class PagedKVCache:
    """Rows of a BlockPool: per row a table of blocks and a committed length. The `KVCache` interface
    as kv_cache.RowKVCache (the decoders and the runner see no difference), its memory in blocks."""

    spare = 0  # no bucketed forward runs over it
    graphs: dict[tuple[Any, ...], object] | None = None  # (none: its forwards are never captured)

    @_bookkeeping
    def __init__(self, pool: BlockPool, batch: int, capacity: int) -> None:
        self.pool = pool
        self.device = pool.device
        self._own = _Tables(torch.zeros(batch, _width(capacity), dtype=torch.long))
        self.lens = torch.zeros(batch, dtype=torch.long)
        weakref.finalize(self, _Tables.release, self._own, pool)

    @property
    def tables(self) -> torch.Tensor:
        return self._own.tables

    @property
    def keys(self) -> list[torch.Tensor]:
        return self.pool.keys

    @property
    def values(self) -> list[torch.Tensor]:
        return self.pool.values

    @property
    def batch(self) -> int:
        return self.lens.shape[0]

    @property
    def capacity(self) -> int:
        return self.tables.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        """What its rows hold: each block once (the pool's other blocks are free, or the store's)."""
        return self.blocks_held()[0] * self.pool.block_bytes

    def blocks_held(self, rows: list[int] | None = None) -> tuple[int, int]:
        """(distinct blocks the rows hold, of them held by more than one of the rows)."""
        t = self.tables.numpy() if rows is None else self.tables.numpy()[rows]
        # Holders per block by counting (a forward asks for its peak: torch's unique sorted the tables).
        counts = np.bincount(t[t != NULL])
        return int(np.count_nonzero(counts)), int(np.count_nonzero(counts > 1))

    def prepare(self, n_new: int, offset: int = 0, rows: list[int] | None = None, gather: bool = True) -> ForwardView:
        """The next forward's view (as RowKVCache.prepare): each row's blocks for its new slots taken,
        or copied where another holder has them (copy on write), and its table for the attention."""
        # Through numpy views of the host tables, the view's tensors made from its arrays at the end:
        # torch's per-call cost on these small arrays was a millisecond a step at 32 rows.
        order = np.arange(self.batch) if rows is None else np.asarray(rows, dtype=np.int64)
        lens, table_all = self.lens.numpy(), self.tables.numpy()
        host = lens[order]
        need = int(host.max()) + offset + n_new
        if need > self.capacity:
            raise RuntimeError(f"KV cache holds {self.capacity} positions, a forward needs {need}")
        firsts, ends = (host + offset) // BLOCK, (host + offset + n_new + BLOCK - 1) // BLOCK
        held = table_all[order, : int(ends.max())]
        cols = np.arange(held.shape[1])
        span = (cols >= firsts[:, None]) & (cols < ends[:, None])
        # Most steps every row already holds its blocks alone: one pass finds the rows that do not.
        short = (span & ((held == NULL) | (self.pool.refs.numpy()[held] > 1))).any(1)
        for b in np.flatnonzero(short).tolist():
            self._own_blocks(int(order[b]), int(firsts[b]), int(ends[b]))
        slots = host[:, None] + offset + np.arange(n_new)
        tables = table_all[order, : _width(need)]
        where = (np.take_along_axis(tables, slots // BLOCK, 1), slots % BLOCK)
        share = siblings_of(tables, host)
        return ForwardView(
            self,
            torch.from_numpy(host),
            torch.from_numpy(slots),
            offset,
            need,
            torch.from_numpy(order),
            gather,
            None,
            share,
            reads_of(host, share),
            tables=torch.from_numpy(tables),
            where=(torch.from_numpy(where[0]), torch.from_numpy(where[1])),
        )

    def reads(self, rows: list[int] | None = None) -> tuple[int, int]:
        """A forward over `rows` (None: all): the committed positions they attend, and of them those
        read from a sibling's blocks."""
        if rows is not None and len(rows) == 1:  # no sibling: a row's own length (a tenth of the general case)
            return int(self.lens[rows[0]]), 0
        lens, table_all = self.lens.numpy(), self.tables.numpy()
        host = lens if rows is None else lens[rows]
        tables = table_all if rows is None else table_all[rows]
        return reads_of(host, siblings_of(tables[:, : _width(int(host.max()) + 1)], host))

    def _own_blocks(self, row: int, first: int, end: int) -> None:
        """Row `row` alone holds its blocks first..end - 1 (taken fresh, or copied from a shared one)."""
        table = self.tables.numpy()[row]
        ids = table[first:end]
        fresh = np.flatnonzero(ids == NULL)
        shared = np.flatnonzero((ids != NULL) & (self.pool.refs.numpy()[ids] > 1))
        if not len(fresh) and not len(shared):
            return
        new = self.pool.take(len(fresh) + len(shared))
        if len(shared):
            old = ids[shared].tolist()
            self.pool.copy(old, new[len(fresh) :])
            self.pool.drop(old)
        table[first + np.concatenate([fresh, shared])] = new

    def advance(self, counts: torch.Tensor) -> None:
        self.lens += counts.cpu()

    def commit(self, row: int, new_indices: list[int]) -> None:
        """Commit the given new entries of one row, moved to be contiguous (in blocks it alone holds:
        the forward that wrote them took them). Blocks past the committed positions (a rejected
        tree's, a left-padded prefill's) go back."""
        self.commit_rows([row], [new_indices])

    def commit_rows(self, rows: list[int], new_indices: list[list[int]]) -> None:
        """`commit` for many rows at once: one move per layer, one pass over their tables."""
        moved = moves(rows, new_indices, self.lens)
        if moved is not None:
            moved_rows, src, dst = moved
            table = self.tables
            sb, so = table[moved_rows, src // BLOCK], src % BLOCK
            db, do = table[moved_rows, dst // BLOCK], dst % BLOCK
            for k, v in zip(self.pool.keys, self.pool.values):
                k[db, :, do] = k[sb, :, so]
                v[db, :, do] = v[sb, :, so]
        # Through numpy views of the host tables: a call costs a tenth of torch's, and these few
        # calls made most of a one-row step's bookkeeping (0.25 ms).
        lens_all, table_all = self.lens.numpy(), self.tables.numpy()
        if len(rows) == 1:  # one row (a sequence alone): its own entries, a third of the general case
            row = rows[0]
            lens_all[row] += len(new_indices[0])
            tail = table_all[row, (int(lens_all[row]) + BLOCK - 1) // BLOCK :]
            if tail.any():  # NULL is 0
                self.pool.drop(tail.copy())
                tail[:] = NULL
            return
        index = np.asarray(rows)
        lens_all[index] += [len(i) for i in new_indices]  # one entry a row (np.add.at: 50 us a call)
        tables = table_all[index]
        past = np.arange(tables.shape[1]) >= (lens_all[index, None] + BLOCK - 1) // BLOCK
        if tables[past].any():  # NULL is 0
            self.pool.drop(tables[past])
            table_all[index] = np.where(past, NULL, tables)

    @_bookkeeping
    def reserve(self, batch: int, capacity: int) -> None:
        """At least `batch` rows of `capacity` positions (tables only: blocks are taken as rows fill)."""
        rows, width = self.tables.shape
        if batch > rows or _width(capacity) > width:
            grown = torch.zeros(max(batch, rows), max(_width(capacity), width), dtype=torch.long)
            grown[:rows, :width] = self.tables
            self._own.tables = grown
            self.lens = torch.cat([self.lens, self.lens.new_zeros(max(0, batch - rows))])

    @_bookkeeping
    def give_back(self, batch: int, capacity: int, slack: float = POOL_SLACK) -> bool:
        """Rows past `batch` let go of their blocks and go; the pool gives back its free tail once it
        holds far more than its rows and the store hold; whether memory went back."""
        if batch < self.batch:
            self.clear(list(range(batch, self.batch)))
            self._own.tables = self.tables[:batch].clone()
            self.lens = self.lens[:batch].clone()
        return self.pool.trim(slack)

    def copy_prefix(self, src: KVCache, src_row: int, rows: list[int], n: int, share: bool = True) -> None:
        """Rows `rows` become the first n committed positions of `src`'s row src_row: by reference to
        its blocks (a cache of this pool, `share`), else copies in fresh blocks."""
        assert src is not self or src_row not in rows, "a row cannot take its own prefix"
        self.clear(rows)
        k = blocks_for(n)
        if isinstance(src, PagedKVCache) and src.pool is self.pool:
            ids = src.tables[src_row, :k]
            if share:
                for row in rows:
                    self.tables[row, :k] = ids
                self.pool.hold(ids.repeat(len(rows)))
            else:
                for row in rows:
                    fresh = self.pool.take(k)
                    self.pool.copy(ids.tolist(), fresh)
                    self.tables[row, :k] = torch.tensor(fresh)
        else:  # another layout or pool: its positions copied into fresh blocks
            keys, values = src.read(src_row, 0, n)
            for row in rows:
                self._own_blocks(row, 0, k)
                self._write(row, 0, keys, values)
        self.lens[rows] = n

    def read(self, row: int, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values of positions [start, end) of a row, per layer [H_kv, n, D] (copies)."""
        return _read(self.pool, self.tables[row], start, end)

    def _write(self, row: int, start: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Positions start.. of a row (in blocks it alone holds) take these keys and values [H_kv, n, D]."""
        slots = torch.arange(start, start + keys[0].shape[1])
        blocks, offsets = self.tables[row, slots // BLOCK], slots % BLOCK
        for dst, src in zip(self.pool.keys + self.pool.values, keys + values):
            dst[blocks, :, offsets] = src.transpose(0, 1)

    def share(self, rows: list[int], n: int, siblings: int | None = None) -> None:
        """Rows hold the same first n positions (the caller vouches for it): they take the first row's
        blocks of them, letting go of their own."""
        k = blocks_for(n)
        ids = self.tables[rows[0], :k].clone()
        for row in rows[1:]:
            self.pool.drop(self.tables[row, :k])
            self.tables[row, :k] = ids
        self.pool.hold(ids.repeat(len(rows) - 1))

    def written(self, rows: list[int], start: int) -> None:
        """(Rewritten positions need no bookkeeping: a row writes only into blocks it alone holds.)"""

    def clear(self, rows: list[int]) -> None:
        """Rows hold nothing: their blocks are let go."""
        t = self.tables[rows]
        self.pool.drop(t[t != NULL])
        self.tables[rows] = NULL
        self.lens[rows] = 0

    def segment(self, row: int, start: int, end: int) -> BlockSegment:
        """Positions [start, end) of a committed row, held by the prefix store (its blocks, by count)."""
        ids = self.tables[row, start // BLOCK : blocks_for(end)].tolist()
        self.pool.hold(ids, stored=True)
        return BlockSegment(self.pool, start, end, ids)

    def restore(self, row: int, pieces: list[tuple[BlockSegment, int, int]], start: int, end: int) -> None:
        """Row `row` takes positions [start, end) from stored segments: (segment, lo, hi) gives [lo, hi)
        of them, in order. The block of a position comes from the last segment holding it: a
        segment's first block also holds the positions before it (the same bits, computed for the
        same tokens), so the deepest one has the whole block."""
        for seg, lo, hi in pieces:
            first, end_block = lo // BLOCK, blocks_for(hi)
            if seg.pool is not self.pool:  # a store of another model's runner: its positions copied
                self._own_blocks(row, first, end_block)
                self._write(row, lo, *seg.read(lo, hi))
                continue
            ids = torch.tensor(seg.ids[first - seg.start // BLOCK : end_block - seg.start // BLOCK], dtype=torch.long)
            old = self.tables[row, first:end_block].clone()
            self.tables[row, first:end_block] = ids
            self.pool.hold(ids)
            self.pool.drop(old)
        self.lens[row] = end

    def __len__(self) -> int:
        return len(self.pool.keys)


@dataclass(eq=False)
class BlockSegment:
    """Positions [start, end) of a stored sequence as the blocks that hold them (the first and last
    possibly partly: a block also holds positions around the segment's), held by the store."""

    pool: BlockPool
    start: int
    end: int
    ids: list[int]

    @property
    def nbytes(self) -> int:
        return len(self.ids) * self.pool.block_bytes

    def split(self, k: int) -> tuple[BlockSegment, BlockSegment]:
        """Its first k positions and the rest, as two segments (a block across the cut held by both)."""
        cut, base = self.start + k, self.start // BLOCK
        head = self.ids[: blocks_for(cut) - base]
        tail = self.ids[cut // BLOCK - base :]
        self.pool.hold(head + tail, stored=True)
        self.release()
        return BlockSegment(self.pool, self.start, cut, head), BlockSegment(self.pool, cut, self.end, tail)

    def release(self) -> None:
        self.pool.drop(self.ids, stored=True)
        self.ids = []

    def read(self, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values of positions [start, end) (inside the segment), per layer [H_kv, n, D]."""
        table = torch.zeros(blocks_for(end), dtype=torch.long)
        table[self.start // BLOCK : self.start // BLOCK + len(self.ids)] = torch.tensor(self.ids, dtype=torch.long)
        return _read(self.pool, table, start, end)


def _read(pool: BlockPool, table: torch.Tensor, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Positions [start, end) of the row with this table, per layer [H_kv, n, D]."""
    slots = torch.arange(start, end)
    blocks, offsets = table[slots // BLOCK], slots % BLOCK
    keys = [k[blocks, :, offsets].transpose(0, 1) for k in pool.keys]
    return keys, [v[blocks, :, offsets].transpose(0, 1) for v in pool.values]


def _held(ids: torch.Tensor | list[int]) -> np.ndarray:
    """Block ids as a flat array, the null block left out (nothing holds it by count)."""
    out = np.asarray(ids, dtype=np.int64).reshape(-1)
    held: np.ndarray = out[out != NULL]
    return held


def blocks_for(positions: int) -> int:
    """Blocks that hold `positions` positions."""
    return -(-positions // BLOCK)


def _width(positions: int) -> int:
    """Table entries for a row of `positions`: the attention reads whole blocks of SHARED_BLOCK."""
    return blocks_for(-(-positions // SHARED_BLOCK) * SHARED_BLOCK)


def siblings_of(tables: np.ndarray, lens: np.ndarray) -> torch.Tensor | None:
    """Siblings [B, 2] for the attention (RowKVCache.siblings' form: an id, the positions every
    sibling holds alike, at most its committed ones); None where no two rows share a block.

    A row has one set of siblings, and a set reads the run of blocks all its members hold, so rows are
    set together where it reads most once: rows sharing a first block, in the order of their tables
    (rows with longer common runs side by side), cut into the consecutive sets that read the most
    positions from a sibling (the samples of one state apart from the evaluations that share only its
    question with them)."""
    if tables.shape[0] < 2:  # no sibling to share with
        return None
    first = tables[:, 0]
    holders = np.bincount(first[first != NULL])
    shared = np.flatnonzero(holders > 1)
    if not len(shared):
        return None
    siblings = torch.full((tables.shape[0], 2), -1, dtype=torch.long)
    siblings[:, 1] = 0
    rows, held = tables.tolist(), lens.tolist()
    for block in shared.tolist():
        members = sorted(np.flatnonzero(first == block).tolist(), key=lambda r: rows[r])
        for part, alike in _best_runs(members, rows, held):
            if len(part) > 1:
                siblings[part, 0] = part[0]
                siblings[part, 1] = alike
    return siblings if bool((siblings[:, 0] >= 0).any()) else None


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and a[n] == b[n]:
        n += 1
    return n


def _best_runs(members: list[int], rows: list[list[int]], lens: list[int]) -> list[tuple[list[int], int]]:
    """`members` (sorted by table) cut into consecutive runs, each with the positions all its rows hold
    alike (at most each one's committed ones), reading the most positions from a sibling: a run of n
    rows reads its common positions, in whole attention blocks, n - 1 times. Sorted tables make a run's
    common blocks the least of its neighbours' (one pass per end of a run)."""
    near = [_common(rows[a], rows[b]) * BLOCK for a, b in itertools.pairwise(members)]
    score, start = [0] * (len(members) + 1), [0] * (len(members) + 1)  # best for the first i, its last run
    for i in range(1, len(members) + 1):
        score[i], start[i] = score[i - 1], i - 1  # the i-th row alone
        alike = lens[members[i - 1]]
        for j in range(i - 2, -1, -1):  # the run members[j:i]
            alike = min(alike, near[j], lens[members[j]])
            if alike < SHARED_BLOCK:  # no longer run shares a whole block: none gains (scores only grow)
                break
            gain = score[j] + (i - j - 1) * (alike // SHARED_BLOCK * SHARED_BLOCK)
            if gain > score[i]:
                score[i], start[i] = gain, j
    runs, i = [], len(members)
    while i:
        j = start[i]
        part = members[j:i]
        alike = min([lens[r] for r in part] + near[j : i - 1])
        runs.append((part, alike))
        i = j
    return runs[::-1]
