"""The draft-model drafter: a small causal LM (or the target itself) grows a draft tree level by level.

The tree's shape comes from a tree policy (decoding/trees/policies.py): a k_config tree (SEED's
children per depth), a static Sequoia tree from a file (`python -m tuning.calibrate_tree`), or
EDD's pruned candidate tree (PCT), grown from the draft model's confidences. The draft model keeps
its own per-row KV cache in step with what the target accepted: each tree is grown level by level
(one batched draft forward per level, each level seeing the levels above it through the cache's
uncommitted slots), and after verification only the accepted nodes the draft model already
computed are kept; the rest (a leaf, the bonus token) is fed next time.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from decoding.base.errors import BackendError
from decoding.drafters.edd import EddDrafter
from decoding.drafters.plugin import BuildConfig
from decoding.edd.model import EddModel, draft_vocab
from decoding.runtime.models import LoadedModel
from decoding.runtime.packing import pack
from decoding.runtime.runner import ModelRunner
from decoding.speculation.draft_tree import DraftTree
from decoding.speculation.sampling import SamplingParams, draft_dists
from decoding.speculation.sequence import admission_room, widest_need
from decoding.speculation.slot import Slot
from decoding.speculation.stopping import Detokenizer
from decoding.speculation.timing import speed_ratio, time_forward
from decoding.speculation.verify import Verdict
from decoding.trees.policies import DraftTreeOptions, grow_levels, make_policy

log = logging.getLogger(__name__)


@dataclass
class _Drafted:
    """Where a row's last tree lives in the draft cache, for keeping the accepted path after."""

    pending_cols: list[int]  # uncommitted slots of the row's pending tokens
    node_cols: dict[int, int]  # tree node -> its uncommitted cache column (the nodes the draft model computed)


@dataclass
class _Row:
    """A sequence's state in the draft model's cache (its row there is the target's row)."""

    pending: list[int]  # tokens accepted but not in the draft cache
    drafted: _Drafted | None = None  # its last tree, until the verdict


