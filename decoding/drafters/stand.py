"""STAND's model-free drafter (STAND, section 4.2): draft trees from the logit N-gram pool.

The trajectories of one ToT step share a pool (`GenRequest.group`; or a whole problem, or the
whole run): every committed position adds the target distribution the verifier already computed,
so a trajectory drafts from what the others produced. A static tree topology is filled from the
root down: at each node the longest matching context gives up to 10 candidates, and the node's
children take them in order: under verify.rule=match_gumbel ordered by log q + the target's own
Gumbel noise at the node's position (coupled drafting: the first child is the target's sample
whenever the pool agrees with it), else sampled without replacement by Gumbel-top-k with the
drafter's own noise (stochastic drafting, verified by Sequoia's rule), or by rank (deterministic, and
always at temperature 0). A node whose context matches nothing ends its branch, so trees shrink where
the pool knows nothing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from decoding.drafters.ngram import LogitNGram
from decoding.drafters.options import StandOptions
from decoding.drafters.plugin import BuildConfig
from decoding.drafters.pools import Pools
from decoding.drafters.suffix import SuffixDrafter
from decoding.drafters.union import UnionDrafter
from decoding.runtime.runner import ModelRunner
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.slot import Slot
from decoding.speculation.verify import Verdict, kept_tops
from decoding.trees.static import StaticTree

if TYPE_CHECKING:
    from decoding.runtime.models import LoadedModel
    from decoding.speculation.stopping import Detokenizer

TOP = 10  # candidates stored per context (STAND: top-10)


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


class StandDrafter:
    """STAND drafting from the group's pool into a static tree (see the module docstring)."""

    def __init__(self, options: StandOptions, tree: StaticTree, vocab_size: int, coupled: bool = True) -> None:
        self.options = options
        self.coupled = coupled  # verify.rule=match_gumbel: candidates ordered by the target's noise
        self.tree = tree
        self.vocab_size = vocab_size
        self.max_nodes = len(tree)
        self.learns_top = TOP
        self.pools = Pools(options.scope, options.max_pools, lambda: LogitNGram(top=TOP, capacity=options.capacity))

    def admit(self, slots: list[Slot]) -> None:
        if self.options.prime_with_prompt:
            for slot in slots:
                self.pools.prime(slot.seq.group, slot.seq.prompt)

    def draft(self, slots: list[Slot]) -> list[DraftTree]:
        return [self._draft(slot) for slot in slots]

    def _draft(self, slot: Slot) -> DraftTree:
        seq = slot.seq
        pool = self.pools.get(seq.group)
        coupling = seq.coupling() if self.coupled and not seq.params.greedy else None
        stochastic = not seq.params.greedy and self.options.stochastic and coupling is None
        tree = DraftTree(draw="without_replacement" if stochastic else "top")
        # Per drafted node: its lookup context, the draft probability of reaching it and its depth. A
        # node is expanded only after its parent was, so each is one step from its parent's.
        contexts = {ROOT: seq.tail(pool.max_n)}
        reach = {ROOT: 1.0}
        depth = {ROOT: 0}

        def children(node: int, k: int) -> list[tuple[int, float] | None]:
            if node not in contexts:
                parent = tree.parents[node]
                contexts[node] = (contexts[parent] + [tree.tokens[node]])[-pool.max_n :]
                reach[node] = reach[parent] * tree.probs[node]
                depth[node] = depth[parent] + 1
            entry = pool.lookup(contexts[node])
            if entry is None:
                return []
            ids, probs = list(entry.ids), list(entry.probs)
            total = sum(probs)
            if total <= 0:
                return []
            probs = [p / total for p in probs]
            if coupling is not None:
                live = [(t, q) for t, q in zip(ids, probs) if q > 0]
                picks = coupling.order([t for t, _ in live], [math.log(q) for _, q in live], depth[node])[:k]
            elif stochastic:
                noise = slot.own(self, lambda: GumbelNoise(seq.draft_generator))
                picks = gumbel_top_k(ids, probs, k, noise)
                tree.dists[node] = (ids, probs)
            else:
                picks = ids[:k]
            prob_of = dict(zip(ids, probs))
            # Children unlikely to be reached are not worth their verification cost (EDD's pruned tree).
            low = self.options.min_path_prob
            return [None if reach[node] * prob_of[t] < low else (t, prob_of[t]) for t in picks]

        tree.shape_nodes = self.tree.fill(tree, seq.room, children)
        return tree

    def update(self, slots: list[Slot], verdicts: list[Verdict]) -> None:
        kept = [(slot.seq, v) for slot, v in zip(slots, verdicts) if v.kept > 0]
        if not kept:
            return
        # The target's top-10 at each committed position (greedy rows: its softmax's, since any
        # ranking is lossless at temperature 0 and a one-hot would leave one candidate per context).
        # kept_rows(): a drafter shown only its own part of a merged tree's path learns that part.
        tops = kept_tops([v for _, v in kept], TOP)
        for (seq, v), (ids, probs) in zip(kept, tops):
            pool = self.pools.get(seq.group)
            # This step's tokens and the contexts before them: the sequence's tail, not all of it.
            tail = seq.tail(v.kept + pool.max_n)
            base = len(tail) - v.kept  # the first token committed by this step
            for k in range(len(ids)):
                pool.add(tail[max(0, base + k - pool.max_n) : base + k], ids[k], probs[k])

    def release(self, slots: list[Slot], live: list[Slot]) -> None:
        """Pools are per group, kept across calls; a sequence's noise goes with its slot."""

    def peak_cache_bytes(self) -> int:
        return 0  # no model, no KV cache


def build(
    config: BuildConfig, target: ModelRunner, tokenizer: Detokenizer, draft: LoadedModel | None
) -> StandDrafter | UnionDrafter:
    """STAND's pool, with stand.suffix the suffix drafter's tree beside it (merged as one trie under
    the matched rules: a token both propose at the same place is verified once)."""
    options: StandOptions = config.section("stand")
    stand = StandDrafter(options, StaticTree.load(options.tree), target.vocab_size, config.verify.coupled)
    if not options.suffix:
        return stand
    return UnionDrafter(
        [stand, SuffixDrafter(config.section("suffix"), config.verify.coupled)], config.verify.rule != "rejection"
    )
