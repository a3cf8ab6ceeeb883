"""The backend's front door: `Engine.generate(list[GenRequest]) -> list[GenResult]`."""

from __future__ import annotations

import time

from decoding.config import DecoderConfig
from decoding.core.errors import BackendError
from decoding.core.models import LoadedModel
from decoding.core.runner import ModelRunner
from decoding.core.sampling import SamplingParams
from decoding.core.sequence import Sequence
from decoding.core.stopping import StopRule, final_text
from decoding.core.values import DecodeStats, GenRequest, GenResult
from decoding.decoders import make_decoder


class Engine:
    """Tokenizes requests, hands them all to one decoder at once, and detokenizes the results.

    `last_stats` holds the cost of the latest call as a whole (a batched forward counts once);
    each result's own stats count that sequence's tokens and verification steps.
    """

    def __init__(
        self, loaded: LoadedModel, decoder: str | DecoderConfig = "ar", draft: LoadedModel | None = None
    ) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.target = ModelRunner(loaded.model)
        config = decoder if isinstance(decoder, DecoderConfig) else DecoderConfig(decoder)
        self.decoder = make_decoder(config, self.target, self.tokenizer, draft)
        self.eos_ids = _eos_ids(loaded)
        self.last_stats = DecodeStats()
        self.total_stats = DecodeStats()

    def peak_cache_bytes(self) -> int:
        """The largest KV caches this engine's decoder has held: the target's, plus the draft model's."""
        return self.target.peak_cache_bytes + self.decoder.drafter.peak_cache_bytes()

    def encode(self, prompt: str | tuple[int, ...], prefix: str = "") -> list[int]:
        if not isinstance(prompt, str):
            ids = list(prompt)
            return ids + self.tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else ids
        if self.loaded.use_chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer(text + prefix, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt + prefix)["input_ids"]

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        if not requests:
            self.last_stats = DecodeStats()
            return []
        t0 = time.perf_counter()
        seqs = [self._sequence(r) for r in requests]
        stats = self.decoder.run(seqs)
        results = [
            GenResult(
                text=final_text(s.generated, s.reason, r.stop, self.tokenizer),
                token_ids=list(s.generated),
                finish_reason=s.reason or "length",
                stats=s.stats,
            )
            for s, r in zip(seqs, requests)
        ]
        # Tokenizing and detokenizing is part of what a call costs.
        elapsed = time.perf_counter() - t0
        stats.other_s += max(0.0, elapsed - (stats.draft_s + stats.verify_s + stats.other_s))
        stats.elapsed_s = elapsed
        stats.sequences = len(seqs)
        stats.sequence_acceptance_sum = sum(s.stats.acceptance_length for s in seqs)
        self.last_stats = stats
        self.total_stats += stats
        return results

    def _sequence(self, r: GenRequest) -> Sequence:
        ids = self.encode(r.prompt, r.prefix)
        if not ids:
            raise BackendError("a request has an empty prompt; give at least one token of prompt")
        limit = self.target.max_length
        if len(ids) + r.max_new_tokens > limit:
            raise BackendError(
                f"a prompt of {len(ids)} tokens plus max_new_tokens={r.max_new_tokens} exceeds the model's context "
                f"of {limit} tokens; shorten the prompt or lower the token limits (gen.max_thought_tokens, "
                "gen.max_eval_tokens)"
            )
        rule = StopRule(self.eos_ids, r.stop, r.max_new_tokens)
        return Sequence.create(ids, rule, SamplingParams(r.temperature, r.top_k, r.top_p), r.seed, r.group)


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    for e in (gen_eos, getattr(loaded.tokenizer, "eos_token_id", None)):
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(e)
    return frozenset(ids)
