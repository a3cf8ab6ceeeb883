"""Per-row KV cache for many sequences with ragged lengths, and its adapter to `transformers`.

This is the one module that knows how `transformers` talks to a cache: during a forward every
attention layer calls `past_key_values.update(key, value, layer_idx)` and attends over what it
returns. We hand it an object with that method which writes the new keys/values after each row's
own committed length in a preallocated buffer and returns the buffer up to the longest row, and we
pass a 4D boolean mask that decides what each new token sees. With the invariant attention
(decoding/runtime/attention.py) a forward over some of the rows reads them in place: the buffer of
all rows is returned and the kernel is told which rows to read. Tested against the pinned
transformers range in tests/test_kv_cache.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

POOL_SLACK = 4.0  # a pool gives memory back once it holds this many times what its live rows need
SHARED_BLOCK = 64  # the CPU attention reads siblings' shared positions in whole blocks of this many (its BL)


class Segment(Protocol):
    """Stored positions of one row (the prefix store's edge): a copy, or blocks held by count."""

    @property
    def nbytes(self) -> int: ...

    def split(self, k: int) -> tuple[Segment, Segment]: ...  # its first k positions and the rest

    def release(self) -> None: ...


@runtime_checkable
class KVCache(Protocol):
    """What the runner, the decoders and the prefix store ask of a KV cache: rows with a committed
    length each, written by a forward through `prepare`'s view and committed by `advance` / `commit`.
    Two layouts implement it: `RowKVCache` (rows of their own, here) and `paged_kv.PagedKVCache`
    (tables of blocks shared by reference); each accounts its own bytes (`nbytes`)."""

    lens: torch.Tensor  # [B] committed positions per row, on the host
    device: torch.device
    spare: int  # rows past the live ones that a bucketed forward's padding writes (0: none)
    graphs: dict[tuple[Any, ...], object] | None  # CUDA graphs captured over it (None: not worth capturing)

    def __len__(self) -> int: ...  # layers

    @property
    def keys(self) -> list[torch.Tensor]: ...  # per layer: [B, H_kv, capacity, D] rows, or the pool's blocks

    @property
    def values(self) -> list[torch.Tensor]: ...

    @property
    def batch(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def reserve(self, batch: int, capacity: int) -> None: ...

    def give_back(self, batch: int, capacity: int, slack: float = POOL_SLACK) -> bool: ...

    def prepare(
        self, n_new: int, offset: int = 0, rows: list[int] | None = None, gather: bool = True
    ) -> ForwardView: ...

    def advance(self, counts: torch.Tensor) -> None: ...

    def commit(self, row: int, new_indices: list[int]) -> None: ...

    def commit_rows(self, rows: list[int], new_indices: list[list[int]]) -> None: ...

    def clear(self, rows: list[int]) -> None: ...

    def copy_prefix(self, src: KVCache, src_row: int, rows: list[int], n: int, share: bool = True) -> None: ...

    def share(self, rows: list[int], n: int, siblings: int | None = None) -> None: ...

    def written(self, rows: list[int], start: int) -> None: ...

    def reads(self, rows: list[int] | None = None) -> tuple[int, int]: ...

    def read(self, row: int, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...

    def segment(self, row: int, start: int, end: int) -> Segment: ...

    def restore(self, row: int, pieces: list[tuple[Any, int, int]], start: int, end: int) -> None: ...


class RowKVCache:
    """Keys/values [B, H_kv, capacity, D] per layer, with a committed length per row.

    A forward writes T new entries per row at slots lens[b] .. lens[b] + T - 1 without committing
    them; `advance` commits a prefix of them and `commit` moves an arbitrary subset (an accepted tree
    path) into place. Uncommitted slots are simply overwritten by the next forward.

    The lengths live on the host (a CPU tensor) whatever the device: the host decides every
    forward's shape from them, and reading them from a GPU would wait for its queue to drain.
    `spare` rows past the B live ones take the writes of a bucketed forward's padding
    (decoding/runtime/static_forward.py): they are never read and never handed to a sequence.
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        keys_by_position: bool = False,
        spare: int = 0,
    ) -> None:
        self.spare = spare
        self.device = torch.device(device)
        batch += spare
        shape = (batch, n_kv_heads, capacity, head_dim)
        if keys_by_position:
            # Stored [B, H_kv, D, capacity] and seen through a transposed view: the invariant
            # attention reads a block of positions of one dimension as a vector, with no transpose.
            store = (batch, n_kv_heads, head_dim, capacity)
            self.keys = [torch.zeros(store, dtype=dtype, device=device).transpose(2, 3) for _ in range(n_layers)]
        else:
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lens = torch.zeros(batch - spare, dtype=torch.long)
        # Rows given one prefix copy (siblings) hold the same first positions: per row (its siblings' id,
        # how many; -1: none). The invariant attention reads those keys and values once for all the
        # siblings in a forward (csrc/attention.cpp). A row's count only drops until it is admitted again.
        self.siblings = torch.full((batch - spare, 2), -1, dtype=torch.long)
        self.siblings[:, 1] = 0
        self._next_siblings = 0
        # CUDA graphs captured over these tensors, by whoever captured them (static_forward.py); None:
        # this cache is not worth capturing for (a scratch cache of one admission). Dropped on resize.
        self.graphs: dict[tuple[Any, ...], object] | None = None

    @classmethod
    def for_model(
        cls,
        config: object,
        batch: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        keys_by_position: bool = False,
        spare: int = 0,
    ) -> RowKVCache:
        """An empty cache shaped for a `transformers` model config (layers, KV heads, head size)."""
        n_layers, n_kv, head_dim = cache_geometry(config)
        return cls(n_layers, batch, n_kv, head_dim, capacity, dtype, device, keys_by_position, spare)

    @property
    def batch(self) -> int:
        return self.lens.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def spare_row(self) -> int:
        """The first row past the live ones (only with `spare` rows)."""
        assert self.spare, "this cache has no spare row"
        return self.batch

    def prepare(self, n_new: int, offset: int = 0, rows: list[int] | None = None, gather: bool = True) -> ForwardView:
        """The next forward's view of the cache: slots for its n_new tokens per row.

        They go after `offset` uncommitted slots written by earlier forwards of the same step: a
        drafter grows its tree level by level, each level seeing the levels before it, and only
        commits the accepted path once the target has verified it. `rows` limits the forward to
        some rows (a scheduler verifying one queued sequence while others draft); `gather`=False
        returns every row from `update` (for an attention that reads `rows` in place).
        """
        host = self.lens if rows is None else self.lens[rows]
        need = int(host.max()) + offset + n_new
        if need > self.capacity:
            raise RuntimeError(f"KV cache holds {self.capacity} positions, a forward needs {need}")
        slots = host[:, None] + offset + torch.arange(n_new)
        index = None if rows is None else to_device(torch.tensor(rows, dtype=torch.long), self.device)
        block = None if not rows or rows != list(range(rows[0], rows[0] + len(rows))) else (rows[0], len(rows))
        lens, slots = to_device(host, self.device), to_device(slots, self.device)
        share = self._share(rows, host)
        return ForwardView(self, lens, slots, offset, need, index, gather, block, share, reads_of(host, share))

    def reads(self, rows: list[int] | None = None) -> tuple[int, int]:
        """A forward over `rows` (None: all): the committed positions they attend, and of them those
        read from a sibling's row."""
        host = self.lens if rows is None else self.lens[rows]
        return reads_of(host, self._share(rows, host))

    def _share(self, rows: list[int] | None, lens: torch.Tensor) -> torch.Tensor | None:
        """The forward's rows' siblings [B, 2] (id, positions held alike, at most the committed ones:
        the slots past them are each row's own), or None where no two of its rows share."""
        siblings = (self.siblings if rows is None else self.siblings[rows]).clone()
        siblings[:, 1] = torch.minimum(siblings[:, 1], lens)
        siblings[siblings[:, 1] == 0, 0] = -1
        ids = siblings[:, 0][siblings[:, 0] >= 0]
        return None if ids.numel() == ids.unique().numel() else siblings

    def advance(self, counts: torch.Tensor) -> None:
        """Commit the first counts[b] new entries of each row."""
        self.lens += counts.cpu()

    def commit(self, row: int, new_indices: list[int]) -> None:
        """Commit the given new entries of one row (an accepted tree path), moved to be contiguous."""
        self.commit_rows([row], [new_indices])

    def commit_rows(self, rows: list[int], new_indices: list[list[int]]) -> None:
        """`commit` for many rows at once: one move per layer for the rows whose entries are not in
        place already (an accepted path off the tree's first branch), one update of the lengths."""
        moved = moves(rows, new_indices, self.lens)
        if moved is not None:
            row, src, dst = (to_device(t, self.device) for t in moved)
            for k, v in zip(self.keys, self.values):
                k[row, :, dst] = k[row, :, src]
                v[row, :, dst] = v[row, :, src]
        self.lens.index_add_(0, torch.tensor(rows), torch.tensor([len(i) for i in new_indices]))

    def reserve(self, batch: int, capacity: int) -> None:
        """Grow (never shrink) to at least `batch` rows of `capacity` positions, keeping what is
        stored: a pool of rows that sequences join and leave (the new rows are empty)."""
        if batch <= self.batch and capacity <= self.capacity:
            return
        self._resize(max(batch, self.batch), max(capacity, self.capacity))

    def give_back(self, batch: int, capacity: int, slack: float = POOL_SLACK) -> bool:
        """Shrink to `batch` rows of `capacity` positions when the pool holds more than `slack` times
        that; whether it shrank. The caller vouches that no row past `batch` is in use and that no
        live row needs more positions. A slack well above 1 keeps a pool that swings between a wide
        step and a narrow one (ToT's thoughts, then its evaluations) from being copied every step."""
        if batch >= self.batch and capacity >= self.capacity:
            return False
        if self.nbytes <= slack * self._bytes_for(batch, capacity):
            return False
        self._resize(min(batch, self.batch), min(capacity, self.capacity))
        return True

    def _bytes_for(self, batch: int, capacity: int) -> float:
        return self.nbytes * (batch / max(self.batch, 1)) * (capacity / max(self.capacity, 1))

    def _resize(self, batch: int, capacity: int) -> None:
        """New tensors of `batch` rows x `capacity` positions holding what fits of the old ones."""
        b, c = min(batch, self.batch), min(capacity, self.capacity)
        lens = self.lens[:b]
        batch += self.spare  # the spare rows follow the live ones, their contents never read

        def resized(t: torch.Tensor) -> torch.Tensor:
            if _by_position(t):
                store = t.new_zeros(batch, t.shape[1], t.shape[3], capacity)
                store[:b, :, :, :c] = t.transpose(2, 3)[:b, :, :, :c]
                return store.transpose(2, 3)
            out = t.new_zeros(batch, t.shape[1], capacity, t.shape[3])
            out[:b, :, :c] = t[:b, :, :c]
            return out

        self.keys = [resized(k) for k in self.keys]
        self.values = [resized(v) for v in self.values]
        self.lens = torch.cat([lens, lens.new_zeros(batch - self.spare - b)])
        fresh = self.siblings.new_full((batch - self.spare - b, 2), -1)
        fresh[:, 1] = 0
        self.siblings = torch.cat([self.siblings[:b], fresh])
        if self.graphs is not None:
            self.graphs.clear()  # they read the old tensors' addresses

    def copy_prefix(self, src: KVCache, src_row: int, rows: list[int], n: int, share: bool = True) -> None:
        """Rows `rows` become the first n committed positions of `src`'s row src_row; with `share`,
        they are siblings (with src_row, when it is a row of this cache) whose first n positions are
        read once for all of them."""
        index = to_device(torch.tensor(rows, dtype=torch.long), self.device)
        for dst, s in zip(self.keys + self.values, src.keys + src.values):
            dst[index, :, :n] = s[src_row, :, :n]
        self.lens[rows] = n
        self.written(rows, 0)
        if share and src is self and self.siblings[src_row, 1] == n and self.siblings[src_row, 0] >= 0:
            self.share(rows, n, int(self.siblings[src_row, 0]))  # a third copy joins the second's siblings
        elif share:
            self.share([*rows, src_row] if src is self else rows, n)

    def share(self, rows: list[int], n: int, siblings: int | None = None) -> None:
        """The rows hold the same first n positions (the caller vouches for it): siblings (of id
        `siblings`, or a new one) whose n positions a forward reads once for all of them."""
        if siblings is None:
            siblings, self._next_siblings = self._next_siblings, self._next_siblings + 1
        self.siblings[rows, 0] = siblings
        self.siblings[rows, 1] = n

    def written(self, rows: list[int], start: int) -> None:
        """Positions from `start` on of `rows` are rewritten: they no longer hold their siblings'."""
        self.siblings[rows, 1] = self.siblings[rows, 1].clamp(max=start)

    def clear(self, rows: list[int]) -> None:
        """Rows hold nothing (a sequence starts in them without a prefix)."""
        self.lens[rows] = 0
        self.written(rows, 0)

    def read(self, row: int, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values of positions [start, end) of a row, per layer [H_kv, n, D] (views)."""
        return [k[row, :, start:end] for k in self.keys], [v[row, :, start:end] for v in self.values]

    def segment(self, row: int, start: int, end: int) -> DenseSegment:
        """Positions [start, end) of a committed row, copied for the prefix store."""
        keys, values = self.read(row, start, end)
        return DenseSegment(start, end, [k.clone() for k in keys], [v.clone() for v in values])

    def restore(self, row: int, pieces: list[tuple[DenseSegment, int, int]], start: int, end: int) -> None:
        """Row `row` takes positions [start, end) from stored segments: (segment, lo, hi) copies [lo, hi)."""
        for seg, lo, hi in pieces:
            for dst, src in zip(self.keys + self.values, seg.keys + seg.values):
                dst[row, :, lo:hi] = src[:, lo - seg.start : hi - seg.start]
        self.lens[row] = end
        self.written([row], start)

    def __len__(self) -> int:
        return len(self.keys)  # layers, as a `transformers` cache counts them


@dataclass(eq=False)
class DenseSegment:
    """Positions [start, end) of a stored sequence: its keys and values, per layer [H_kv, n, D]."""

    start: int
    end: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)

    def split(self, k: int) -> tuple[DenseSegment, DenseSegment]:
        """Its first k positions and the rest."""
        cut = self.start + k
        head = DenseSegment(
            self.start, cut, [t[:, :k].clone() for t in self.keys], [t[:, :k].clone() for t in self.values]
        )
        tail = DenseSegment(
            cut, self.end, [t[:, k:].clone() for t in self.keys], [t[:, k:].clone() for t in self.values]
        )
        return head, tail

    def release(self) -> None:
        """(Its tensors go with it.)"""


@dataclass(frozen=True)
class ForwardView:
    """One forward's view of a KV cache: which rows it runs (None: all), where their new tokens are
    written and what they attend over. It is what `transformers` gets as `past_key_values` for that
    forward (its `update` is the Cache entry point), and nothing of it outlives the forward."""

    cache: KVCache
    lens: torch.Tensor  # [B] committed lengths of the forward's rows
    slots: torch.Tensor  # [B, T] where its new tokens are written
    offset: int  # uncommitted slots of earlier forwards of the step, before the new ones
    kv_len: int  # positions attended over: the longest row's, with its new slots
    rows: torch.Tensor | None
    gather: bool  # whether `update` returns only the forward's rows (else all, read in place)
    # rows that are one run first..first + n: `update` returns a view; found once from the host's list,
    # since a test on the device tensor would wait for the GPU at every layer
    block: tuple[int, int] | None = None
    share: torch.Tensor | None = None  # [B, 2] the rows' siblings (RowKVCache.siblings), None: none shared
    reads: tuple[int, int] = (0, 0)  # committed positions the rows attend; of them, read from a sibling
    # a paged cache (paged_kv.py): the rows' block tables [B, blocks] the attention reads through, and
    # where the new tokens go: (blocks, offsets) [B, T]
    tables: torch.Tensor | None = None
    where: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def keys(self) -> list[torch.Tensor]:
        return self.cache.keys

    @property
    def values(self) -> list[torch.Tensor]:
        return self.cache.values

    def row_lens(self) -> torch.Tensor:
        """Committed lengths of the forward's rows."""
        return self.lens

    def write_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the forward writes: cache rows [B, 1] and slots [B, T] (index keys[l][rows, :, slots]);
        paged, blocks and offsets [B, T] of the pool."""
        if self.where is not None:
            return self.where
        rows = torch.arange(self.cache.batch, device=self.cache.device) if self.rows is None else self.rows
        return rows[:, None], self.slots

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `transformers` Cache entry point: store this layer's new keys/values, return all of them."""
        if self.tables is not None:
            raise RuntimeError("a paged KV cache is read through its block tables by the project's layers only")
        k, v = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        rows, slots = self.write_index()
        # Advanced indices around a slice put the indexed dims first: [B, T, H, D].
        k[rows, :, slots] = key_states.transpose(1, 2).to(k.dtype)
        v[rows, :, slots] = value_states.transpose(1, 2).to(v.dtype)
        if self.rows is None or not self.gather:
            live = self.cache.batch  # (not the spare rows)
            return k[:live, :, : self.kv_len], v[:live, :, : self.kv_len]
        if self.block is not None:
            first, n = self.block
            return k[first : first + n, :, : self.kv_len], v[first : first + n, :, : self.kv_len]  # a view
        return k[self.rows, :, : self.kv_len], v[self.rows, :, : self.kv_len]

    def attention_mask(self, tree: torch.Tensor) -> torch.Tensor:
        """Boolean mask [B, 1, T, kv_len] (True: visible) for the forward.

        tree[b, t, i] (shape [B, T, offset + T]) says whether new token t of row b sees uncommitted
        slot i of its row (the earlier levels of its tree, itself, its ancestors); every new token
        sees the whole committed prefix of its row.
        """
        batch, n_new = self.slots.shape
        width = self.offset + n_new
        device = self.lens.device
        cols = torch.arange(self.kv_len, device=device)
        visible = (cols[None, None, :] < self.lens[:, None, None]).expand(batch, n_new, -1).clone()
        slots = self.lens[:, None] + torch.arange(width, device=device)
        visible.scatter_(2, slots[:, None, :].expand(batch, n_new, width), tree.to(torch.bool))
        return visible[:, None]

    # Methods some `transformers` code paths query on a cache object.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.cache.lens.max()) if self.cache.batch else 0  # (host lengths: no wait)

    def __len__(self) -> int:
        return len(self.cache.keys)


def reads_of(lens: torch.Tensor | np.ndarray, share: torch.Tensor | None) -> tuple[int, int]:
    """Committed positions rows of these lengths attend, and of them read from a sibling (`share`)."""
    return int(lens.sum()), 0 if share is None else shared_reads(share)


def shared_reads(share: torch.Tensor) -> int:
    """Positions a forward with these siblings [B, 2] reads from a sibling's row: per set of siblings,
    its shared whole blocks for every member but the one they are read from."""
    ids, alike = share.cpu().numpy().T  # numpy's calls: a step's bookkeeping, a tenth of torch's
    out = 0
    for one in np.unique(ids[ids >= 0]).tolist():
        members = alike[ids == one]
        out += (len(members) - 1) * (int(members.min()) // SHARED_BLOCK * SHARED_BLOCK)
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for it: a non-blocking copy from pageable memory is
    staged at once, where a blocking one waits for the GPU's queue to drain."""
    return t.to(device, non_blocking=True)


def _by_position(keys: torch.Tensor) -> bool:
    """Whether a layer's keys [B, H, L, D] are stored with positions contiguous (a transposed view)."""
    return keys.stride(2) == 1 and keys.shape[3] > 1


def cache_geometry(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder-only `transformers` config (its attributes are the
    model's own: Any)."""
    n_layers: int = config.num_hidden_layers
    n_heads: int = config.num_attention_heads
    n_kv: int = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return n_layers, n_kv, head_dim


def moves(
    rows: list[int], new_indices: list[list[int]], lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Where `commit_rows` moves entries: (row, from, to) positions of every entry not in place (the
    k-th kept entry of a row goes to its length + k), or None where all are."""
    out: tuple[list[int], list[int], list[int]] = ([], [], [])
    for row, kept in zip(rows, new_indices):
        if kept != list(range(len(kept))):
            base = int(lens[row])
            out[0].extend([row] * len(kept))
            out[1].extend(base + i for i in kept)
            out[2].extend(range(base, base + len(kept)))
    if not out[0]:
        return None
    moved_rows, src, dst = (torch.tensor(x) for x in out)
    return moved_rows, src, dst
