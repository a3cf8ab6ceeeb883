"""What a forward costs on the running machine: verification forwards timed over a row cache, and
the draft/target speed ratio that PCT's tree policy reads (s_d / s_t)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from decoding.runtime.kv_cache import KVCache
from decoding.runtime.packing import pack
from decoding.runtime.runner import ModelRunner, Scored
from decoding.speculation.draft_tree import DraftTree, k_config_parents


def timed_ms(step: Callable[[], object], repeats: int, device: torch.device | None = None) -> list[float]:
    """Milliseconds of each of `repeats` calls of `step`, after one warm-up call (kernels, allocations)."""
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        step()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(1000 * (time.perf_counter() - t0))
    return times


def chain_tree(size: int, vocab: int) -> DraftTree:
    """A tree of `size` nodes; its cost depends on the node count, not the shape (the mask is dense)."""
    tree = DraftTree()
    for parent in k_config_parents((1,) * size) if size else []:
        tree.add((1000 + len(tree)) % vocab, parent)
    return tree


def time_forward(target: ModelRunner, context: int, tree_size: int, batch: int, repeats: int) -> list[float]:
    """Milliseconds of each of `repeats` verification forwards (after one warm-up)."""
    return timed_ms(verification(target, context, tree_size, batch), repeats, target.device)


def filled(target: ModelRunner, context: int) -> KVCache:
    """A one-row cache holding `context` committed tokens: the prompt every timed forward attends to."""
    cache = target.new_cache(1, context + 2)
    vocab = int(target.config.vocab_size)
    fill = pack([[(100 + i) % vocab for i in range(context)]], [DraftTree()])
    target.forward(cache, fill.tokens, fill.see, fill.depth, logits_at=torch.tensor([context - 1]), rows=[0])
    cache.advance(torch.tensor([context]))
    return cache


def verification(
    target: ModelRunner,
    context: int,
    tree_size: int,
    batch: int,
    siblings: int = 1,
    shared: int = 0,
    prompt: KVCache | None = None,
) -> Callable[[], Scored]:
    """A verification forward as the decoders call it, ready to repeat: `batch` rows that hold
    `context` committed tokens each score a tree of `tree_size` tokens (the pending root included).
    With `siblings` > 1, rows in groups of that many read their first `shared` positions once (the
    samples of one ToT state); else every row reads its own copy, which the planner's profile prices.
    `prompt`: `filled(target, context)`, computed once for many forwards timed over it."""
    capacity = context + tree_size + 2
    cache = target.new_cache(batch, capacity, graphs=True)
    vocab = int(target.config.vocab_size)
    # One row's prompt computed, its keys and values copied into every row: the same cache a batched
    # prefill writes (a row's bits do not depend on the rows beside it), for 1/batch of its cost (a
    # 64-row prefill of a 0.5B model took minutes of a planner's profile on 2 cores).
    prompt = filled(target, context) if prompt is None else prompt
    cache.copy_prefix(prompt, 0, list(range(batch)), context, share=False)
    if siblings > 1 and shared:
        for first in range(0, batch, siblings):
            cache.share(list(range(first, min(first + siblings, batch))), shared)
    tree = chain_tree(tree_size - 1, vocab)  # the root (pending token) plus tree_size - 1 drafted nodes
    packed = pack([[7]] * batch, [tree] * batch)
    return lambda: target.score(cache, packed)


def speed_ratio(draft_ms: float, target: ModelRunner, context: int = 64, repeats: int = 5) -> tuple[float, float]:
    """PCT's s_d / s_t: a draft forward's median time `draft_ms` against one target verification
    forward of one token after `context` tokens (median of `repeats`). Returns (ratio, s_t ms)."""
    s_t = statistics.median(time_forward(target, context, 1, 1, repeats))
    return draft_ms / s_t, s_t
