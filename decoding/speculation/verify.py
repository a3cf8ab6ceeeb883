"""Batched tree verification: one target forward scores a draft tree for each of many rows.

Each row feeds its pending tokens (not yet in the target's cache: the last committed token, or more
on a row's first step) followed by its tree, packed as decoding/runtime/packing.py lays them out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoding.runtime.kv_cache import KVCache
from decoding.runtime.packing import Packed, pack
from decoding.runtime.runner import ModelRunner, Scored
from decoding.speculation.acceptance import walk_matched, walk_rejection
from decoding.speculation.device_walk import read_walks, walk_matched_rows
from decoding.speculation.draft_tree import DraftTree
from decoding.speculation.gumbel import draw_top_rows, gumbel_pick, gumbel_pick_rows, gumbel_targets, key
from decoding.speculation.logprobs import RowReading
from decoding.speculation.options import Rule
from decoding.speculation.row_sampling import RowSampling
from decoding.speculation.sampling import argmax_rows, processed_logits, top_k, top_k_rows
from decoding.speculation.sequence import Sequence

Top = tuple[list[list[int]], list[list[float]]]  # per row: the top-k token ids and their probabilities


@dataclass(eq=False)
class Verdict:
    """What verification decided for one row: made once by the acceptance stage (`accept`); the
    commit completes it with what the sequence kept (`kept`, set in place: a `dataclasses.replace`
    a row cost more than the commit's other work)."""

    tree: DraftTree
    path: list[int]  # accepted nodes, root's child first
    token: int  # the token after them (bonus or residual draw)
    # Target distributions after processing, at the root and at each node [1 + N, V], where the rule
    # draws from them (match_multinomial; rejection's drafted rows on the CPU); else None: greedy rows,
    # and Gumbel-max draws, which read the processed logits (a softmax of every row cost more than the draws).
    probs: torch.Tensor | None
    logits: torch.Tensor  # raw target logits at the same places
    kept: int = 0  # tokens the sequence kept (stop rules may cut the accepted run); set by the commit
    # With ModelRunner.capture_hidden: the captured layer's hidden states of the tokens this step put in
    # the target's cache (the pending tokens, then the accepted path) [P + len(path), H]; EDD reads them.
    hidden: torch.Tensor | None = None
    # Where the step planner cut the drafted tree: each verified node's node in the tree the drafter
    # drew (None: verified whole). Drafters that keep per-node state read `drafted_path`.
    drafted_nodes: list[int] | None = None
    # verify(top=k): the k most likely next tokens and their probabilities (the processed
    # distribution; the softmax of the logits for greedy rows) at the root and along the accepted
    # path, in that order (1 + len(path) rows of k each), as lists: what drafters' tables take.
    top: Top | None = None
    # The processed logits at the root and at each node [1 + N, V] where the acceptance made them and
    # the sequence asks for log-probabilities (else None: greedy rows, rows the kernel drew from their raw
    # logits); the commit reads them and lets them go (a view keeps its whole group's tensor alive).
    scores: torch.Tensor | None = None
    # What the top-k pass of `top` read of the same rows (the commit's log-probabilities follow from
    # it); None where it read none or off the CPU's kernel. The commit lets it go, as `scores`.
    reading: RowReading | None = None

    @property
    def drafted_path(self) -> list[int]:
        """The accepted nodes as nodes of the tree the drafter drew."""
        return self.path if self.drafted_nodes is None else [self.drafted_nodes[n] for n in self.path]

    @property
    def tokens(self) -> list[int]:
        return [self.tree.tokens[i] for i in self.path] + [self.token]

    def kept_rows(self) -> list[int]:
        """Rows of `probs` / `logits` whose distributions predicted the kept tokens, in order."""
        return [0, *(1 + n for n in self.path)][: self.kept]


def verify(
    target: ModelRunner,
    cache: KVCache,
    pending: list[list[int]],
    trees: list[DraftTree],
    seqs: list[Sequence],
    sampling: RowSampling,
    rule: Rule,
    rows: list[int] | None = None,
    top: int = 0,
) -> tuple[Packed, list[Verdict]]:
    """Score every row's tree in one forward and decide each under `rule` (see `target_sampler`).

    `seqs` are the rows' sequences (their seeds, generators and positions), `sampling` their settings
    (decoding/speculation/row_sampling.py); `rows` the cache rows verified (default: all, in order);
    `top` > 0: each verdict carries its distributions' top tokens along the accepted path
    (`Verdict.top`, what drafters learn from). The cache holds the new entries uncommitted; the caller
    commits `packed.committed(b, path)` for the rows that go on.
    """
    packed = pack(pending, trees)
    return packed, accept(packed, target.score(cache, packed, rows), trees, seqs, sampling, rule, top)


def accept(
    packed: Packed,
    scored: Scored,
    trees: list[DraftTree],
    seqs: list[Sequence],
    sampling: RowSampling,
    rule: Rule,
    top: int = 0,
    drafted_nodes: list[list[int] | None] | None = None,
    walk_on_device: bool | None = None,
) -> list[Verdict]:
    """Decide every row of one scored forward (`scored.logits`, one [1 + N, V] per row) under `rule`:
    the acceptance stage, batched over the step's rows (see `verify`). `drafted_nodes`: where the step
    planner cut each drafted tree (`Verdict.drafted_nodes`). `walk_on_device`: the matched walks as
    tensor operations where the logits are (decoding/speculation/device_walk.py; default: off the
    CPU); else on the host, sampling only the nodes a walk reaches."""
    logits, hidden = scored.logits, scored.hidden
    on_device = bool(logits) and logits[0].device.type != "cpu"
    walk_here = on_device if walk_on_device is None else walk_on_device
    # Processed once per row: what the samplers read; the softmax only where the rule draws from it. On
    # the CPU a row the kernel draws from its raw logits is not processed at all (cast, divided, joined).
    raw = [not (on_device or walk_here) and drawn_raw(t, plain, rule) for t, plain in zip(trees, sampling.plain)]
    scores, dists = processed_rows(sampling, logits, softmax=rule != "match_gumbel", skip=raw)
    # Off the CPU every row's own token at its root and at each node is found where the logits are,
    # the walks run there too, and the step reads back each row's path and token once; the CPU takes
    # every greedy row's argmax in one pass, draws every undrafted sampled row in one call, and samples
    # the other rows lazily, only the nodes a walk reaches.
    walked: dict[int, tuple[list[int], int]] = {}
    walked_tops: dict[int, Top] = {}
    readings: dict[int, RowReading | None] = {}
    targets: list[list[int] | None] = [None] * len(trees)
    if on_device or walk_here:
        rows, flat = device_targets(trees, seqs, logits, scores, rule)
        if rows and walk_here:
            row_trees = [trees[b] for b in rows]
            walks = walk_matched_rows(row_trees, flat)
            # The top tokens along each path are taken there too, so that the step reads back once.
            chosen = [top_block(dists[b], scores[b], logits[b]) for b in rows]
            along = path_tops(chosen, walks.logit_rows(), top) if top else None
            results, row_tops = read_walks(row_trees, walks, along)
            walked = dict(zip(rows, results))
            walked_tops = dict(zip(rows, row_tops or []))
        elif rows:  # the targets read back, the walks on the host
            listed = flat.tolist()
            start = 0
            for b in rows:
                targets[b] = listed[start : start + 1 + len(trees[b])]
                start += 1 + len(trees[b])
    else:
        targets, drawn_tops = host_targets(scored, trees, seqs, sampling, scores, raw, rule, top)
        for b, (row_top, reading) in drawn_tops.items():
            walked_tops[b] = row_top
            readings[b] = reading

    def decide(b: int) -> tuple[list[int], int, torch.Tensor | None]:
        tree, s, row, sc, own, dist = trees[b], seqs[b], logits[b], scores[b], targets[b], dists[b]
        # The softmax is where the logits are (matched multinomial draws read it there, as transformers
        # does); the rejection walk's scalar work reads it on the CPU.
        probs = dist.cpu() if dist is not None and rule == "rejection" else dist
        if b in walked:
            return *walked[b], probs
        if own is not None and not len(tree):  # an undrafted row: its own token, nothing to walk
            return [], own[0], probs
        if rule == "rejection" and len(tree) and probs is not None:
            path, token = walk_rejection(tree, probs, s.generator)
        elif own is not None:
            path, token = walk_matched(tree, lambda node, d: own[node + 1])
        else:
            path, token = walk_matched(tree, target_sampler(s, rule, row, sc, dist))
        return path, token, probs

    # One row after another, in this thread: deciding them in a thread pool slowed the next forwards
    # by a fifth (the pool's threads ran torch operators of their own, and the cores' worker threads
    # contended), for draws that take 0.15 ms a row (decoding/speculation/gumbel.py).
    decided = [decide(b) for b in range(len(trees))]
    tops: list[Top] | None = None
    if top:
        rest = [b for b in range(len(trees)) if b not in walked_tops]
        on_host, read = (
            top_tokens(
                [(decided[b][0], decided[b][2], scores[b], logits[b]) for b in rest],
                sampling if len(rest) == len(trees) else sampling.take(rest),  # the step's own: its lists made once
                top,
            )
            if rest
            else ([], [])
        )
        walked_tops.update(zip(rest, on_host))
        readings.update(zip(rest, read))
        tops = [walked_tops[b] for b in range(len(trees))]
    return [
        Verdict(
            trees[b],
            path,
            token,
            probs,
            logits[b],
            hidden=None if hidden is None else hidden[b, packed.committed(b, path)],
            drafted_nodes=None if drafted_nodes is None else drafted_nodes[b],
            top=None if tops is None else tops[b],
            scores=scores[b] if seqs[b].top_logprobs is not None else None,
            reading=readings.get(b) if seqs[b].top_logprobs is not None else None,
        )
        for b, (path, token, probs) in enumerate(decided)
    ]


def drawn_raw(tree: DraftTree, plain: bool, rule: Rule) -> bool:
    """Whether a sampled row's one token is drawn by the kernel from its raw logits: no draft, a rule
    that draws it by Gumbel-max, and a processing that is the temperature's division alone (`plain`,
    `RowSampling.plain`)."""
    return plain and not len(tree) and rule != "match_multinomial"


def processed_rows(
    sampling: RowSampling, logits: list[torch.Tensor], softmax: bool = True, skip: list[bool] | None = None
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """`processed` for every row (but those `skip` says), and (`softmax`) its softmax, in one call per
    sampling setting: every operation in it works row by row, and per-row calls cost a dozen small
    launches each on a GPU (thousands a step in the statistical tests) and ~20 us of dispatch an
    operator on a CPU (a step of 32 sampled rows paid 0.4 ms a row)."""
    scores: list[torch.Tensor | None] = [None] * len(sampling)
    dists: list[torch.Tensor | None] = [None] * len(sampling)
    for params, members in sampling.by_setting(skip).items():
        rows = logits[members[0]] if len(members) == 1 else torch.cat([logits[b] for b in members])
        done = processed_logits(rows.float(), params)
        sizes = [len(logits[b]) for b in members]
        for b, part in zip(members, torch.split(done, sizes)):
            scores[b] = part
        if softmax:
            for b, dist in zip(members, torch.split(done.softmax(-1), sizes)):
                dists[b] = dist
    return scores, dists


def device_targets(
    trees: list[DraftTree],
    seqs: list[Sequence],
    logits: list[torch.Tensor],
    scores: list[torch.Tensor | None],
    rule: Rule,
) -> tuple[list[int], torch.Tensor]:
    """The rows whose own tokens are found where their logits are, and those tokens: per row its
    token after its root and after each node ([1 + N] ids, rows concatenated in the order given),
    computed for every row at once with no read-back: the argmax at temperature 0, the Gumbel-max
    sample under match_gumbel (and for rows without a draft under rejection), exactly as
    `target_sampler` picks them. The rows that sample on the host (match_multinomial's generator
    stream; rejection's walk) are not among them."""
    greedy = [b for b, sc in enumerate(scores) if sc is None]
    sampled = [
        b
        for b, sc in enumerate(scores)
        if sc is not None and (rule == "match_gumbel" or (rule == "rejection" and not len(trees[b])))
    ]
    parts = []
    if greedy:
        parts.append(torch.cat([logits[b] for b in greedy]).argmax(-1))
    if sampled:
        keys = [key(seqs[b].seed, seqs[b].position + d) for b in sampled for d in (0, *trees[b].depths())]
        parts.append(gumbel_targets(torch.cat([scores[b] for b in sampled]), keys))  # type: ignore[misc]
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return greedy + sampled, flat


def host_targets(
    scored: Scored,
    trees: list[DraftTree],
    seqs: list[Sequence],
    sampling: RowSampling,
    scores: list[torch.Tensor | None],
    raw: list[bool],
    rule: Rule,
    top: int = 0,
) -> tuple[list[list[int] | None], dict[int, tuple[Top, RowReading | None]]]:
    """On the CPU, per greedy row its argmax at the root and at each node ([1 + N] ids), and per
    sampled row without a draft its Gumbel-max draw ([1], as `target_sampler` draws it); None for the
    other rows (sampled lazily, only the nodes a walk reaches). One argmax over the forward's logits
    where they lie together, else over the greedy rows' (a call per row cost a tenth of a millisecond
    more than its argmax); the draws in one call, rows on the machine's threads, the `raw` ones from
    their logits and temperature (`drawn_raw`). With `top`, a raw row's top tokens (`top_tokens`' of
    its root, and what that read of it) come from its draw's pass (`draw_top_rows`), keyed by row."""
    greedy = [b for b, g in enumerate(sampling.greedy) if g]
    out: list[list[int] | None] = [None] * len(seqs)
    if greedy:
        counts = [1 + len(trees[b]) for b in greedy]  # a row's logits: its root and its nodes (len of a tensor: 2 us)
        whole = scored.flat is not None and len(greedy) == len(scored.logits)
        flat = argmax_rows(scored.flat if whole else torch.cat([scored.logits[b] for b in greedy]))  # type: ignore[arg-type]
        start = 0
        for b, n in zip(greedy, counts):
            out[b] = flat[start : start + n]
            start += n
    drawn = [b for b, g in enumerate(sampling.greedy) if not g and not len(trees[b]) and rule != "match_multinomial"]
    with_top = [b for b in drawn if top and raw[b]]
    alone = [b for b in drawn if not (top and raw[b])]
    tops: dict[int, tuple[Top, RowReading | None]] = {}
    if with_top:
        blocks = [scored.logits[b] for b in with_top]
        temperatures = [sampling.temperatures[b] for b in with_top]
        picks, values, ids, read = draw_top_rows(
            [block[0] for block in blocks],
            [key(seqs[b].seed, seqs[b].position) for b in with_top],
            temperatures,
            min(top, blocks[0].shape[-1]),
        )
        ids_l, values_l = ids.tolist(), values.tolist()
        read_l = None if read is None else read.tolist()
        for i, (b, block, t, token) in enumerate(zip(with_top, blocks, temperatures, picks)):
            out[b] = [token]
            reading = None if read_l is None else RowReading.of(block, t, [0], read_l[i : i + 1], ids_l[i : i + 1])
            tops[b] = (ids_l[i : i + 1], values_l[i : i + 1]), reading
    if alone:
        rows = [scored.logits[b][0] if raw[b] else scores[b][0] for b in alone]  # type: ignore[index]
        temperatures = [sampling.temperatures[b] if raw[b] else 1.0 for b in alone]
        picks = gumbel_pick_rows(rows, [key(seqs[b].seed, seqs[b].position) for b in alone], temperatures)
        for b, token in zip(alone, picks):
            out[b] = [token]
    return out, tops


def top_tokens(
    decided: list[tuple[list[int], torch.Tensor | None, torch.Tensor | None, torch.Tensor]],
    sampling: RowSampling,
    k: int,
) -> tuple[list[Top], list[RowReading | None]]:
    """Per row (its accepted path, processed distribution or None, processed logits or None, raw
    logits) and its settings: the k most likely tokens at its root and along its path (`Verdict.top`)
    and their probabilities (the processed distribution; the logits' softmax for greedy rows), by one
    top-k over the step's rows where they lie (`top_k_rows`, which normalises the logits' rows
    itself), and what that pass read of each row's logits (`Verdict.reading`; None for a distribution's
    rows or off the kernel). A sampled row left unprocessed (`drawn_raw`: its processing the
    temperature's division alone) is read from its raw logits divided by its temperature there, with
    no processed copy made."""
    ats = [[0, *(1 + n for n in path)] for path, *_ in decided]
    blocks: list[torch.Tensor] = []
    normalise: list[bool] = []
    temperatures: list[float] = []
    for (_, probs, scores, logits), greedy, temperature in zip(decided, sampling.greedy, sampling.temperatures):
        raw = probs is None and scores is None and not greedy
        block, norm = (logits, True) if raw else top_block(probs, scores, logits)
        blocks.append(block)
        normalise.append(norm)
        temperatures.append(temperature if raw else 1.0)
    values, ids, read = top_k_rows(blocks, min(k, blocks[0].shape[-1]), ats, normalise, temperatures)
    ids_l, values_l = ids.tolist(), values.tolist()  # one conversion for the step
    read_l = None if read is None else read.tolist()
    out: list[Top] = []
    readings: list[RowReading | None] = []
    start = 0
    for at, block, norm, temperature in zip(ats, blocks, normalise, temperatures):
        end = start + len(at)
        out.append((ids_l[start:end], values_l[start:end]))
        if read_l is None or not norm:
            readings.append(None)
        else:
            readings.append(RowReading.of(block, temperature, at, read_l[start:end], ids_l[start:end]))
        start = end
    return out, readings


def top_block(
    probs: torch.Tensor | None, scores: torch.Tensor | None, logits: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """Where a row's top tokens are read: its processed distribution, else its processed logits, else
    its raw ones (a greedy row); and whether the softmax of those rows is still to be taken."""
    if probs is not None:
        return probs, False
    return (scores if scores is not None else logits), True


def path_tops(chosen: list[tuple[torch.Tensor, bool]], rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_tokens` where the rows lie, with no read-back: per row the k most likely tokens and their
    probabilities ([R, 1 + D, k] each, values then ids) at rows `rows[r]` (the root and the path a
    device walk found, `Walks.logit_rows`) of its `top_block`. A launch or three a row (the blocks'
    kinds and sizes differ); a copy of 1 + D rows of each, not of its tree."""
    picked = []
    for (block, norm), at in zip(chosen, rows):
        x = block.index_select(0, at)
        picked.append(x.softmax(-1, dtype=torch.float32) if norm else x.float())
    stacked = torch.stack(picked)
    values, ids = top_k(stacked.flatten(0, 1), min(k, stacked.shape[-1]))
    return values.view(*stacked.shape[:2], -1), ids.view(*stacked.shape[:2], -1)


def kept_tops(verdicts: list[Verdict], k: int) -> list[tuple[list[list[int]], list[list[float]]]]:
    """Each verdict's `top` at its kept rows (`kept_rows()`, a prefix of them), its first k per row."""
    assert all(v.top is not None for v in verdicts), "verify with top=Drafter.learns_top"
    out = []
    for v in verdicts:
        n = len(v.kept_rows())
        ids, probs = v.top  # type: ignore[misc]
        out.append(([row[:k] for row in ids[:n]], [row[:k] for row in probs[:n]]))
    return out


def target_sampler(
    s: Sequence, rule: Rule, logits: torch.Tensor, scores: torch.Tensor | None, dist: torch.Tensor | None
) -> Callable[[int, int], int]:
    """The target's own token after a node (row 1 + node of `logits` [1 + N, V]; of its processed
    `scores` and their softmax `dist`, on the logits' device, at temperature > 0) at depth d below the
    root, as plain decoding draws it: the argmax at temperature 0; under match_multinomial a
    torch.multinomial draw of one [1, V] row from the request's generator on that device
    (`transformers`' own sampling, in order of position); otherwise (match_gumbel, and rows
    without a draft under rejection) Gumbel-max with the request's public noise at the token's
    absolute position."""
    if scores is None:
        argmax = argmax_rows(logits)
        return lambda node, d: argmax[node + 1]
    if rule == "match_multinomial":
        assert dist is not None, "match_multinomial draws from the softmax: processed_rows(softmax=True)"
        return lambda node, d: int(torch.multinomial(dist[node + 1 : node + 2], 1, generator=s.sample_generator))
    position = s.position
    return lambda node, d: gumbel_pick(scores[node + 1], s.seed, position + d)
