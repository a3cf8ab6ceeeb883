"""What a search declares: `PLUGIN = SearchPlugin(...)` ends each search's module (tot/search/__init__.py
gathers them into `SEARCHES`).

A search is one module and its yaml (conf/search/NAME.yaml): the module ends with its declaration,
naming the search, its settings (a frozen dataclass read from `search.*`, checking itself in
__post_init__, with `scaled(n)`: its settings at budget N, the scaling curve's x) and its builder,
`build(task, settings, gen, seed, reward)` -> a `Search` (tot/search/base.py; tot/search/bfs.py is
one). `TOT_SPEC_PLUGINS` adds modules from outside the project (decoding/base/plugins.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from decoding import Plugin
from tot.search.tree import ReasoningTree

# Where a run's answer is a vote: from the recorded settings, the leaves it voted over (tot.rescore
# votes again on answers read anew); None where a value chose it.
Voted = Callable[[Mapping[str, Any]], Callable[[ReasoningTree], list[int]] | None]


def no_vote(settings: Mapping[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class SearchPlugin(Plugin):
    KIND: ClassVar[str] = "search"

    section: str = "search"
    voted: Voted = no_vote
