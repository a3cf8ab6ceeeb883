"""A causal LM as the decoders see it (the target, or a draft model): forwards over a per-row KV cache."""

from __future__ import annotations

from collections import OrderedDict

import torch

from decoding.core import attention, llama
from decoding.core.kv_cache import RowKVCache

MIN_SHARED_PREFIX = 8  # shorter common prefixes are simply fed with each row


def _common_prefix_len(prompts: list[list[int]]) -> int:
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return n


def _shared_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix (binary search on slice equality: compared in C, not per token)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixStore:
    """Keys/values of token sequences computed before (one row each), for any prefix of them.

    The KV of a sequence's first n tokens is its cache up to n (attention is causal, and the
    invariant forward gives a token the same bits whatever else was computed with it), so a new
    prompt reuses the longest prefix it shares with any stored sequence. Least recently used
    sequences are evicted past `max_bytes` in all; a stored sequence that is a prefix of a new one
    is dropped. A 300-token sequence of the embedded model takes about 7 MB.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        # tokens -> (keys, values, hidden states of the captured layer or None)
        self.entries: OrderedDict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]]
        self.entries = OrderedDict()

    def match(self, tokens: tuple[int, ...] | list[int]) -> tuple[tuple[int, ...], int]:
        """The stored sequence sharing the longest prefix with `tokens`, and that prefix's length."""
        tokens = tuple(tokens)
        best: tuple[tuple[int, ...], int] = ((), 0)
        for key in self.entries:
            n = _shared_len(key, tokens) if key and tokens and key[0] == tokens[0] else 0
            if n > best[1]:
                best = (key, n)
        return best

    def restore(self, key: tuple[int, ...], cache: RowKVCache, row: int, start: int, end: int) -> torch.Tensor | None:
        """Copy positions [start, end) of a stored sequence into a cache row, which then holds `end`
        committed tokens; returns the stored hidden states of those positions (or None)."""
        keys, values, hidden = self.entries[key]
        self.entries.move_to_end(key)
        for dst, src in zip(cache.keys, keys):
            dst[row, :, start:end] = src[:, start:end]
        for dst, src in zip(cache.values, values):
            dst[row, :, start:end] = src[:, start:end]
        cache.lens[row] = end
        return None if hidden is None else hidden[start:end]

    def store(self, key: tuple[int, ...], cache: RowKVCache, row: int = 0, hidden: torch.Tensor | None = None) -> None:
        """Keep the first len(key) committed positions of a cache row as the KV of `key`."""
        n = len(key)
        assert n <= int(cache.lens[row]), "only committed positions can be stored"
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if not n:
            return
        keys = [k[row, :, :n].clone() for k in cache.keys]
        values = [v[row, :, :n].clone() for v in cache.values]
        size = sum(t.nbytes for t in keys + values)
        if size > self.max_bytes:
            return
        for old in [k for k in self.entries if len(k) <= n and key[: len(k)] == k]:
            self._drop(old)  # its KV is a prefix of this one's
        self.entries[key] = (keys, values, hidden)
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        keys, values, _ = self.entries.pop(key)
        self.nbytes -= sum(t.nbytes for t in keys + values)


