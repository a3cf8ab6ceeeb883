"""One memory budget per loaded model for its stored prompt prefixes, shared by every engine and
runner on it (the bench holds one engine per decoder; their stores must not each take the whole).

Sized at load time from what the machine has: a share of the host's available RAM on a CPU, of the
device's free memory on a GPU (`model.prefix_memory`), or a fixed size (`model.prefix_memory_mb`).
When the stores together pass it, the least recently used leaf among all of them goes first, so an
engine that sits idle gives its prefixes to the one that runs.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch


class Store(Protocol):
    @property
    def nbytes(self) -> int: ...

    def oldest(self) -> int | None: ...  # the clock of its least recently used leaf (None: empty)

    def evict(self) -> None: ...  # drop that leaf

    def drop_oldest_pin(self) -> bool: ...  # let its oldest pinned sequence be evicted (False: none)


def available_bytes(device: torch.device) -> int:
    """Memory this process could still take: free device memory on a GPU, else the host's
    MemAvailable (what the kernel could hand out without swapping)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _statm_mb() -> float | None:
    """The process's resident memory now, where /proc says (Linux)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def peak_rss_mb() -> float:
    """The process's peak resident memory so far (Linux reports kilobytes, macOS bytes). The kernel
    raises its high-water mark lazily, so it can trail the resident memory of this moment: never less."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_mb = peak / 2**20 if sys.platform == "darwin" else peak / 2**10
    return max(peak_mb, _statm_mb() or 0.0)


def rss_mb() -> float:
    """The process's resident memory now (Linux; the peak elsewhere)."""
    now = _statm_mb()
    return peak_rss_mb() if now is None else now


@dataclass(eq=False)
class MemoryBudget:
    max_bytes: int
    clock: int = 0  # one clock for every store, so "least recently used" compares across them
    evictions: int = 0
    stores: weakref.WeakSet[Store] = field(default_factory=weakref.WeakSet)
    # Held by whoever reads or changes a store of this budget: a drafting thread (`seed.overlap`) admits
    # into the draft model's store, and its evictions reach the target's, while the main thread runs.
    lock: threading.RLock = field(default_factory=threading.RLock)

    @classmethod
    def share(cls, fraction: float, device: torch.device) -> MemoryBudget:
        return cls(int(fraction * available_bytes(device)))

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stores)

    def make_room(self) -> None:
        """Evict least recently used leaves, across every store, until the stores fit."""
        with self.lock:
            self._make_room()

    def _make_room(self) -> None:
        total = self.nbytes
        while total > self.max_bytes:
            ages = [(age, i, s) for i, s in enumerate(self.stores) if (age := s.oldest()) is not None]
            if not ages:
                # Only pinned sequences are left: the cap holds, the oldest pin goes first.
                if not any(s.drop_oldest_pin() for s in self.stores):
                    return
                continue
            _, _, store = min(ages)  # the index breaks ties: stores themselves are never compared
            before = store.nbytes
            store.evict()
            self.evictions += 1
            total -= before - store.nbytes
