"""The options of the built-in drafters (each read from its config section: `stand.*`, `suffix.*`, ...).

Apart from the drafters themselves, which import torch: decoding/drafters/builtin.py declares the
drafters with these alone, so a command checks a bad option in about a second (no torch loaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from decoding.base.errors import ConfigError

Scope = Literal["group", "problem", "run"]  # what a pool is shared by: a ToT step's siblings, a problem, the run
_ADED_INTS = ("iterations", "max_depth", "max_nodes", "top_k", "capacity", "max_pools")
_ADED_FLOATS = ("c1", "c2", "update_weight")


@dataclass(frozen=True)
class PLDOptions:
    max_ngram: int = 3  # longest n-gram matched (then shorter ones)
    num_draft: int = 10  # tokens drafted after a match (a chain)

    def __post_init__(self) -> None:
        if self.max_ngram < 1 or self.num_draft < 1:
            raise ConfigError(f"pld.max_ngram={self.max_ngram} and pld.num_draft={self.num_draft} must be positive")


@dataclass(frozen=True)
class RecyclingOptions:
    top_k: int = 8  # successors kept per token

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ConfigError(f"recycling.top_k={self.top_k} must be a positive integer")


@dataclass(frozen=True)
class StandOptions:
    tree: str = "default"  # a tree shipped in decoding/trees/ (by name) or a JSON file path
    scope: Scope = "group"
    prime_with_prompt: bool = True  # the pool starts with the prompt's N-grams: drafts may copy from it
    stochastic: bool = True  # Gumbel-top-k drafting at temperature > 0 (false: by rank)
    capacity: int = 200_000  # entries per pool
    max_pools: int = 256  # pools kept (least recently used evicted)
    min_path_prob: float = 0.0  # drop nodes whose draft probability of being reached is lower
    suffix: bool = False  # stand, seed_stand: the suffix drafter's tree (suffix.*) merged with the pool's
    key: str = "stand"

    def __post_init__(self) -> None:
        if self.scope not in ("group", "problem", "run"):
            raise ConfigError(f"{self.key}.scope={self.scope!r} is not one of group, problem, run")
        if not 0 <= self.min_path_prob < 1:
            raise ConfigError(f"{self.key}.min_path_prob={self.min_path_prob} must be in [0, 1)")
        if self.capacity < 1 or self.max_pools < 1:
            raise ConfigError(f"{self.key}.capacity and {self.key}.max_pools must be positive integers")


@dataclass(frozen=True)
class SuffixOptions:
    max_match: int = 12  # longest context suffix matched
    max_depth: int = 12  # deepest draft (and the trie holds max_match + max_depth tokens per suffix)
    spec_factor: float = 1.0  # draft depth at most spec_factor x the match length (SuffixDecoding's alpha)
    max_nodes: int = 16  # nodes per draft tree
    min_prob: float = 0.1  # nodes whose path probability (the counts' product along it) is lower are not drafted
    scope: Scope = "problem"
    prime_with_prompt: bool = True  # prompts enter the trie too: drafts may copy from them
    capacity: int = 300_000  # trie nodes per pool (about 150 B each); a full pool only counts what it holds
    max_pools: int = 32  # pools kept across calls, least recently used evicted

    def __post_init__(self) -> None:
        for name in ("max_match", "max_depth", "max_nodes", "capacity", "max_pools"):
            if getattr(self, name) < 1:
                raise ConfigError(f"suffix.{name}={getattr(self, name)} must be a positive integer")
        if self.spec_factor <= 0:
            raise ConfigError(f"suffix.spec_factor={self.spec_factor} must be positive")
        if not 0 <= self.min_prob < 1:
            raise ConfigError(f"suffix.min_prob={self.min_prob} must be in [0, 1)")
        if self.scope not in ("group", "problem", "run"):
            raise ConfigError(f"suffix.scope={self.scope!r} is not one of group, problem, run")


@dataclass(frozen=True)
class AdedOptions:
    iterations: int = 24  # MCTS iterations per draft (the paper: 150, on a GPU)
    max_depth: int = 4  # tree depth (the paper's draft length l = 4)
    max_nodes: int = 8  # tree budget: the most visited nodes
    top_k: int = 4  # children of an expanded node: the matrix's most probable next tokens
    c1: float = 2.414  # exploration E = c1 + log((N + c2 + 1) / c2) (the paper: 2.414 or 32)
    c2: float = 8.0
    scope: Scope = "problem"  # one matrix per group (ToT step), problem or run
    prime_with_prompt: bool = True  # prompts' tri-grams count too
    update_weight: float = 1.0  # count added per verified tri-gram (corpus and prompt tri-grams add 1)
    corpus: str | None = None  # text or JSONL file whose tri-grams every matrix starts from
    capacity: int = 200_000  # tri-gram contexts per matrix, least recently updated evicted
    max_pools: int = 256  # matrices kept across calls, least recently used evicted

    def __post_init__(self) -> None:
        for name in _ADED_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"aded.{name}={value!r} must be a positive integer")
        for name in _ADED_FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"aded.{name}={value!r} is not a number")
            object.__setattr__(self, name, float(value))
        if self.c1 < 0 or self.c2 <= 0:
            raise ConfigError(f"aded.c1={self.c1} and aded.c2={self.c2}: set c1 >= 0 and c2 > 0 (the paper: 2.414, 8)")
        if self.update_weight <= 0:
            raise ConfigError(f"aded.update_weight={self.update_weight} must be positive (1: count like the corpus)")
        if self.scope not in ("group", "problem", "run"):
            raise ConfigError(f"aded.scope={self.scope!r} is not one of group, problem, run")
        if self.corpus is not None and not Path(self.corpus).expanduser().is_file():
            raise ConfigError(
                f"aded.corpus={self.corpus} is not a file: give a text or JSONL file, or aded.corpus=null"
            )
