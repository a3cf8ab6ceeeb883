"""The draft-model drafter: a small causal LM (or the target itself) grows a draft tree level by level.

The tree's shape comes from a tree policy (decoding/tree_policy.py): a k_config tree (SEED's
children per depth), a static Sequoia tree from a file (`python -m decoding.sequoia_tree`), or
EDD's pruned candidate tree (PCT), grown from the draft model's confidences. The draft model keeps
its own per-row KV cache in step with what the target accepted: each tree is grown level by level
(one batched draft forward per level, each level seeing the levels above it through the cache's
uncommitted slots), and after verification only the accepted nodes the draft model already
computed are kept; the rest (a leaf, the bonus token) is fed next time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from decoding.draft_tree import DraftTree, Draw, k_config_parents
from decoding.errors import ConfigError
from decoding.sampling import SamplingParams, process_logits
from decoding.sequence import Sequence
from decoding.stand import StaticTree
from decoding.target import Target
from decoding.tree_policy import PCTPolicy, StaticPolicy, TreePolicy, grow_levels, measure_ratio
from decoding.verify import Verdict, pack

log = logging.getLogger(__name__)
TREE_POLICIES = ("k_config", "sequoia", "pct")


@dataclass(frozen=True)
class SpecOptions:
    """Draft tree shape and verification rule of the model-drafting decoders (`sd`, `seed`)."""

    k_config: tuple[int, ...] = (2, 2, 1)
    multi_candidate: bool = True
    without_replacement: bool = False
    tree_policy: str = "k_config"  # k_config | sequoia (the static tree in `tree`) | pct (EDD's pruned tree)
    tree: str | None = None  # sequoia: a tree JSON ({"parents": [...]}) or a tree shipped in decoding/trees/
    pct_top_k: int = 5  # pct: candidates per expanded node (EDD's expansion width)
    pct_max_depth: int = 10  # pct: deepest drafted level (EDD: 10)
    pct_threshold: float = 0.01  # pct: leaves whose path confidence is lower are pruned (EDD: 0.01)
    pct_ratio: float | None = None  # pct: s_d / s_t; None: measured at start-up (tree_policy.measure_ratio)
    key: str = "sd"  # the config namespace, for error messages

    def __post_init__(self) -> None:
        key = self.key
        k = list(self.k_config)
        if not k or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in k):
            raise ConfigError(
                f"{key}.k_config={k} must list positive children counts per depth, e.g. [2,2,1] or [1,1,1]"
            )
        if self.tree_policy not in TREE_POLICIES:
            raise ConfigError(f"{key}.tree_policy={self.tree_policy} is not one of {', '.join(TREE_POLICIES)}")
        if self.tree_policy == "k_config" and not self.multi_candidate and max(k) > 1:
            raise ConfigError(
                f"{key}.k_config={k} drafts several candidates per position, which needs "
                f"{key}.multi_candidate=true; single-candidate SD drafts a chain such as {key}.k_config=[1,1,1]"
            )
        if self.tree_policy == "sequoia":
            if not self.tree:
                raise ConfigError(
                    f"{key}.tree_policy=sequoia needs {key}.tree=PATH, a tree JSON written by "
                    "python -m decoding.sequoia_tree sequoia.drafter=model"
                )
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
        if self.tree_policy == "sequoia" and self.tree:
            return StaticTree.load(self.tree, key=self.key).parents
        return tuple(k_config_parents(self.k_config))

    @property
    def draw(self) -> Draw:
        """How children are drawn at temperature > 0 (at temperature 0 always by rank, "top")."""
        if self.tree_policy == "pct":
            return "top"
        return "without_replacement" if self.without_replacement else "iid"


def make_policy(options: SpecOptions, draft: Target, target: Target | None) -> TreePolicy:
    """The tree policy the options name; PCT's s_d / s_t is measured here unless given."""
    if options.tree_policy != "pct":
        return StaticPolicy(options.parents, options.draw, name=options.tree_policy)
    ratio = options.pct_ratio
    if ratio is None:
        if target is None:
            raise ValueError("PCT measures s_d / s_t against the target: pass target= or set pct_ratio")
        ratio, s_d, s_t = measure_ratio(draft, target)
        log.info(
            "PCT: s_d / s_t = %.3f (draft %.1f ms, target %.1f ms per forward, measured at start-up)", ratio, s_d, s_t
        )
    return PCTPolicy(options.pct_top_k, options.pct_max_depth, options.pct_threshold, ratio)


@dataclass
class _Drafted:
    """Where a row's last tree lives in the draft cache, for keeping the accepted path after."""

    pending_cols: list[int]  # uncommitted slots of the row's pending tokens
    slots: dict[int, int]  # tree node -> uncommitted slot (the nodes the draft model computed)


