"""The draft-model tree's options (`sd.*`, `seed.*`), apart from the policies that grow the trees
(policies.py): checking a config imports neither torch nor the drafters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from decoding.base.errors import ConfigError

if TYPE_CHECKING:
    from decoding.speculation.draft_tree import Draw

TREE_POLICY_NAMES = ("k_config", "sequoia", "pct")  # policies.TREE_POLICIES' keys


@dataclass(frozen=True)
class DraftTreeOptions:
    """The draft-model tree's shape and verification rule (`sd.*`, `seed.*`: sd, seed, seed_stand with a draft)."""

    k_config: tuple[int, ...] = (2, 2, 1)
    multi_candidate: bool = True
    without_replacement: bool = False
    tree_policy: str = "k_config"  # k_config | sequoia (the static tree in `tree`) | pct (EDD's pruned tree)
    tree: str | None = None  # sequoia: a tree JSON ({"parents": [...]}) or a tree shipped in decoding/trees/
    pct_top_k: int = 5  # pct: candidates per expanded node (EDD's expansion width)
    pct_max_depth: int = 10  # pct: deepest drafted level (EDD: 10)
    pct_threshold: float = 0.01  # pct: leaves whose path confidence is lower are pruned (EDD: 0.01)
    pct_ratio: float | None = None  # pct: s_d / s_t; None: measured at start-up (speculation/timing.speed_ratio)
    key: str = "draft_tree"  # the config namespace, for error messages

    def __post_init__(self) -> None:
        key = self.key
        k = list(self.k_config)
        if not k or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in k):
            raise ConfigError(
                f"{key}.k_config={k} must list positive children counts per depth, e.g. [2,2,1] or [1,1,1]"
            )
        if self.tree_policy not in TREE_POLICY_NAMES:
            raise ConfigError(f"{key}.tree_policy={self.tree_policy} is not one of {', '.join(TREE_POLICY_NAMES)}")
        if self.tree_policy == "k_config" and not self.multi_candidate and max(k) > 1:
            raise ConfigError(
                f"{key}.k_config={k} drafts several candidates per position, which needs "
                f"{key}.multi_candidate=true; single-candidate SD drafts a chain such as {key}.k_config=[1,1,1]"
            )
        if self.tree_policy == "sequoia":
            if not self.tree:
                raise ConfigError(
                    f"{key}.tree_policy=sequoia needs {key}.tree=PATH, a tree JSON written by "
                    "python -m tuning.calibrate_tree calibrate.drafter=model"
                )
            from decoding.trees.static import StaticTree  # torch: only for a sequoia tree's file

            widest = max((len(v) for v in StaticTree.load(self.tree, key=key).children().values()), default=0)
            if not self.multi_candidate and widest > 1:
                raise ConfigError(
                    f"{key}.tree={self.tree} has nodes with {widest} children, which needs {key}.multi_candidate=true"
                )
        if self.tree_policy == "pct":
            self._check_pct()

    def _check_pct(self) -> None:
        key = self.key
        if self.pct_top_k < 1 or self.pct_max_depth < 1:
            raise ConfigError(
                f"{key}.pct_top_k={self.pct_top_k} and {key}.pct_max_depth={self.pct_max_depth} "
                "must be positive integers (EDD: 5 and 10)"
            )
        if not 0 < self.pct_threshold < 1:
            raise ConfigError(
                f"{key}.pct_threshold={self.pct_threshold} must be in (0, 1) (EDD: 0.01): leaves whose "
                "confidence is lower are pruned, and it bounds the tree (at most 1/threshold nodes per depth)"
            )
        if self.pct_ratio is not None and self.pct_ratio <= 0:
            raise ConfigError(
                f"{key}.pct_ratio={self.pct_ratio} must be positive, or null to measure s_d / s_t at start-up"
            )
        if not self.multi_candidate and self.pct_top_k > 1:
            raise ConfigError(
                f"{key}.tree_policy=pct with {key}.pct_top_k={self.pct_top_k} drafts several candidates per "
                f"node, which needs {key}.multi_candidate=true (or {key}.pct_top_k=1 for a chain)"
            )
        if self.without_replacement:
            raise ConfigError(
                f"{key}.tree_policy=pct takes the top-k candidates deterministically (verified as point "
                f"masses), so {key}.without_replacement=true does not apply; set {key}.without_replacement=false"
            )

    @property
    def parents(self) -> tuple[int, ...]:
        """The static shape of the k_config and sequoia policies."""
        from decoding.speculation.draft_tree import k_config_parents  # torch: when a drafter is built
        from decoding.trees.static import StaticTree

        if self.tree_policy == "sequoia" and self.tree:
            return StaticTree.load(self.tree, key=self.key).parents
        return tuple(k_config_parents(self.k_config))

    @property
    def draw(self) -> Draw:
        """How children are drawn at temperature > 0 (at temperature 0 always by rank, "top")."""
        if self.tree_policy == "pct":
            return "top"
        return "without_replacement" if self.without_replacement else "iid"
