"""A causal LM as the decoders see it (the target, or a draft model): forwards over a per-row KV cache."""

from __future__ import annotations

import torch

from decoding.core import attention, llama
from decoding.core.kv_cache import RowKVCache
from decoding.core.prefix_cache import PrefixCache, shared_len

MIN_SHARED_PREFIX = 8  # shorter common prefixes are simply fed with each row


def _common_prefix_len(prompts: list[list[int]]) -> int:
    first = tuple(prompts[0])
    n = len(first)
    for p in prompts[1:]:
        n = shared_len(first[:n], tuple(p))
    return n


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
        self.prefixes = PrefixCache()
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
        self.prefixes = PrefixCache(self.prefixes.max_bytes)

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
        reused = self.prefixes.match(head)
        reuse = reused.length
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
            hidden = [self.prefixes.restore(reused, cache, 0, 0, reuse)] if reuse else []
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
                if len(p) - 1 <= shared:
                    continue  # nothing of its own to look up (the n samples of one prompt)
                own = self.prefixes.match(p[:-1])
                if own.length > shared:
                    self.prefixes.restore(own, cache, b, shared, own.length)
                    done[b] = own.length
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
