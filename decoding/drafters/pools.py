"""Draft statistics kept per scope across engine calls (STAND's N-gram pools, ADED's tri-gram matrices).

The trajectories of one ToT step share a pool (`GenRequest.group`), or all steps of a problem
(`Group.problem`), or the whole run; the least recently used pools are evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from decoding.base.values import Group
from decoding.drafters.options import Scope
from decoding.runtime.prefix_cache import shared_len


class Pool(Protocol):
    def prime(self, tokens: list[int], start: int = 0) -> None:
        """Count a prompt's own statistics, so that drafts may copy from it: the text from token
        `start` on (the tokens before it, a prefix the pool has counted already, are context only)."""


P = TypeVar("P", bound=Pool)


class Pools(Generic[P]):
    def __init__(self, scope: Scope, max_pools: int, new: Callable[[], P]) -> None:
        self.scope = scope
        self.max_pools = max_pools
        self.new = new
        self.pools: OrderedDict[Group, P] = OrderedDict()
        self.primed: dict[Group, set[tuple[int, ...]]] = {}  # per pool: the prompts counted already

    def key(self, group: Group) -> Group:
        if self.scope == "run":
            return Group()
        return Group(group.problem) if self.scope == "problem" else group

    def get(self, group: Group) -> P:
        key = self.key(group)
        pool = self.pools.pop(key, None)
        pool = self.new() if pool is None else pool
        self.pools[key] = pool
        while len(self.pools) > self.max_pools:
            old, _ = self.pools.popitem(last=False)
            self.primed.pop(old, None)
        return pool

    def prime(self, group: Group, prompt: list[int]) -> None:
        """Count a prompt into its group's pool once, however many sequences share it, and of a
        prompt that extends one counted before only what follows their common prefix: a ToT step's
        prompts (its thoughts' and each evaluation's) share the question and the steps so far, which
        were counted over and over (four in five of the additions to a 4-problem run's pools)."""
        key = self.key(group)
        done = self.primed.setdefault(key, set())
        text = tuple(prompt)
        if text not in done:
            start = max((shared_len(text, p) for p in done), default=0)
            done.add(text)
            self.get(group).prime(prompt, start)
