"""What a search declares: `PLUGIN = SearchPlugin(...)` ends each search's module (tot/search/__init__.py
gathers them into `SEARCHES`).

A search is one module and its yaml (conf/search/NAME.yaml): the module ends with its declaration,
naming the search, its settings (a frozen dataclass read from `search.*`, checking itself in
__post_init__, with `scaled(n)`: its settings at budget N, the scaling curve's x) and its builder,
`build(task, values, settings, gen, seed, reward, vote=...)` -> a `Search` (tot/search/base.py; tot/search/bfs.py
is one), and where its settings depend on the rest of the run's config, `check_config(settings, vote,
task_options)`, run at load time. `TOT_SPEC_PLUGINS` adds modules from outside the project (decoding/base/plugins.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from decoding import ConfigError, Plugin, from_dict
from tot.search.tree import ReasoningTree

if TYPE_CHECKING:
    from tot.search.vote import VoteRule

# Where a run's answer is a vote: from the recorded settings, the leaves it voted over (tot.rescore
# votes again on answers read anew); None where a value chose it.
Voted = Callable[[Mapping[str, Any]], Callable[[ReasoningTree], list[int]] | None]


def no_vote(settings: Mapping[str, Any]) -> None:
    return None


# A search's settings checked at load time against the rest of the run's config: the vote's rule and the
# task's options (a ConfigError names what to change).
Check = Callable[[Any, "VoteRule", Mapping[str, Any]], None]


def no_check(settings: Any, vote: VoteRule, task_options: Mapping[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class SearchPlugin(Plugin):
    KIND: ClassVar[str] = "search"

    section: str = "search"
    voted: Voted = no_vote
    check_config: Check = no_check

    def settings(self, given: Mapping[str, Any], key: str) -> Any:
        """Its settings from a config section's values (`key` names the section in messages)."""
        if self.options is None:
            raise ConfigError(
                f"search={self.name}: its plug-in declares no settings; give its PLUGIN options=<a dataclass>"
            )
        return from_dict(self.options, given, key, ignore=("name",))
