"""The EDD drafter: trees from the Effective Draft Decoder (decoding/edd/model.py), which reads the
target's hidden states of the committed tokens as a soft prompt.

Drafting mirrors the training mask: the soft prompt holds the hidden states of every committed
token (the target computes them while verifying, `Verdict.hidden`); the tokens after them (the
bonus token, then the tree) form the current block, which sees the whole soft prompt and its own
tokens only. The EDD keeps the soft prompt's keys/values in its own per-row cache, appends the newly
committed hidden states with each draft's first forward, and grows its tree one forward per level.
The drafter only proposes: the target verifies every tree, so outputs stay the target's.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from decoding.base.errors import BackendError
from decoding.edd.model import EddModel
from decoding.runtime.runner import ModelRunner
from decoding.speculation.draft_tree import DraftTree
from decoding.speculation.sampling import SamplingParams, draft_dists
from decoding.speculation.slot import Slot
from decoding.speculation.timing import speed_ratio, timed_ms
from decoding.speculation.verify import Verdict
from decoding.trees.policies import DraftTreeOptions, grow_levels, make_policy


@dataclass
class _Row:
    """A sequence's soft prompt: `known` context tokens have hidden states; those not yet fed to the
    EDD wait in `queue`."""

    known: int
    queue: list[torch.Tensor] = field(default_factory=list)


class EddDrafter:
    """Drafts trees with an EDD from the target's hidden states of the committed tokens; the tree's
    shape is the tree policy of `options` (decoding/trees/policies.py: k_config, sequoia or pct).

    Per row: `known` tokens of the context have hidden states (the target's cache length); those
    not yet fed to the EDD wait in `queue`; the rest of the context (the bonus token, or on the first
    round the prompt's tail the target has not read) is the current block. A row whose block is
    longer than the EDD was trained on, or has no room left, gets an empty tree this round.
    """

    learns_top = 0  # its update reads no Verdict.top

    def __init__(
        self,
        edd: EddModel,
        target: ModelRunner,
        options: DraftTreeOptions,
        vocab: torch.Tensor | None = None,
        coupled: bool = True,
    ) -> None:
        self.edd = edd
        self.coupled = coupled  # verify.rule=match_gumbel: children ordered by the target's own noise
        self.target = target
        # draft.vocab: the corpus's most frequent tokens, to which each call adds its prompts' tokens and
        # every token committed since (None: the whole vocabulary); `head_rows` are the head's rows for it.
        self.base_vocab = vocab
        self.vocab_set: set[int] = set() if vocab is None else set(vocab.tolist())
        self.vocab = vocab
        self.head_rows = None if vocab is None else edd.vocab_rows(vocab)
        self.policy = make_policy(options, self._measure_ratio)
        self.max_nodes = self.policy.max_nodes
        self.vocab_size = int(edd.shared[1].weight.shape[0])
        target.capture_hidden(edd.config.layer)
        self.cache = edd.new_cache(0, 1)  # row i: the soft prompt of the target's row i

    def _measure_ratio(self, context: int = 64, repeats: int = 5) -> float:
        """PCT's s_d / s_t here: one EDD forward (one token after a soft prompt of `context`) against
        one target verification forward of one token, medians of `repeats`."""
        cache = self.edd.new_cache(1, context + 2)
        size = self.edd.lm_config.hidden_size
        prompt = torch.zeros(1, context, size)
        causal = torch.ones(context, context, dtype=torch.bool).tril()[None]
        self.edd.step(cache, prompt, causal, torch.arange(context)[None], torch.zeros(0, dtype=torch.long))
        cache.advance(torch.tensor([context]))
        token, one = self.edd.embed(torch.tensor([[7]])), torch.ones(1, 1, 1, dtype=torch.bool)
        at, depth = torch.tensor([0]), torch.zeros(1, 1, dtype=torch.long)
        times = timed_ms(lambda: self.edd.step(cache, token, one, depth, at, head_rows=self.head_rows), repeats)
        return speed_ratio(statistics.median(times), self.target, context, repeats)[0]

    def peak_cache_bytes(self) -> int:
        return 0  # the soft prompt's cache is one layer's: not counted beside the target's

    def admit(self, slots: list[Slot]) -> None:
        """The rows' soft prompts start with the hidden states of the prefix their admission shared
        (each slot's `start_hidden`); the rest of each prompt comes with its first verdict."""
        rows, seqs = [s.row for s in slots], [s.seq for s in slots]
        if self.base_vocab is not None:
            self._extend_vocab(t for s in seqs for t in s.prompt)
        capacity = max(len(s.prompt) + s.rule.max_new_tokens for s in seqs) + self.max_nodes + 1
        # The soft prompt (<= capacity) plus one draft's uncommitted slots: pads, queue, block, tree.
        self.cache.reserve(max(rows) + 1, 2 * capacity + self.edd.config.max_block + self.max_nodes)
        # Rows admitted together share one head; rows of several admissions come in separate groups.
        groups: dict[int, list[Slot]] = {}
        for slot in slots:
            groups.setdefault(id(slot.start_hidden), []).append(slot)
        for members in groups.values():
            head = members[0].start_hidden
            group = [s.row for s in members]
            n = 0 if head is None else len(head)
            if head is not None and n:
                scratch = self.edd.new_cache(1, n)
                causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
                self.edd.step(scratch, head[None], causal, torch.arange(n)[None], torch.zeros(0, dtype=torch.long))
                scratch.advance(torch.tensor([n]))
                self.cache.copy_prefix(scratch, 0, group, n)
            else:
                self.cache.clear(group)
            for slot in members:
                slot.put(self, _Row(n))

    def _extend_vocab(self, tokens: Iterable[int]) -> None:
        """Add `tokens` to the draft vocabulary (and the head's rows for it) if any are new."""
        new = set(tokens) - self.vocab_set
        if new or self.vocab is None:
            self.vocab_set |= new
            self.vocab = torch.tensor(sorted(self.vocab_set), dtype=torch.long)
            self.head_rows = self.edd.vocab_rows(self.vocab)

    def draft(self, slots: list[Slot]) -> list[DraftTree]:
        trees = [DraftTree() for _ in slots]
        active = []
        for b, slot in enumerate(slots):
            seq = slot.seq
            block = (seq.prompt + seq.generated)[slot.state(self).known :]
            if self.base_vocab is not None:
                self._extend_vocab(block)  # the tokens committed since the last draft
            room = seq.room
            if room >= 1 and 1 <= len(block) <= self.edd.config.max_block:
                active.append((b, slot, block, room))
        if active:
            for (b, _, _, _), tree in zip(active, self._grow(active)):
                trees[b] = tree
        return trees

    @torch.inference_mode()
    def _grow(self, active: list[tuple[int, Slot, list[int], int]]) -> list[DraftTree]:
        edd = self.edd
        batch = len(active)
        own: list[_Row] = [slot.state(self) for _, slot, _, _ in active]
        queued = [torch.cat(r.queue) if r.queue else None for r in own]
        k = [0 if q is None else len(q) for q in queued]
        width = max(kb + len(block) for kb, (_, _, block, _) in zip(k, active))
        embeds = torch.zeros(batch, width, edd.lm_config.hidden_size, dtype=edd.dtype, device=edd.device)
        see = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
        depth = torch.zeros(batch, width, dtype=torch.long)
        pads = []
        for b, ((_, _, block, _), q) in enumerate(zip(active, queued)):
            # [pad, queued hidden states, block tokens]: one causal run (the block sees every
            # hidden state before it, the soft prompt stays causal).
            pad = width - k[b] - len(block)
            pads.append(pad)
            if q is not None:
                embeds[b, pad : pad + k[b]] = q.to(edd.device, edd.dtype)
            embeds[b, pad + k[b] :] = edd.embed(torch.tensor(block))
            see[b, pad:, pad:] = torch.ones(width - pad, width - pad, dtype=torch.bool).tril()
            depth[b, pad:] = torch.arange(width - pad)
        positions = [slot.row for _, slot, _, _ in active]
        cache_rows = None if positions == list(range(self.cache.batch)) else positions
        logits = edd.step(
            self.cache, embeds, see, depth, torch.tensor([width - 1]), rows=cache_rows, head_rows=self.head_rows
        )
        seqs = [slot.seq for _, slot, _, _ in active]
        growths = [
            self.policy.grow(s.params.greedy, s.draft_generator, room, s.coupling() if self.coupled else None)
            for s, (*_, room) in zip(seqs, active)
        ]

        def level(tokens: torch.Tensor, see: torch.Tensor, depth: torch.Tensor, offset: int) -> torch.Tensor:
            every = torch.arange(tokens.shape[1])
            return edd.step(self.cache, edd.embed(tokens), see, depth, every, offset, cache_rows, self.head_rows)

        # Tree nodes belong to the block: they see its columns (the queue's too) and their ancestors.
        grow_levels(
            growths,
            logits,
            lambda b, lg: _dists(lg, seqs[b].params, self.vocab, self.vocab_size),
            level,
            [range(pads[b], width) for b in range(batch)],
            [width - pads[b] for b in range(batch)],
            width,
        )
        # The queued hidden states join the soft prompt; the block and the tree never do.
        for b, ((_, slot, _, _), r) in enumerate(zip(active, own)):
            if k[b]:
                self.cache.commit(slot.row, list(range(pads[b], pads[b] + k[b])))
            r.queue = []
        return [g.tree for g in growths]

    def update(self, slots: list[Slot], verdicts: list[Verdict]) -> None:
        for slot, v in zip(slots, verdicts):
            if slot.seq.done:
                continue
            if v.hidden is None:
                raise BackendError("the EDD drafter needs the target's hidden states (ModelRunner.capture_hidden)")
            own: _Row = slot.state(self)
            own.queue.append(v.hidden)
            own.known += len(v.hidden)

    def release(self, slots: list[Slot], live: list[Slot]) -> None:
        """Its soft prompt's cache row is simply admitted again later; the row's state goes with its slot."""


def _dists(
    logits: torch.Tensor, params: SamplingParams, ids: torch.Tensor | None, vocab_size: int
) -> list[torch.Tensor]:
    """Draft distributions for logits [n, V], or [n, len(ids)] over the draft vocabulary `ids` (the
    rest of the vocabulary at -inf: probability 0)."""
    if ids is not None:
        full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
        logits = full.index_copy_(1, ids.to(logits.device), logits)
    return draft_dists(logits, params)
