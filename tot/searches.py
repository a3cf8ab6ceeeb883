"""The table of searches: name -> the search class, built from its own settings (`search.*`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tasks.base import Task
from tot.dvts import DVTS
from tot.search import BFS, GenSettings, Search

# A search is built from the task, its settings (BFSSettings, DVTSSettings), the sampling settings
# and the run seed.
SEARCHES: dict[str, Callable[[Task, Any, GenSettings, int], Search]] = {"bfs": BFS, "dvts": DVTS}
