"""Where a runner keeps its KV: rows of their own (`RowLayout`), or blocks of one pool that rows and the
prefix store share by reference (`PagedLayout`, the CPU layers' default). The runner picks one at load
(runner.py says when a paged layout asked for cannot be used) and asks it for caches, for what a pool
of rows takes, and what a forward or a release means for shared blocks: it branches on neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from decoding.runtime.kv_bytes import KVBytes, PagedBytes, RowBytes, RowCapacity
from decoding.runtime.kv_cache import KVCache, RowKVCache, cache_geometry
from decoding.runtime.paged_kv import BlockPool, PagedKVCache
from decoding.runtime.prefix_cache import PrefixCache


class KVLayout(Protocol):
    @property
    def pool(self) -> BlockPool | None: ...  # the blocks rows share (paged), or None

    def new_cache(self, batch: int, capacity: int, graphs: bool = False) -> KVCache:
        """An empty cache; `graphs`: one that lives long enough to capture CUDA graphs over."""
        ...

    def bytes(self, row_capacity: RowCapacity) -> KVBytes:
        """What a pool of rows takes (admission compares it with the KV budget)."""
        ...

    def shared_blocks(self) -> int:
        """Blocks held by more than one row now (0: nothing is shared)."""
        ...

    def released(self, prefixes: PrefixCache) -> None:
        """Rows gave their KV back."""
        ...


@dataclass(frozen=True)
class RowLayout:
    """Every row its own buffer, as long as the pool's capacity."""

    config: Any
    dtype: torch.dtype
    device: torch.device
    keys_by_position: bool  # the invariant attention reads the verified rows in place, by index
    spare: int  # rows past the live ones that a bucketed forward's padding writes (0: none)
    capture: bool  # CUDA graphs are captured over long-lived caches
    pool: None = None

    def new_cache(self, batch: int, capacity: int, graphs: bool = False) -> KVCache:
        cache = RowKVCache.for_model(
            self.config,
            batch,
            capacity,
            self.dtype,
            self.device,
            keys_by_position=self.keys_by_position,
            spare=self.spare,
        )
        if graphs and self.capture:
            cache.graphs = {}
        return cache

    def bytes(self, row_capacity: RowCapacity) -> KVBytes:
        n_layers, n_kv, head_dim = cache_geometry(self.config)
        return RowBytes(2 * n_layers * n_kv * head_dim * self.dtype.itemsize, row_capacity, spare_rows=self.spare)

    def shared_blocks(self) -> int:
        return 0

    def released(self, prefixes: PrefixCache) -> None:
        return None


@dataclass(frozen=True)
class PagedLayout:
    """Rows as tables of blocks of one pool: siblings' prompt blocks, and the prefix store's, held once."""

    pool: BlockPool

    def new_cache(self, batch: int, capacity: int, graphs: bool = False) -> KVCache:
        return PagedKVCache(self.pool, batch, capacity)

    def bytes(self, row_capacity: RowCapacity) -> KVBytes:
        return PagedBytes(self.pool.block_bytes, row_capacity)

    def shared_blocks(self) -> int:
        return self.pool.shared()

    def released(self, prefixes: PrefixCache) -> None:
        # blocks the store also held now count against its budget alone, which may then evict
        prefixes.budget.make_room()
