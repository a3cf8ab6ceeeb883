"""`decoder=ar`: every sequence in flight decoded together, one token per row per target forward."""

from __future__ import annotations

import time

import torch

from decoding.sampling import process_logits, sample
from decoding.sequence import Sequence
from decoding.stopping import Detokenizer
from decoding.target import Target
from decoding.types import DecodeStats


class ARDecoder:
    name = "ar"

    def __init__(self, target: Target, tokenizer: Detokenizer) -> None:
        self.target = target
        self.tokenizer = tokenizer

    def run(self, seqs: list[Sequence]) -> DecodeStats:
        stats = DecodeStats()
        t0 = time.perf_counter()
        capacity = max(len(s.prompt) + s.rule.max_new_tokens for s in seqs)
        cache, logits = self.target.prefill([s.prompt for s in seqs], capacity)
        stats.target_forwards += 1
        stats.verify_s += time.perf_counter() - t0
        live = list(seqs)
        one = torch.ones(1, 1, dtype=torch.bool)
        while True:
            t1 = time.perf_counter()
            probs = process_logits(logits, [s.params for s in live])
            tokens = sample(probs, [s.generator for s in live]).tolist()
            for s, t in zip(live, tokens):
                s.commit([t], self.tokenizer)
            stats.verify_steps += len(live)
            keep = [i for i, s in enumerate(live) if not s.done]
            if len(keep) < len(live):
                # A finished row leaves the batch so it costs nothing in later forwards.
                live = [live[i] for i in keep]
                if not live:
                    stats.other_s += time.perf_counter() - t1
                    break
                index = torch.tensor(keep)
                cache.select_rows(index)
                tokens = [tokens[i] for i in keep]
            stats.other_s += time.perf_counter() - t1
            t2 = time.perf_counter()
            n = len(live)
            step = torch.tensor(tokens)[:, None]
            logits = self.target.forward(cache, step, one.expand(n, 1, 1), torch.zeros(n, 1, dtype=torch.long))[:, 0]
            cache.advance(torch.ones(n, dtype=torch.long))
            stats.target_forwards += 1
            stats.verify_s += time.perf_counter() - t2
        stats.generated_tokens = sum(s.stats.generated_tokens for s in seqs)
        return stats
