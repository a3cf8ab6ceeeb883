"""STAND's model-free drafter (STAND, section 4.2): draft trees from the logit N-gram pool.

The trajectories of one ToT step share a pool (`GenRequest.group`; or a whole problem, or the
whole run): every committed position adds the target distribution the verifier already computed,
so a trajectory drafts from what the others produced. A static tree topology is filled from the
root down: at each node the longest matching context gives up to 10 candidates, and the node's
children take them in order, sampled without replacement by Gumbel-top-k (stochastic drafting,
verified by Sequoia's rule) or by rank (deterministic, and always at temperature 0). A node whose
context matches nothing ends its branch, so trees shrink where the pool knows nothing.
"""

from __future__ import annotations

import json
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import torch

from decoding.draft_tree import ROOT, DraftTree
from decoding.errors import ConfigError
from decoding.ngram import LogitNGram
from decoding.sequence import Sequence
from decoding.verify import Verdict

Scope = Literal["group", "problem", "run"]
TOP = 10  # candidates stored per context (STAND: top-10)


@dataclass(frozen=True)
class StandOptions:
    tree: str = "default"  # a tree shipped in decoding/trees/ (by name) or a JSON file path
    scope: Scope = "group"
    seed_prompt: bool = True  # let drafts copy from the prompt too
    stochastic: bool = True  # Gumbel-top-k drafting at temperature > 0 (false: by rank)
    capacity: int = 200_000  # entries per pool
    max_pools: int = 256  # pools kept (least recently used evicted)
    min_path_prob: float = 0.0  # drop nodes whose draft probability of being reached is lower
    key: str = "stand"

    def __post_init__(self) -> None:
        if self.scope not in ("group", "problem", "run"):
            raise ConfigError(f"{self.key}.scope={self.scope!r} is not one of group, problem, run")
        if not 0 <= self.min_path_prob < 1:
            raise ConfigError(f"{self.key}.min_path_prob={self.min_path_prob} must be in [0, 1)")
        if self.capacity < 1 or self.max_pools < 1:
            raise ConfigError(f"{self.key}.capacity and {self.key}.max_pools must be positive integers")


# --- static tree topologies ------------------------------------------------------------------------


@dataclass(frozen=True)
class StaticTree:
    """A draft tree shape: parent of each node (parents first, ROOT = -1), children in rank order."""

    parents: tuple[int, ...]
    meta: dict

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

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"parents": list(self.parents), "meta": self.meta}, indent=1) + "\n")

    @classmethod
    def load(cls, spec: str, key: str = "stand") -> StaticTree:
        """A shipped tree by name (decoding/trees/<name>.json) or a JSON file by path."""
        shipped = resources.files("decoding").joinpath("trees", f"{spec}.json")
        path = Path(spec).expanduser()
        if shipped.is_file():
            text = shipped.read_text()
        elif path.is_file():
            text = path.read_text()
        else:
            names = sorted(p.name[:-5] for p in resources.files("decoding").joinpath("trees").iterdir())
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


def prune(tree: StaticTree, hits: dict[int, int], nodes: int, meta: dict) -> StaticTree:
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


# --- the drafter -----------------------------------------------------------------------------------


class GumbelNoise:
    """Gumbel noise drawn in blocks and used up in order (STAND caches it rather than sampling
    per node); refreshed from the sequence's draft generator when exhausted."""

    def __init__(self, generator: torch.Generator, block: int = 4096) -> None:
        self.generator = generator
        self.block = block
        self.values: list[float] = []
        self.pos = 0

    def take(self, n: int) -> list[float]:
        if self.pos + n > len(self.values):
            u = torch.rand(self.block, generator=self.generator, dtype=torch.float64).clamp_min(1e-300)
            self.values = (-torch.log(-torch.log(u))).tolist()
            self.pos = 0
        out = self.values[self.pos : self.pos + n]
        self.pos += n
        return out


def gumbel_top_k(ids: list[int], probs: list[float], k: int, noise: GumbelNoise) -> list[int]:
    """k of the candidates sampled without replacement in proportion to probs, in draw order."""
    live = [(i, p) for i, p in zip(ids, probs) if p > 0]
    g = noise.take(len(live))
    scored = sorted(((math.log(p) + gi, i) for (i, p), gi in zip(live, g)), reverse=True)
    return [i for _, i in scored[:k]]


