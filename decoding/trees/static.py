"""Static draft-tree shapes: parents-first node lists that drafters fill from the root down.

A shape is shipped by name (decoding/trees/<name>.json: `default`, the 5-node tree the step planner
cuts from on this project's CPU; `chain3`, the 3-node chain calibrated for the fixed cut; `initial`,
STAND's 625-node starting tree) or read from a JSON file written by
`python -m tuning.calibrate_tree`. `fill` is the one loop that fills a shape with a drafter's
candidates (STAND's N-gram pools, Token Recycling's successor table).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from decoding.base.errors import ConfigError
from decoding.speculation.draft_tree import ROOT, DraftTree

# A drafter's candidates for the children of one drafted node, best first: (token, draft probability),
# or None to leave that child slot (and its subtree) empty.
Children = Callable[[int, int], list[tuple[int, float] | None]]


@dataclass(frozen=True)
class StaticTree:
    """A draft tree shape: parent of each node (parents first, ROOT = -1), children in rank order."""

    parents: tuple[int, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, p in enumerate(self.parents):
            if not (p == ROOT or 0 <= p < i):
                raise ValueError(f"node {i} has parent {p}: nodes must be listed parents first")

    def __len__(self) -> int:
        return len(self.parents)

    def children(self) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            kids.setdefault(p, []).append(i)
        return kids

    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p == ROOT else out[p] + 1)
        return out

    @cached_property
    def _shape(self) -> tuple[dict[int, list[int]], list[int]]:
        return self.children(), self.depths()  # read on every draft: computed once

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"parents": list(self.parents), "meta": self.meta}, indent=1) + "\n")

    def fill(self, tree: DraftTree, room: int, children: Children) -> list[int]:
        """Fill `tree` with this shape from the root down: `children(node, k)` gives up to k candidates
        for the children of drafted node `node` (ROOT first), which take this shape's child slots in
        rank order. A node with no candidates ends its branch, and no node goes deeper than `room`
        (a step commits at most the accepted path plus one token). Returns each drafted node's
        node in this shape."""
        kids, depth = self._shape
        drafted_of = {ROOT: ROOT}
        static_of: list[int] = []
        for s_parent in (ROOT, *range(len(self))):
            slots = kids.get(s_parent)
            if not slots or s_parent not in drafted_of or (s_parent != ROOT and depth[s_parent] >= room):
                continue
            parent = drafted_of[s_parent]
            for pick, s_child in zip(children(parent, len(slots)), slots):
                if pick is not None:
                    drafted_of[s_child] = tree.add(pick[0], parent, pick[1])
                    static_of.append(s_child)
        return static_of

    @classmethod
    def load(cls, spec: str, key: str = "stand") -> StaticTree:
        """A shipped tree by name (decoding/trees/<name>.json) or a JSON file by path."""
        shipped = resources.files("decoding.trees").joinpath(f"{spec}.json")
        path = Path(spec).expanduser()
        if shipped.is_file():
            text = shipped.read_text()
        elif path.is_file():
            text = path.read_text()
        else:
            names = sorted(p.name[:-5] for p in resources.files("decoding.trees").iterdir() if p.name.endswith(".json"))
            raise ConfigError(f"{key}.tree={spec} is neither a shipped tree ({', '.join(names)}) nor a JSON file")
        try:
            data = json.loads(text)
            return cls(tuple(int(p) for p in data["parents"]), dict(data.get("meta", {})))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{key}.tree={spec} is not a tree file ({e}); expected {{'parents': [...]}}") from None


def initial_tree(max_depth: int = 20) -> StaticTree:
    """The 625-node initial tree of STAND's appendix Algorithm 1 (leftmost nodes get more children)."""
    parents: list[int] = []
    order: list[int] = []  # rank among siblings
    n_kids: dict[int, int] = {ROOT: 0}
    depth_of: dict[int, int] = {ROOT: 0}
    active = [ROOT]
    for _ in range(max_depth):
        nxt = []
        for i, node in enumerate(active):
            d = depth_of[node]
            if d == 0:
                n = 8
            elif d == 1:
                n = max(8 - 2 * order[node], 1)
            else:
                siblings = n_kids[parents[node]]
                n = math.ceil((siblings - 1) / (order[node] * 0.7 + 1))
                n = max(n, 2) if d in (2, 3) else max(n, 0)
            if i == 0:
                n = max(n, 3)
            n_kids[node] = n
            for c in range(n):
                parents.append(node)
                order.append(c)
                child = len(parents) - 1
                depth_of[child] = d + 1
                n_kids[child] = 0
                nxt.append(child)
        active = nxt
    return StaticTree(tuple(parents), {"made_by": "STAND appendix Algorithm 1", "depth": max_depth})


def prune(tree: StaticTree, hits: dict[int, int], nodes: int, meta: dict[str, Any]) -> StaticTree:
    """The `nodes` most accepted nodes as a connected tree (STAND's data-driven tree optimisation).

    A node is on an accepted path at most as often as its parent, so taking nodes by hit count
    (ties: the earlier node, which is shallower or of better rank) and only when the parent is
    taken already keeps the tree connected. Siblings keep their rank order. Deterministic.
    """
    ranked = sorted(range(len(tree)), key=lambda i: (-hits.get(i, 0), i))
    keep: set[int] = set()
    while len(keep) < min(nodes, len(tree)):
        added = False
        for i in ranked:
            if i not in keep and (tree.parents[i] == ROOT or tree.parents[i] in keep):
                keep.add(i)
                added = True
                break
        if not added:
            break
    order = sorted(keep)
    new_index = {old: new for new, old in enumerate(order)}
    parents = tuple(ROOT if tree.parents[i] == ROOT else new_index[tree.parents[i]] for i in order)
    return StaticTree(parents, meta)