class ModelRunner:
    """Wraps a `transformers` causal LM so that every forward writes into a RowKVCache.

    A forward takes T new tokens per row with, per row, a T x T visibility matrix among them (a
    causal chain for prefill and plain decoding, ancestors for a draft tree) and their depths;
    positions are the row's committed length plus depth.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        self.reads_rows_in_place = impl == attention.NAME  # the kernel takes the verified rows' indices
        self.additive_mask = impl == "eager"  # eager attention adds its mask (a boolean one is misread)
        self.layers = llama.Layers.of(model)  # the same forward without transformers' plumbing, or None
        self.forwards = 0
        self.rows = 0  # sequences scored, summed over forwards
        self.prompt_tokens_computed = 0  # prompt tokens `start` computed or left pending
        self.peak_cache_bytes = 0
        self.prefixes = PrefixStore()
        # Hidden-state capture for drafters that read them (EDD): off unless capture_hidden is called.
        self.hidden_layer: int | None = None
        self.last_hidden: torch.Tensor | None = None  # [B, T, H]: that layer's output in the latest forward
        self.start_hidden: torch.Tensor | None = None  # [S, H]: of the prefix the latest `start` shared

    def capture_hidden(self, layer: int) -> None:
        """Keep the output of decoder layer `layer` (negative: from the end) of every forward in
        `last_hidden`, and of the shared prefix of every `start` in `start_hidden`. Outputs do not
        change; stored prefixes (which lack hidden states) are dropped."""
        n = len(decoder_layers(self.model))
        self.hidden_layer = layer % n
        self.prefixes = PrefixStore(self.prefixes.max_bytes)

    def _keep_hidden(self, module: torch.nn.Module, args: object, output: object) -> None:
        self.last_hidden = output[0] if isinstance(output, tuple) else output  # type: ignore[assignment]

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (it may be padded past the tokenizer's vocabulary)."""
        head = self.model.get_output_embeddings()
        return int(head.weight.shape[0]) if head is not None else int(self.config.vocab_size)

    @property
    def max_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)

    def new_cache(self, batch: int, capacity: int) -> RowKVCache:
        return RowKVCache.for_model(
            self.config, batch, capacity, self.dtype, self.device, keys_by_position=self.reads_rows_in_place
        )

    @torch.inference_mode()
    def forward(
        self,
        cache: RowKVCache,
        tokens: torch.Tensor,
        tree: torch.Tensor,
        depth: torch.Tensor,
        logits_at: torch.Tensor | None = None,
        offset: int = 0,
        rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] (or [B, K, V] at the new-token indices `logits_at`) for new tokens [B, T].

        `tree` is [B, T, offset + T]: what each new token sees among the row's uncommitted slots
        (`offset` of them written by earlier forwards of this step, then the new ones). `rows`: the
        cache rows that tokens' rows are (default: all, in order).
        """
        tokens = tokens.to(self.device)
        in_place = self.reads_rows_in_place and rows is not None
        cache.prepare(tokens.shape[1], offset, rows, gather=not in_place)
        self.peak_cache_bytes = max(self.peak_cache_bytes, cache.nbytes)
        mask = cache.attention_mask(tree.to(self.device))
        if self.additive_mask:
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~mask, torch.finfo(self.dtype).min
            )
        kv_rows = torch.tensor(rows, dtype=torch.long) if in_place else None
        positions = cache.row_lens()[:, None] + depth.to(self.device)
        keep = None if logits_at is None else logits_at.to(self.device)
        if self.layers is not None:
            logits, hidden = self.layers.forward(cache, tokens, mask, positions, kv_rows, keep, self.hidden_layer)
            if self.hidden_layer is not None:
                self.last_hidden = hidden
        else:
            logits = self._transformers_forward(cache, tokens, mask, positions, kv_rows, keep)
        self.forwards += 1
        self.rows += tokens.shape[0]
        return logits

    def _transformers_forward(
        self,
        cache: RowKVCache,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        kv_rows: torch.Tensor | None,
        logits_at: torch.Tensor | None,
    ) -> torch.Tensor:
        extra = {} if kv_rows is None else {"kv_rows": kv_rows}
        hook = None
        if self.hidden_layer is not None:
            hook = decoder_layers(self.model)[self.hidden_layer].register_forward_hook(self._keep_hidden)
        try:
            out = self.model(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=0 if logits_at is None else logits_at,
                **extra,
            )
        finally:
            if hook is not None:
                hook.remove()
        return out.logits

    def start(self, prompts: list[list[int]], capacity: int) -> tuple[RowKVCache, list[list[int]]]:
        """A cache for the prompts and, per row, the tokens still to feed (`pending`).

        ToT prompts share long prefixes: the n trajectories of a thought step have one prompt, the
        evaluator prompts of a step share the question and the path so far, and the next step's
        prompts extend this step's prompts and thoughts. The prefix common to all prompts (all but
        one token of it at least) is computed once and fanned out to every row, after the longest
        part of it an earlier call stored; then each row takes the longest stored prefix of its own
        prompt beyond that. What is left stays pending, fed with each row's first draft.
        """
        shared = min(_common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
        head = tuple(prompts[0][:shared])
        reuse_key, reuse = self.prefixes.match(head)
        if shared < MIN_SHARED_PREFIX and not reuse:
            shared = 0
        # A scheduler may verify a row's first draft (its whole pending part, left-padded) in one
        # forward with rows already far along: every row's slots then span the widest pending part
        # past the longest row, so the cache needs that much room beyond `capacity`.
        capacity += max(len(p) for p in prompts) - shared
        capture = self.hidden_layer is not None
        self.start_hidden = None
        if capture:
            self.start_hidden = torch.zeros(0, self.config.hidden_size, dtype=self.dtype, device=self.device)
        if not shared:
            cache = self.new_cache(len(prompts), capacity)
        else:
            cache = self.new_cache(1, capacity)
            hidden = [self.prefixes.restore(reuse_key, cache, 0, 0, reuse)] if reuse else []
            rest = list(head[reuse:])
            if rest:
                causal = torch.ones(len(rest), len(rest), dtype=torch.bool).tril()[None]
                self.forward(
                    cache, torch.tensor([rest]), causal, torch.arange(len(rest))[None], logits_at=torch.tensor([0])
                )
                cache.advance(torch.tensor([len(rest)]))
                if capture:
                    hidden.append(self.last_hidden[0])  # type: ignore[index]
                self.prefixes.store(head, cache, 0, torch.cat(hidden) if capture else None)
                self.prompt_tokens_computed += len(rest)
            if capture:
                self.start_hidden = torch.cat(hidden) if hidden else self.start_hidden
            cache.select_rows(torch.zeros(len(prompts), dtype=torch.long))
        done = [shared] * len(prompts)
        if not capture:  # (a drafter reading hidden states needs them for every prompt position)
            for b, p in enumerate(prompts):
                key, n = self.prefixes.match(p[:-1])
                if n > shared:
                    self.prefixes.restore(key, cache, b, shared, n)
                    done[b] = n
        pending = [list(p[n:]) for p, n in zip(prompts, done)]
        self.prompt_tokens_computed += sum(len(p) for p in pending)
        return cache, pending

    def remember(self, cache: RowKVCache, sequences: list[list[int]]) -> None:
        """Store what a call's rows committed (prompt and generated tokens, row b = sequences[b])
        for later prompts that extend them: the next step's prompts continue this step's thoughts."""
        if self.hidden_layer is not None:
            return
        for b, tokens in enumerate(sequences):
            n = int(cache.lens[b])
            self.prefixes.store(tuple(tokens[:n]), cache, b)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a `transformers` causal LM (model.model.layers for Llama-like models)."""
    layers = getattr(model.get_decoder(), "layers", None)  # type: ignore[operator]
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layer list (get_decoder().layers)")
    return layers