class Pools:
    """The N-gram pools, kept across engine calls, least recently used evicted beyond max_pools."""

    def __init__(self, options: StandOptions) -> None:
        self.options = options
        self.pools: OrderedDict[str, LogitNGram] = OrderedDict()
        self.seeded: dict[str, set[tuple[int, ...]]] = {}

    def key(self, group: str) -> str:
        if self.options.scope == "run":
            return ""
        return group.split("/", 1)[0] if self.options.scope == "problem" else group

    def new(self) -> LogitNGram:
        """An empty pool (other drafters keep their own statistics in the same scheme)."""
        return LogitNGram(top=TOP, capacity=self.options.capacity)

    def get(self, group: str) -> LogitNGram:
        key = self.key(group)
        pool = self.pools.pop(key, None)
        pool = self.new() if pool is None else pool
        self.pools[key] = pool
        while len(self.pools) > self.options.max_pools:
            old, _ = self.pools.popitem(last=False)
            self.seeded.pop(old, None)
        return pool

    def seed(self, group: str, prompt: list[int]) -> None:
        key = self.key(group)
        done = self.seeded.setdefault(key, set())
        if tuple(prompt) not in done:
            done.add(tuple(prompt))
            self.get(group).seed(prompt)


class NGramDrafter:
    """STAND drafting from the group's pool into a static tree (see the module docstring)."""

    def __init__(self, options: StandOptions, tree: StaticTree, vocab_size: int) -> None:
        self.options = options
        self.tree = tree
        self.kids = tree.children()
        self.depth = tree.depths()
        self.vocab_size = vocab_size
        self.max_nodes = len(tree)
        self.pools = Pools(options)
        self.node_hits: Counter[int] = Counter()  # static node -> times on an accepted path
        self.node_drafts: Counter[int] = Counter()  # static node -> times drafted
        self.seqs: list[Sequence] = []
        self.noise: dict[int, GumbelNoise] = {}
        self.static_of: dict[int, list[int]] = {}

    def start(self, seqs: list[Sequence], capacity: int) -> None:
        self.seqs = seqs
        self.noise = {}
        self.static_of = {}
        if self.options.seed_prompt:
            for s in seqs:
                self.pools.seed(s.group, s.prompt)

    def draft(self, rows: list[int]) -> list[DraftTree]:
        return [self._draft(i) for i in rows]

    def _draft(self, i: int) -> DraftTree:
        seq = self.seqs[i]
        pool = self.pools.get(seq.group)
        stochastic = not seq.params.greedy and self.options.stochastic
        tree = DraftTree(draw="without_replacement" if stochastic else "top")
        room = seq.rule.max_new_tokens - len(seq.generated) - 1
        context = (seq.prompt + seq.generated)[-pool.max_n :]
        drafted_of: dict[int, int] = {ROOT: ROOT}
        contexts: dict[int, list[int]] = {ROOT: context}
        path_prob: dict[int, float] = {ROOT: 1.0}  # draft probability of reaching each static node
        static_of: list[int] = []
        for s_parent in (ROOT, *range(len(self.tree))):
            kids = self.kids.get(s_parent)
            if not kids or s_parent not in drafted_of:
                continue
            if s_parent != ROOT and self.depth[s_parent] >= room:
                continue
            entry = pool.lookup(contexts[s_parent])
            if entry is None:
                continue
            ids, probs = list(entry.ids), list(entry.probs)
            total = sum(probs)
            if total <= 0:
                continue
            probs = [p / total for p in probs]
            if stochastic:
                noise = self.noise.setdefault(i, GumbelNoise(seq.draft_generator))
                picks = gumbel_top_k(ids, probs, len(kids), noise)
                tree.dists[drafted_of[s_parent]] = (ids, probs)
            else:
                picks = ids[: len(kids)]
            prob_of = dict(zip(ids, probs))
            for token, s_child in zip(picks, kids):
                reach = path_prob[s_parent] * prob_of[token]
                if reach < self.options.min_path_prob:
                    # Unlikely to be reached: not worth the verification cost (EDD's pruned tree).
                    continue
                node = tree.add(token, drafted_of[s_parent], prob_of[token])
                drafted_of[s_child] = node
                path_prob[s_child] = reach
                contexts[s_child] = (contexts[s_parent] + [token])[-pool.max_n :]
                static_of.append(s_child)
        self.static_of[i] = static_of
        self.node_drafts.update(static_of)
        return tree

    def update(self, rows: list[int], verdicts: list[Verdict]) -> None:
        for i, v in zip(rows, verdicts):
            seq = self.seqs[i]
            static = self.static_of.pop(i, [])
            self.node_hits.update(static[n] for n in v.path)
            if v.kept <= 0:
                continue
            full = seq.prompt + seq.generated
            base = len(full) - v.kept  # the first token committed by this step
            at = v.kept_rows()
            if v.probs is None:
                # Greedy rows: rank the next tokens by the target's own softmax (any ranking is lossless
                # at temperature 0, and a one-hot would leave a single candidate per context).
                top = torch.topk(v.logits[at].float().softmax(-1), TOP)
            else:
                top = torch.topk(v.probs[at], min(TOP, v.probs.shape[-1]))
            ids, probs = top.indices.tolist(), top.values.tolist()
            pool = self.pools.get(seq.group)
            for j in range(len(at)):
                pool.add(full[max(0, base + j - pool.max_n) : base + j], ids[j], probs[j])

    def retain(self, rows: list[int]) -> None:
        """Pools are per group, kept across calls: nothing per row to drop."""
