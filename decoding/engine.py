"""The backend's front door: `Engine.generate(list[GenRequest]) -> list[GenResult]`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from decoding.aded import AdedDrafter
from decoding.config import DECODERS, DecoderConfig
from decoding.draft_model import ModelDrafter, SpecOptions
from decoding.edd import EddDrafter, EddModel, draft_vocab
from decoding.errors import BackendError
from decoding.hf import HFDecoder
from decoding.models import LoadedModel, ModelSpec
from decoding.pld import PLDDrafter
from decoding.recycling import RecyclingDrafter
from decoding.sampling import SamplingParams
from decoding.seed import SeedDecoder
from decoding.sequence import Sequence
from decoding.speculative import Drafter, NoDrafter, SpecDecoder
from decoding.stand import NGramDrafter, StaticTree
from decoding.stopping import Detokenizer, StopRule, final_text
from decoding.target import Target
from decoding.types import DecodeStats, GenRequest, GenResult
from decoding.union import UnionDrafter


class Decoder(Protocol):
    """Decodes sequences in place (fills `generated` and `reason`) and reports the call's cost."""

    name: str

    def run(self, seqs: list[Sequence]) -> DecodeStats: ...


def make_decoder(config: DecoderConfig, target: Target, tokenizer: Detokenizer, draft: LoadedModel | None) -> Decoder:
    if config.name == "hf":
        return HFDecoder(target, tokenizer)
    if config.name == "ar":
        return SpecDecoder("ar", target, tokenizer, NoDrafter())
    if config.name in ("sd", "seed"):
        if draft is None:
            raise BackendError(f"decoder={config.name} needs a draft model (draft.path)")
        drafter = _model_drafter(draft, target, config.spec, config.draft)
        if config.name == "seed":
            return SeedDecoder(target, tokenizer, drafter, config.seed)
        return SpecDecoder("sd", target, tokenizer, drafter, serial=True)
    if config.name in ("stand", "seed_stand"):
        ngram = NGramDrafter(config.stand, StaticTree.load(config.stand.tree), _vocab_size(target))
        if config.name == "seed_stand":
            drafter = ngram
            if draft is not None:
                drafter = UnionDrafter([_model_drafter(draft, target, config.spec, config.draft), ngram])
            return SeedDecoder(target, tokenizer, drafter, config.seed, name="seed_stand")
        return SpecDecoder("stand", target, tokenizer, ngram)
    if config.name == "pld":
        return SpecDecoder("pld", target, tokenizer, PLDDrafter(config.pld))
    if config.name == "aded":  # aded.corpus, if any, is tokenised here with the target's tokenizer
        return SpecDecoder("aded", target, tokenizer, AdedDrafter(config.aded, tokenizer))
    if config.name == "recycling":
        return SpecDecoder(
            "recycling", target, tokenizer, RecyclingDrafter(config.recycling, StaticTree.load(config.stand.tree))
        )
    raise BackendError(f"decoder={config.name!r} is not one of {', '.join(DECODERS)}")


def _model_drafter(draft: LoadedModel, target: Target, spec: SpecOptions, draft_spec: ModelSpec | None) -> Drafter:
    """The drafter of a loaded draft model: an EDD (draft.path=edd) reads the target's hidden states,
    over its draft vocabulary when draft.vocab is set; any other causal LM gets a Target of its own
    (its own forward count), also for the target's weights."""
    if isinstance(draft.model, EddModel):
        size = None if draft_spec is None else draft_spec.vocab
        vocab = None if size is None else draft_vocab(Path(draft.source), size)
        return EddDrafter(draft.model, target, spec, vocab)
    # The target too: tree_policy=pct measures s_d / s_t against it at start-up.
    return ModelDrafter(Target(draft.model), spec, _vocab_size(target), target=target)


def _vocab_size(target: Target) -> int:
    head = target.model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(target.config.vocab_size)


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
        self.target = Target(loaded.model)
        config = decoder if isinstance(decoder, DecoderConfig) else DecoderConfig(decoder)
        self.decoder = make_decoder(config, self.target, self.tokenizer, draft)
        self.eos_ids = _eos_ids(loaded)
        self.last_stats = DecodeStats()
        self.total_stats = DecodeStats()

    def peak_cache_bytes(self) -> int:
        """The largest KV caches this engine's decoder has held: the target's, plus the draft model's."""
        drafter_model = getattr(getattr(self.decoder, "drafter", None), "model", None)
        extra = drafter_model.peak_cache_bytes if isinstance(drafter_model, Target) else 0
        return self.target.peak_cache_bytes + extra

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
