"""The search library: how the tree is searched, apart from the commands and run folders around it.

`base.py` holds what every search shares (the generation step, valuation, rollouts, the answer chosen over
leaves), `tree.py` the reasoning tree, `value.py` and `reward.py` how states are valued, `vote.py` how a vote
weighs, filters and stops, `confidence.py` the readings of a reply's log-probabilities, and one module
per search (bfs, dvts, best_of_n, mcts), each ending with its `PLUGIN` declaration (`plugin.py`),
gathered here into `SEARCHES`. It imports `decoding`'s public face and `tasks`, never the run folders
(tot/runs/) or the commands (tot/*.py).
"""

from __future__ import annotations

from typing import Any

from decoding import table
from tot.search.plugin import SearchPlugin

# What a search is written with, from base.py on first use: a command that only reads saved trees
# (tot.show, tot.collect) imports tree.py through this package and loads no model runtime.
_FROM_BASE = ("GenerationEngine", "SearchBase", "Solution", "Thinker", "run_sync")
__all__ = ["SEARCHES", "SearchPlugin", *_FROM_BASE]


def __getattr__(name: str) -> Any:
    if name not in _FROM_BASE:
        raise AttributeError(f"module 'tot.search' has no attribute {name!r}")
    from tot.search import base

    return getattr(base, name)


# One module per search; TOT_SPEC_PLUGINS adds modules from outside the project (decoding/base/plugins.py).
MODULES = ("tot.search.bfs", "tot.search.dvts", "tot.search.best_of_n", "tot.search.mcts")
SEARCHES = table(SearchPlugin, MODULES)
