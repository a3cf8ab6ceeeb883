"""A causal LM as the decoders see it (the target, or a draft model): forwards over a per-row KV cache."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from decoding.runtime import attention, llama
from decoding.runtime.kv_bytes import KVBytes, Need
from decoding.runtime.kv_cache import ForwardView, KVCache
from decoding.runtime.kv_layout import KVLayout, PagedLayout, RowLayout
from decoding.runtime.memory import MemoryBudget
from decoding.runtime.packing import Packed, pack
from decoding.runtime.paged_kv import BlockPool
from decoding.runtime.prefix_cache import Match, PrefixCache, shared_len
from decoding.runtime.pretrained import pretrained
from decoding.runtime.quant import cache_dtype
from decoding.runtime.static_forward import StaticForward, StaticSpec

log = logging.getLogger(__name__)

MIN_SHARED_PREFIX = 8  # shorter common prefixes are simply fed with each row
# Prompt tokens one admission forward computes at most. Its activations grow with them (about 135 KB a
# token on the 0.5B on a CPU: a hundred prompts of 1,600 tokens in one forward took 20 GB), so more,
# or longer, prompts are computed in turns; a forward this large already runs at the machine's rate.
PREFILL_TOKENS = 4096


def _common_prefix_len(prompts: list[list[int]]) -> int:
    first = tuple(prompts[0])
    n = len(first)
    for p in prompts[1:]:
        n = shared_len(first[:n], tuple(p))
    return n


class ModelRunner:
    """Wraps a `transformers` causal LM so that every forward writes into a `KVCache` (rows of their own,
    or paged blocks).

    A forward takes T new tokens per row with, per row, a T x T visibility matrix among them (a
    causal chain for prefill and plain decoding, ancestors for a draft tree) and their depths;
    positions are the row's committed length plus depth.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        prefix_budget: MemoryBudget | None = None,
        static: StaticSpec | None = None,
        strict_graphs: bool = False,
        kv_budget: int | None = None,
        paged: bool = True,
    ) -> None:
        self.model = model
        self.config: Any = model.config  # transformers' PretrainedConfig: its attributes are the model's own
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache_dtype = cache_dtype(model)
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        self.reads_rows_in_place = impl == attention.NAME  # the kernel takes the verified rows' indices
        self.additive_mask = impl == "eager"  # eager attention adds its mask (a boolean one is misread)
        self.layers = llama.Layers.of(model)  # the same forward without transformers' plumbing, or None
        # Bucketed forwards (CUDA graphs on a GPU, decoding/runtime/static_forward.py), or None: ragged / unpadded.
        self.static = None if static is None else StaticForward.of(model, static, strict_graphs)
        self.forwards = 0
        self.rows = 0  # sequences scored, summed over forwards
        self.prompt_tokens_computed = 0  # prompt tokens `admit` computed or left pending
        self.peak_cache_bytes = 0
        self.peak_shared_blocks = 0  # paged: the most blocks held by more than one row at a forward
        # KV in blocks shared by reference (paged_kv.py) where the project's layers read it on the CPU;
        # every other forward reads rows of its own
        if paged and (why := _rows_of_their_own(self.layers is not None, self.static is not None, self.device)):
            log.info("model.paged_kv: KV in rows of their own, not in shared blocks: %s", why)
            paged = False
        self.kv: KVLayout = (
            PagedLayout(BlockPool.for_model(self.config, self.cache_dtype, self.device))
            if paged
            else RowLayout(
                self.config,
                self.cache_dtype,
                self.device,
                keys_by_position=self.reads_rows_in_place,
                spare=1 if self.static is not None else 0,
                capture=self.static is not None and self.static.spec.capture,
            )
        )
        self.prefixes = PrefixCache(prefix_budget, self.pool)  # its own 4 GiB without a budget
        self.kv_budget = kv_budget  # bytes a decoder's KV pool may take (model.kv_memory); None: unbounded
        # Hidden-state capture for drafters that read them (EDD): off unless capture_hidden is called.
        self.hidden_layer: int | None = None
        self.prefill_tokens = PREFILL_TOKENS
        # A prompt cut into pieces keeps its bits only where the attention reads every position in order
        # whichever forward wrote it (the project's kernel); elsewhere a long prompt goes whole, alone.
        self.cuts_prompts = self.reads_rows_in_place

    def capture_hidden(self, layer: int) -> None:
        """Return the output of decoder layer `layer` (negative: from the end) with every forward
        (`Forward.hidden`, `Scored.hidden`) and of the shared prefix of every `admit`
        (`Admission.start_hidden`). Logits do not change; stored prefixes (which lack hidden states)
        are dropped."""
        n = len(decoder_layers(self.model))
        self.hidden_layer = layer % n
        self.prefixes.clear()
        self.prefixes = PrefixCache(self.prefixes.budget, self.pool)

    @property
    def pool(self) -> BlockPool | None:
        """The blocks rows and the prefix store share (paged KV), or None: rows of their own."""
        return self.kv.pool

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (it may be padded past the tokenizer's vocabulary)."""
        head = pretrained(self.model).get_output_embeddings()
        return int(head.weight.shape[0]) if head is not None else int(self.config.vocab_size)

    @property
    def max_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)

    def new_cache(self, batch: int, capacity: int, graphs: bool = False) -> KVCache:
        """An empty cache; `graphs`: one that lives long enough to be worth capturing CUDA graphs over
        (a decoder's pool of rows, not a scratch cache of one admission). Paged, rows of the model's
        block pool (they share blocks with each other and the prefix store)."""
        return self.kv.new_cache(batch, capacity, graphs)

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        tree: torch.Tensor,
        depth: torch.Tensor,
        logits_at: torch.Tensor | None = None,
        offset: int = 0,
        rows: list[int] | None = None,
        real: torch.Tensor | None = None,
    ) -> Forward:
        """Logits [B, T, V] (or [B, K, V] at the new-token indices `logits_at`) for new tokens [B, T],
        and with capture (`capture_hidden`) the captured layer's states [B, T, H].

        `tree` is [B, T, offset + T]: what each new token sees among the row's uncommitted slots
        (`offset` of them written by earlier forwards of this step, then the new ones). `rows`: the
        cache rows that tokens' rows are (default: all, in order). `real` (with `ragged` only): the
        flat indices into [B, T] of the tokens to compute, pads skipped; `logits_at` then indexes
        them and the logits are [K, V].
        """
        if real is not None and not self.ragged:
            raise ValueError("a ragged forward needs the project's Llama layers without hidden-state capture")
        if self.static is not None and self.hidden_layer is None:
            return Forward(self._static_forward(cache, tokens, tree, depth, logits_at, offset, rows))
        tokens = tokens.to(self.device)
        in_place = self.reads_rows_in_place and rows is not None
        view = cache.prepare(tokens.shape[1], offset, rows, gather=not in_place)
        self.peak_cache_bytes = max(self.peak_cache_bytes, cache.nbytes)
        self.peak_shared_blocks = max(self.peak_shared_blocks, self.kv.shared_blocks())
        mask = view.attention_mask(tree.to(self.device))
        if self.additive_mask:
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~mask, torch.finfo(self.dtype).min
            )
        kv_rows = torch.tensor(rows, dtype=torch.long) if in_place and view.tables is None else None
        positions = view.row_lens()[:, None] + depth.to(self.device)
        keep = None if logits_at is None else logits_at.to(self.device)
        if self.layers is not None:
            real = None if real is None else real.to(self.device)
            logits, hidden = self.layers.forward(view, tokens, mask, positions, kv_rows, keep, self.hidden_layer, real)
        else:
            logits, hidden = self._transformers_forward(view, tokens, mask, positions, kv_rows, keep)
        self.forwards += 1
        self.rows += tokens.shape[0]
        # Only the project's layers pass the siblings to the kernel; other attentions read every row's own.
        reads = view.reads if self.layers is not None else (view.reads[0], 0)
        return Forward(logits, hidden if self.hidden_layer is not None else None, reads)

    def _static_forward(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        tree: torch.Tensor,
        depth: torch.Tensor,
        logits_at: torch.Tensor | None,
        offset: int,
        rows: list[int] | None,
    ) -> torch.Tensor:
        """`forward` through the bucketed layers; the LM head runs on the wanted tokens alone."""
        assert self.static is not None
        h = self.static.hidden(cache, tokens, tree, depth, offset, rows)
        self.peak_cache_bytes = max(self.peak_cache_bytes, cache.nbytes)
        if logits_at is not None:
            h = h[:, logits_at.to(self.device)]
        self.forwards += 1
        self.rows += tokens.shape[0]
        logits: torch.Tensor = pretrained(self.model).get_output_embeddings()(h)
        return logits

    @property
    def ragged(self) -> bool:
        """Forwards compute only real tokens (the project's Llama layers; hidden-state capture, which
        reads the padded layout, turns it off): a forward then costs the tokens its rows hold."""
        return self.layers is not None and self.hidden_layer is None and self.static is None

    def score(self, cache: KVCache, packed: Packed, rows: list[int] | None = None) -> Scored:
        """One verification forward: per row, the logits [1 + n, V] at its root and its n tree nodes."""
        index, counts = packed.real_logits_index()
        t0 = time.perf_counter()
        timing = _GpuTiming.start(self.device)
        flat: torch.Tensor | None
        if self.ragged:
            out = self.forward(
                cache, packed.tokens, packed.see, packed.depth, logits_at=index, rows=rows, real=packed.real
            )
            logits, flat = list(torch.split(out.logits, counts)), out.logits
        else:
            keep = torch.arange(packed.n_pending - 1, packed.tokens.shape[1])
            out = self.forward(cache, packed.tokens, packed.see, packed.depth, logits_at=keep, rows=rows)
            logits = [out.logits[b, :n] for b, n in enumerate(counts)]
            flat = out.logits.flatten(0, 1) if all(n == len(keep) for n in counts) else None  # no padded rows
        ms = timing.stop() if timing is not None else 1000 * (time.perf_counter() - t0)
        return Scored(logits, out.hidden, ms, out.reads, flat)

    def _transformers_forward(
        self,
        view: ForwardView,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        kv_rows: torch.Tensor | None,
        logits_at: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        extra = {} if kv_rows is None else {"kv_rows": kv_rows}
        kept: list[torch.Tensor] = []
        hook = None
        if self.hidden_layer is not None:
            hook = decoder_layers(self.model)[self.hidden_layer].register_forward_hook(
                lambda module, args, output: kept.append(output[0] if isinstance(output, tuple) else output)
            )
        try:
            out = self.model(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=view,
                use_cache=True,
                logits_to_keep=0 if logits_at is None else logits_at,
                **extra,
            )
        finally:
            if hook is not None:
                hook.remove()
        return out.logits, kept[0] if kept else None

    def admit(self, cache: KVCache, rows: list[int], prompts: list[list[int]], room: int) -> Admission:
        """Put the prompts into cache rows `rows` (grown as needed, with `room` positions per row past
        its prompt) and return, per row, the tokens still to feed (the last one only) and the prompt
        tokens computed for it.

        ToT prompts share long prefixes: the n trajectories of a thought step have one prompt, the
        evaluator prompts of a step share the question and the path so far, and the next step's
        prompts extend this step's prompts and thoughts. The prefix common to the admitted prompts
        (all but one token of it at least) is computed once, after the longest part of it stored
        before; then each row takes the longest stored prefix of its own prompt beyond that, and
        the rest is computed for all rows in one forward. So a row joins a running batch with one
        pending token, like the rows already decoding.

        With hidden-state capture (an EDD drafter reads the states of every prompt position) rows
        take only the common prefix, the rest stays pending and is fed with each row's first draft
        (then its states come back with the verdict); `Admission.start_hidden` holds the common prefix's.
        """
        with self.prefixes.budget.lock:  # what it matched is not evicted by another thread before it is read
            return self._admit(cache, rows, prompts, room)

    def _admit(self, cache: KVCache, rows: list[int], prompts: list[list[int]], room: int) -> Admission:
        forwards, rows_run = self.forwards, self.rows
        shared = min(_common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
        head = tuple(prompts[0][:shared])
        reused = self.prefixes.match(head)
        if shared < MIN_SHARED_PREFIX and not reused.length:
            shared = 0
        self._reserve(cache, max(rows) + 1, self.row_capacity([len(p) for p in prompts], room))
        self.peak_cache_bytes = max(self.peak_cache_bytes, cache.nbytes)
        before = self.prompt_tokens_computed
        done, start_hidden = self._admit_head(cache, rows, head[:shared], reused)
        # The shared head was computed once for all the rows: each takes an equal part of it.
        part, extra = divmod(self.prompt_tokens_computed - before, len(rows))
        spent = {row: part + (i < extra) for i, row in enumerate(rows)}
        if self.hidden_layer is not None:
            admitted = self._admit_captured(rows, prompts, done, spent, start_hidden)
        else:
            admitted = self._admit_rest(cache, rows, prompts, shared, done, spent)
        return replace(admitted, forwards=self.forwards - forwards, rows=self.rows - rows_run)

    def _admit_captured(
        self,
        rows: list[int],
        prompts: list[list[int]],
        done: dict[int, int],
        spent: dict[int, int],
        start_hidden: torch.Tensor | None,
    ) -> Admission:
        """Rows whose drafter reads hidden states: past the shared head, their prompts stay
        pending, fed with each row's first draft (their states then come back with the verdict)."""
        pending = [list(p[done[row] :]) for row, p in zip(rows, prompts)]
        self.prompt_tokens_computed += sum(len(p) for p in pending)
        return Admission(pending, [spent[row] + len(p) for row, p in zip(rows, pending)], start_hidden)

    def _admit_rest(
        self,
        cache: KVCache,
        rows: list[int],
        prompts: list[list[int]],
        shared: int,
        done: dict[int, int],
        spent: dict[int, int],
    ) -> Admission:
        """Past the shared head: each row takes the longest stored prefix of its own prompt, a prompt
        admitted twice (the n samples of one state, beside other problems' prompts) is computed once
        and copied, and the rest of every row is computed in one forward; one token stays pending."""
        first: dict[tuple[int, ...], int] = {}
        copies: list[tuple[int, int, int]] = []  # (row, the row it copies, positions)
        computed: list[tuple[int, list[int], list[int]]] = []  # (row, prompt, the tokens it computes)
        for row, p in zip(rows, prompts):
            if (twin := first.setdefault(tuple(p), row)) != row:
                copies.append((row, twin, len(p) - 1))
                continue
            if len(p) - 1 > shared:
                own = self.prefixes.match(p[:-1])
                if own.length > shared:
                    self.prefixes.restore(own, cache, row, shared, own.length)
                    done[row] = own.length
            computed.append((row, p, list(p[done[row] :])))
        self.prompt_tokens_computed += sum(len(rest) for *_, rest in computed) + len(copies)
        # One left-padded forward: a row's slots run to its stored length plus the widest part.
        self._reserve(cache, cache.batch, max(done.values()) + max(len(rest) for *_, rest in computed))
        self.peak_cache_bytes = max(self.peak_cache_bytes, cache.nbytes)
        self._prefill(cache, [row for row, *_ in computed], [rest for *_, rest in computed])
        for row, twin, n in copies:
            cache.copy_prefix(cache, twin, [row], n)
        for row, p, rest in computed:
            if len(rest) > 1:
                self.prefixes.store(tuple(p[:-1]), cache, row)
            spent[row] += len(rest)
        for row, *_ in copies:
            spent[row] += 1
        return Admission([p[-1:] for p in prompts], [spent[row] for row in rows])

    def _reserve(self, cache: KVCache, batch: int, capacity: int) -> None:
        """Grow the pool to `batch` rows of `capacity` positions; where graphs are captured over it,
        to the next rows bucket and context multiple, since growing drops every graph."""
        if self.static is not None and cache.graphs is not None:
            buckets = self.static.spec.buckets
            batch = next((s for s in buckets.rows if s >= batch), batch)
            capacity = -(-capacity // buckets.context) * buckets.context
        cache.reserve(batch, capacity)

    def give_back(self, cache: KVCache, rows: int, widest: Callable[[], Need | None]) -> None:
        """Shrink the pool to `rows` rows and what the live rows need, once it holds far more (a burst
        of rows, or a long prompt, gone: memory stays bounded over a long run). `widest()`: the longest
        prompt and largest room among the live rows (None for none), asked only where rows have a
        capacity of positions to shrink (not a paged pool's tables): a step of a few rows beside
        thousands queued spent a tenth of its time on it."""
        need = None if isinstance(self.kv, PagedLayout) else widest()
        capacity = 0 if need is None else self.row_capacity([need.prompt], need.room)
        cache.give_back(rows, capacity)

    @property
    def kv_layout(self) -> KVBytes:
        """What a pool of rows takes in this runner's layout (admission compares it with `kv_budget`)."""
        return self.kv.bytes(self.row_capacity)

    def row_capacity(self, prompt_lens: list[int], room: int) -> int:
        """Positions a row of the pool needs while rows with these prompts decode, `room` past each."""
        longest = max(prompt_lens, default=0)
        # Captured rows verify their first draft with the whole pending part, left-padded, beside
        # rows far along: their slots then span the widest pending part past the longest row.
        return longest + room + (longest if self.hidden_layer is not None else 1)

    def _admit_head(
        self, cache: KVCache, rows: list[int], head: tuple[int, ...], reused: Match
    ) -> tuple[dict[int, int], torch.Tensor | None]:
        """Rows `rows` start with `head`'s KV (computed once past its stored part): their lengths, and
        with capture `head`'s hidden states [len(head), H]."""
        capture = self.hidden_layer is not None
        empty = torch.zeros(0, self.config.hidden_size, dtype=self.dtype, device=self.device) if capture else None
        if not head:
            cache.clear(rows)
            return dict.fromkeys(rows, 0), empty
        scratch = self.new_cache(1, len(head) + 1)
        reuse = reused.length
        hidden: list[torch.Tensor | None] = [self.prefixes.restore(reused, scratch, 0, 0, reuse)] if reuse else []
        rest = list(head[reuse:])
        step = self.prefill_tokens if self.cuts_prompts else max(1, len(rest))
        for start in range(0, len(rest), step):
            piece = rest[start : start + step]
            causal = torch.ones(len(piece), len(piece), dtype=torch.bool).tril()[None]
            out = self.forward(
                scratch, torch.tensor([piece]), causal, torch.arange(len(piece))[None], logits_at=torch.tensor([0])
            )
            scratch.advance(torch.tensor([len(piece)]))
            if out.hidden is not None:
                hidden.append(out.hidden[0])
        # (read with capture alone, when a restored prefix holds its states: capture_hidden dropped those without)
        states = cast(list[torch.Tensor], hidden)
        if rest:
            self.prefixes.store(head, scratch, 0, torch.cat(states) if capture else None)
            self.prompt_tokens_computed += len(rest)
        cache.copy_prefix(scratch, 0, rows, len(head))
        scratch.clear([0])
        return dict.fromkeys(rows, len(head)), torch.cat(states) if capture and states else empty

    def _prefill(self, cache: KVCache, rows: list[int], pending: list[list[int]]) -> None:
        """Compute every row's pending tokens but the last, the rows together (left-padded) in forwards
        of at most `prefill_tokens` tokens (`prefill_turns`)."""
        todo = [(row, p[:-1]) for row, p in zip(rows, pending) if len(p) > 1]
        ragged = self.ragged  # left pads are not computed: the forward costs the prompts' own tokens
        for turn in prefill_turns(todo, self.prefill_tokens, self.cuts_prompts):
            packed = pack([p for _, p in turn])
            self.forward(
                cache,
                packed.tokens,
                packed.see,
                packed.depth,
                logits_at=torch.tensor([0 if ragged else packed.n_pending - 1]),
                rows=[row for row, _ in turn],
                real=packed.real if ragged else None,
            )
            for b, (row, _) in enumerate(turn):
                cache.commit(row, packed.committed(b, []))

    def remember(self, cache: KVCache, row: int, tokens: list[int], pin: tuple[int, ...] | None = None) -> None:
        """Store what a row committed (its prompt and generated tokens) for later prompts that extend
        it: the next step's prompts continue this step's thoughts; with `pin`, kept until a
        follow-up naming `pin` as its context is admitted."""
        if self.hidden_layer is None:
            self.prefixes.store(tuple(tokens[: int(cache.lens[row])]), cache, row, pin=pin)

    def release(self, cache: KVCache, rows: list[int]) -> None:
        """Rows hold nothing any more (their sequences left). Paged, their blocks go back, and those
        the store also held now count against its budget, which may then evict."""
        cache.clear(rows)
        self.kv.released(self.prefixes)


def prefill_turns(todo: list[tuple[int, list[int]]], limit: int, cut: bool = True) -> list[list[tuple[int, list[int]]]]:
    """(row, tokens) to compute, as forwards of at most `limit` tokens: rows whole and in order, a
    forward closed where the next row does not fit; a row longer than `limit` alone, in pieces of
    `limit`, one forward each (not `cut`: whole). A forward is left-padded to its widest row, so a row cut mid-prompt
    never shares one (its slots would run past what the pool reserved for it). A row's logits and KV
    do not depend on how its prompt was cut: a piece reads the pieces before it from the cache, as a
    decode step does."""
    turns: list[list[tuple[int, list[int]]]] = []
    turn: list[tuple[int, list[int]]] = []
    room = limit
    for row, tokens in todo:
        if len(tokens) > room and turn:
            turns.append(turn)
            turn, room = [], limit
        if len(tokens) > limit:
            step = limit if cut else len(tokens)
            turns += [[(row, tokens[i : i + step])] for i in range(0, len(tokens), step)]
            continue
        turn.append((row, tokens))
        room -= len(tokens)
    return [*turns, turn] if turn else turns


def _rows_of_their_own(layers: bool, bucketed: bool, device: torch.device) -> str | None:
    """Why a paged layout asked for cannot be used (None: it can): only the project's CPU layers read
    KV through block tables (the CPU attention of csrc/attention.cpp)."""
    if device.type != "cpu":
        return f"on {device.type}, the forwards read rows of their own (blocks are read by the CPU attention alone)"
    if bucketed:
        return "the bucketed forward (model.cuda_graphs) reads rows of their own"
    if not layers:
        return "the model runs through transformers' own forward (model.attention / model.linear not the project's)"
    return None


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a `transformers` causal LM (model.model.layers for Llama-like models)."""
    layers: torch.nn.ModuleList | None = getattr(pretrained(model).get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layer list (get_decoder().layers)")
    return layers


@dataclass(frozen=True)
class _GpuTiming:
    """Two CUDA events around work queued on the GPU: its time, read without stalling the queue."""

    begin: torch.cuda.Event
    end: torch.cuda.Event

    @classmethod
    def start(cls, device: torch.device) -> _GpuTiming | None:
        if device.type != "cuda":
            return None
        timing = cls(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        timing.begin.record()
        return timing

    def stop(self) -> _GpuTiming:
        self.end.record()
        return self

    def ms(self) -> float:
        self.end.synchronize()
        ms: float = self.begin.elapsed_time(self.end)
        return ms


@dataclass(frozen=True)
class Forward:
    """What one forward computed: logits, and with capture the captured layer's states [B, T, H]."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    reads: tuple[int, int] = (0, 0)  # committed positions attended; of them, read from a sibling's row
    # The rows' logits where they lie together, one row's after another ([sum of 1 + n, V]), or None.
    flat: torch.Tensor | None = None


@dataclass(frozen=True)
class Scored:
    """One verification forward: per row the logits [1 + n, V] at its root and its n nodes, with
    capture the captured layer's states [B, T, H], and its time."""

    logits: list[torch.Tensor]
    hidden: torch.Tensor | None
    timing: float | _GpuTiming  # ms, or CUDA events read when asked (`ms`), so the step never waits
    reads: tuple[int, int] = (0, 0)  # committed positions attended; of them, read from a sibling's row
    # The rows' logits where they lie together, one row's after another ([sum of 1 + n, V]), or None.
    flat: torch.Tensor | None = None

    @property
    def ms(self) -> float:
        t = self.timing
        return t.ms() if isinstance(t, _GpuTiming) else t


@dataclass(frozen=True)
class Admission:
    """Per admitted row: the prompt tokens still to feed, and the prompt tokens computed for it; with
    capture, the hidden states [S, H] of the prefix the rows share (None without)."""

    pending: list[list[int]]
    computed: list[int]
    start_hidden: torch.Tensor | None = None
    forwards: int = 0  # the forwards admitting them ran, and their rows
    rows: int = 0