class ModelDrafter:
    """Draft trees from a draft model, shaped by the tree policy of `options`.

    `target` is needed only to measure PCT's s_d / s_t at start-up (when `pct_ratio` is not given).
    """

    def __init__(self, model: Target, options: SpecOptions, vocab_size: int, target: Target | None = None) -> None:
        self.model = model
        self.options = options
        self.vocab_size = vocab_size
        self.policy = make_policy(options, model, target)
        self.max_nodes = self.policy.max_nodes
        self.seqs: list[Sequence] = []
        self.pending: dict[int, list[int]] = {}  # per row: tokens accepted but not in the draft cache
        self.position: dict[int, int] = {}  # per row: its row in the draft cache
        self.drafted: dict[int, _Drafted] = {}

    def start(self, seqs: list[Sequence], capacity: int) -> None:
        self.seqs = seqs
        self.cache, pending = self.model.start([s.prompt for s in seqs], capacity)
        self.pending = dict(enumerate(pending))
        self.position = {i: i for i in range(len(seqs))}
        self.drafted = {}

    def _cache_rows(self, rows: list[int]) -> list[int] | None:
        positions = [self.position[i] for i in rows]
        return None if positions == list(range(self.cache.batch)) else positions

    def draft(self, rows: list[int]) -> list[DraftTree]:
        """Trees for the given rows (any subset: a scheduler drafts the rows that wait to draft)."""
        batch = len(rows)
        params = [self.seqs[i].params for i in rows]
        cache_rows = self._cache_rows(rows)
        packed = pack([self.pending[i] for i in rows], [DraftTree() for _ in rows])
        p = packed.n_pending
        logits = self.model.forward(
            self.cache, packed.tokens, packed.see, packed.depth, logits_at=torch.tensor([p - 1]), rows=cache_rows
        )
        # A step commits at most the accepted path plus one token, so nodes deeper than a row's
        # remaining budget minus one could never be kept (and could pass the model's context).
        growths = [
            self.policy.grow(
                params[b].greedy,
                self.seqs[i].draft_generator,
                self.seqs[i].rule.max_new_tokens - len(self.seqs[i].generated) - 1,
            )
            for b, i in enumerate(rows)
        ]
        # Each node sees its row's pending tokens and its own ancestors; the first level sits one past them.
        slots = grow_levels(
            growths,
            logits,
            lambda b, lg: self._dists(lg, params[b]),
            lambda tokens, see, depth, offset: self.model.forward(
                self.cache, tokens, see, depth, offset=offset, rows=cache_rows
            ),
            [range(packed.pads[b], p) for b in range(batch)],
            [len(self.pending[i]) for i in rows],
            p,
        )
        for b, i in enumerate(rows):
            self.drafted[i] = _Drafted(list(range(packed.pads[b], p)), slots[b])
        return [g.tree for g in growths]

    def _dists(self, logits: torch.Tensor, params: SamplingParams) -> list[torch.Tensor]:
        """Draft distributions [V] on the CPU for logits [n, V]: at temperature 0 the plain softmax (for
        ranking and confidences), above it the processed distribution the draws follow."""
        logits = self._fit_vocab(logits)
        q = logits.float().softmax(-1) if params.greedy else process_logits(logits[None], [params])[0]
        return list(q.cpu().unbind(0))

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # A draft model's embedding may be padded past the target's vocabulary, or short of it.
        v = logits.shape[-1]
        if v == self.vocab_size:
            return logits
        if v > self.vocab_size:
            return logits[..., : self.vocab_size]
        return torch.nn.functional.pad(logits, (0, self.vocab_size - v), value=float("-inf"))

    def update(self, rows: list[int], verdicts: list[Verdict]) -> None:
        for i, v in zip(rows, verdicts):
            drafted = self.drafted.pop(i)
            seq = self.seqs[i]
            if seq.done:
                continue
            # Accepted nodes the draft model computed form a prefix of the path (the shallower
            # levels). A path from another drafter (a grafted tree) keeps none of them.
            computed = [n for n in v.path if n in drafted.slots]
            pos = self.position[i]
            self.cache.keep(pos, drafted.pending_cols + [drafted.slots[n] for n in computed])
            # Everything committed that the draft cache lacks is fed next time.
            self.pending[i] = (seq.prompt + seq.generated)[int(self.cache.lens[pos]) :]

    def retain(self, rows: list[int]) -> None:
        """Drop every other row from the draft cache (a finished sequence costs nothing more)."""
        order = sorted(rows, key=self.position.__getitem__)
        self.cache.select_rows(torch.tensor([self.position[i] for i in order], dtype=torch.long))
        self.position = {i: pos for pos, i in enumerate(order)}
        self.pending = {i: self.pending[i] for i in order}