class ModelDrafter:
    """Draft trees from a draft model, shaped by the tree policy of `options`.

    `target` is needed only to measure PCT's s_d / s_t at start-up (when `pct_ratio` is not given).
    """

    learns_top = 0  # its update reads no Verdict.top

    def __init__(
        self,
        model: ModelRunner,
        options: DraftTreeOptions,
        vocab_size: int,
        target: ModelRunner | None = None,
        coupled: bool = True,
    ) -> None:
        self.model = model
        self.coupled = coupled  # verify.rule=match_gumbel: children ordered by the target's own noise
        self.options = options
        self.vocab_size = vocab_size
        self.target = target
        self.policy = make_policy(options, self._measure_ratio)
        self.max_nodes = self.policy.max_nodes
        self.cache = model.new_cache(0, 1, graphs=True)  # row i: the draft model's cache of the target's row i

    def admit(self, slots: list[Slot]) -> None:
        rows, seqs = [s.row for s in slots], [s.seq for s in slots]
        admitted = self.model.admit(self.cache, rows, [s.prompt for s in seqs], admission_room(seqs, self.max_nodes))
        for slot, pending in zip(slots, admitted.pending):
            slot.put(self, _Row(pending))

    def _measure_ratio(self, context: int = 64, repeats: int = 5) -> float:
        """PCT's s_d / s_t on this machine: one forward of each model of one token after `context`."""
        if self.target is None:
            raise ValueError("PCT measures s_d / s_t against the target: pass target= or set pct_ratio")
        s_d = statistics.median(time_forward(self.model, context, 1, 1, repeats))
        ratio, s_t = speed_ratio(s_d, self.target, context, repeats)
        log.info(
            "PCT: s_d / s_t = %.3f (draft %.1f ms, target %.1f ms per forward, measured at start-up)", ratio, s_d, s_t
        )
        return ratio

    def peak_cache_bytes(self) -> int:
        return self.model.peak_cache_bytes

    def _cache_rows(self, rows: list[int]) -> list[int] | None:
        return None if rows == list(range(self.cache.batch)) else rows

    def draft(self, slots: list[Slot]) -> list[DraftTree]:
        """Trees for the given slots (any subset: a scheduler drafts the rows that wait to draft)."""
        batch = len(slots)
        own: list[_Row] = [s.state(self) for s in slots]
        params = [s.seq.params for s in slots]
        cache_rows = self._cache_rows([s.row for s in slots])
        packed = pack([r.pending for r in own], [DraftTree() for _ in slots])
        p = packed.n_pending
        logits = self.model.forward(
            self.cache, packed.tokens, packed.see, packed.depth, logits_at=torch.tensor([p - 1]), rows=cache_rows
        ).logits
        growths = [
            self.policy.grow(params[b].greedy, s.draft_generator, s.room, s.coupling() if self.coupled else None)
            for b, s in enumerate(slot.seq for slot in slots)
        ]
        # Each node sees its row's pending tokens and its own ancestors; the first level sits one past them.
        levels = grow_levels(
            growths,
            logits,
            lambda b, lg: self._dists(lg, params[b]),
            lambda tokens, see, depth, offset: (
                self.model.forward(self.cache, tokens, see, depth, offset=offset, rows=cache_rows).logits
            ),
            [range(packed.pads[b], p) for b in range(batch)],
            [len(r.pending) for r in own],
            p,
        )
        for b, r in enumerate(own):
            r.drafted = _Drafted(list(range(packed.pads[b], p)), levels[b])
        return [g.tree for g in growths]

    def _dists(self, logits: torch.Tensor, params: SamplingParams) -> list[torch.Tensor]:
        return draft_dists(self._fit_vocab(logits), params)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # A draft model's embedding may be padded past the target's vocabulary, or short of it.
        v = logits.shape[-1]
        if v == self.vocab_size:
            return logits
        if v > self.vocab_size:
            return logits[..., : self.vocab_size]
        return torch.nn.functional.pad(logits, (0, self.vocab_size - v), value=float("-inf"))

    def update(self, slots: list[Slot], verdicts: list[Verdict]) -> None:
        for slot, v in zip(slots, verdicts):
            own: _Row = slot.state(self)
            drafted, own.drafted = own.drafted, None
            seq = slot.seq
            if seq.done:
                continue
            if drafted is not None:  # a row the step planner left undrafted only catches up below
                # Accepted nodes the draft model computed form a prefix of the path (the shallower
                # levels). A path from another drafter (a grafted tree) keeps none of them.
                computed = [n for n in v.drafted_path if n in drafted.node_cols]
                self.cache.commit(slot.row, drafted.pending_cols + [drafted.node_cols[n] for n in computed])
            # Everything committed that the draft cache lacks is fed next time.
            own.pending = (seq.prompt + seq.generated)[int(self.cache.lens[slot.row]) :]

    def release(self, slots: list[Slot], live: list[Slot]) -> None:
        """A left row holds nothing (paged, its blocks go back) until it is admitted again. Rows past
        the highest live one, and positions no live row needs, go back."""
        self.model.release(self.cache, [s.row for s in slots if s.row < self.cache.batch])
        rows = max((s.row for s in live), default=-1) + 1
        self.model.give_back(self.cache, rows, lambda: widest_need([s.seq for s in live], self.max_nodes))


def build(
    config: BuildConfig, target: ModelRunner, tokenizer: Detokenizer, draft: LoadedModel | None
) -> ModelDrafter | EddDrafter:
    """The drafter of a loaded draft model: an EDD (draft.path=edd) reads the target's hidden states,
    over its draft vocabulary when draft.vocab is set; any other causal LM gets a runner of its own
    (its own forward count), also for the target's weights."""
    if draft is None:
        raise BackendError(f"decoder={config.name} needs a draft model (draft.path)")
    if isinstance(draft.model, EddModel):
        size = None if config.draft is None else config.draft.vocab
        vocab = None if size is None else draft_vocab(Path(draft.source), size)
        return EddDrafter(draft.model, target, config.draft_tree, vocab, config.verify.coupled)
    # The target too: tree_policy=pct measures s_d / s_t against it at start-up.
    # One budget for the target's and the draft's prefixes.
    runner = ModelRunner(draft.model, target.prefixes.budget, draft.static, draft.strict_graphs, paged=draft.paged_kv)
    return ModelDrafter(runner, config.draft_tree, target.vocab_size, target=target, coupled=config.verify.coupled)
