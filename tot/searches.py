"""The table of searches: name -> its settings (`search.*`) and the search built from them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.base import Task
from tot.best_of_n import BestOfN, BestOfNSettings
from tot.dvts import DVTS, DVTSSettings
from tot.mcts import MCTS, MCTSSettings
from tot.search import BFS, BFSSettings, GenSettings, Reward, Search


@dataclass(frozen=True)
class SearchKind:
    # A frozen dataclass read from `search.*` by decoding.core.options.from_dict, checking itself in
    # __post_init__; `scaled(n)` gives its settings at budget N (the scaling curve's x).
    settings: type
    # Built from the task, the settings, the sampling settings, the run seed and the reward model (or None).
    build: Callable[[Task, Any, GenSettings, int, Reward | None], Search]


SEARCHES: dict[str, SearchKind] = {
    "bfs": SearchKind(BFSSettings, BFS),
    "dvts": SearchKind(DVTSSettings, DVTS),
    "best_of_n": SearchKind(BestOfNSettings, BestOfN),
    "mcts": SearchKind(MCTSSettings, MCTS),
}
