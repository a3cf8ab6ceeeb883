"""The draft-model drafter: a small causal LM (or the target itself) expands a k_config tree.

The draft model keeps its own per-row KV cache in step with what the target accepted: each tree
is grown level by level (one batched draft forward per level, each level seeing the levels above
it through the cache's uncommitted slots), and after verification only the accepted nodes the
draft model already computed are kept; the rest (a leaf, the bonus token) is fed next time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.draft_tree import ROOT, DraftTree, Draw, k_config_size
from decoding.errors import ConfigError
from decoding.sampling import SamplingParams, process_logits
from decoding.sequence import Sequence
from decoding.target import Target
from decoding.verify import Verdict, pack


@dataclass(frozen=True)
class SpecOptions:
    """Draft tree shape and verification rule of the model-drafting decoders (`sd`, `seed`)."""

    k_config: tuple[int, ...] = (2, 2, 1)
    multi_candidate: bool = True
    without_replacement: bool = False
    key: str = "sd"  # the config namespace, for error messages

    def __post_init__(self) -> None:
        k = list(self.k_config)
        if not k or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in k):
            raise ConfigError(
                f"{self.key}.k_config={k} must list positive children counts per depth, e.g. [2,2,1] or [1,1,1]"
            )
        if not self.multi_candidate and max(k) > 1:
            raise ConfigError(
                f"{self.key}.k_config={k} drafts several candidates per position, which needs "
                f"{self.key}.multi_candidate=true; single-candidate SD drafts a chain "
                f"such as {self.key}.k_config=[1,1,1]"
            )

    @property
    def draw(self) -> Draw:
        return "without_replacement" if self.without_replacement else "iid"


@dataclass
class _Drafted:
    """Where a row's last tree lives in the draft cache, for keeping the accepted path after."""

    pending_cols: list[int]  # uncommitted slots of the row's pending tokens
    slots: dict[int, int]  # tree node -> uncommitted slot (the nodes the draft model computed)


class ModelDrafter:
    def __init__(self, model: Target, options: SpecOptions, vocab_size: int) -> None:
        self.model = model
        self.options = options
        self.vocab_size = vocab_size
        self.max_nodes = k_config_size(options.k_config)
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
        trees = [DraftTree(draw="top" if pr.greedy else self.options.draw) for pr in params]
        depth0 = [len(self.pending[i]) - 1 for i in rows]
        slots: list[dict[int, int]] = [{} for _ in rows]
        level: list[list[int]] = [[ROOT] for _ in rows]
        written = p
        # A step commits at most the accepted path plus one token, so nodes deeper than a row's
        # remaining budget minus one could never be kept (and could pass the model's context).
        room = [self.seqs[i].rule.max_new_tokens - len(self.seqs[i].generated) - 1 for i in rows]
        for d, k in enumerate(self.options.k_config):
            nxt: list[list[int]] = [[] for _ in rows]
            for b, i in enumerate(rows):
                if d >= room[b]:
                    continue
                for j, node in enumerate(level[b]):
                    nxt[b] += self._children(trees[b], node, logits[b, j], k, params[b], self.seqs[i])
            if d == len(self.options.k_config) - 1 or not any(nxt):
                break
            # Score the new level: each node sees its row's pending tokens and its own ancestors.
            width = max(len(n) for n in nxt)
            tokens = torch.zeros(batch, width, dtype=torch.long)
            see = torch.zeros(batch, width, written + width, dtype=torch.bool)
            depth = torch.zeros(batch, width, dtype=torch.long)
            for b in range(batch):
                see[b, torch.arange(width), written + torch.arange(width)] = True
                for j, node in enumerate(nxt[b]):
                    tree = trees[b]
                    tokens[b, j] = tree.tokens[node]
                    see[b, j, packed.pads[b] : p] = True
                    for anc in tree.path(node)[:-1]:
                        see[b, j, slots[b][anc]] = True
                    depth[b, j] = depth0[b] + d + 1
                    slots[b][node] = written + j
            logits = self.model.forward(self.cache, tokens, see, depth, offset=written, rows=cache_rows)
            written += width
            level = nxt
        for b, i in enumerate(rows):
            self.drafted[i] = _Drafted(list(range(packed.pads[b], p)), slots[b])
        return trees

    def _children(
        self, tree: DraftTree, node: int, logits: torch.Tensor, k: int, params: SamplingParams, seq: Sequence
    ) -> list[int]:
        logits = self._fit_vocab(logits)
        if params.greedy:
            conf = logits.float().softmax(-1)
            top = torch.topk(logits, k)
            return [tree.add(int(x), node, float(conf[x])) for x in top.indices]
        q = process_logits(logits[None], [params])[0].cpu()
        if tree.draw == "without_replacement":
            k = min(k, int((q > 0).sum()))
            picks = torch.multinomial(q, k, replacement=False, generator=seq.draft_generator)
        else:
            picks = torch.multinomial(q, k, replacement=True, generator=seq.draft_generator)
        tree.dists[node] = q.cpu()
        return [tree.add(int(x), node, float(q[x])) for x in picks]

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # A draft model's embedding may be padded past the target's vocabulary, or short of it.
        v = logits.shape[-1]
        if v == self.vocab_size:
            return logits
        if v > self.vocab_size:
            return logits[: self.vocab_size]
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
