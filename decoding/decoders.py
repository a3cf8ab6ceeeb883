"""The tables of the backend's plug-ins: every decoder is a schedule plus a drafter.

Adding a drafter is one file in decoding/drafters/, one entry in `DRAFTERS`, one entry in
`DECODERS` (decoding/kinds.py: its name, schedule, option sections) and one yaml in conf/decoder/ (its options go in
conf/decoding/options.yaml and a field of `DecoderConfig`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from decoding.config import DecoderConfig
from decoding.core.errors import BackendError
from decoding.core.models import LoadedModel
from decoding.core.runner import ModelRunner
from decoding.core.stopping import Detokenizer
from decoding.drafters.aded import AdedDrafter
from decoding.drafters.base import Drafter, NoDrafter
from decoding.drafters.draft_model import ModelDrafter
from decoding.drafters.edd import EddDrafter
from decoding.drafters.pld import PLDDrafter
from decoding.drafters.recycling import RecyclingDrafter
from decoding.drafters.stand import StandDrafter
from decoding.drafters.suffix import SuffixDrafter
from decoding.drafters.union import UnionDrafter
from decoding.edd.model import EddModel, draft_vocab
from decoding.kinds import DECODERS
from decoding.schedules.base import Decoder
from decoding.schedules.hf import HFDecoder
from decoding.schedules.scheduler import Scheduler
from decoding.trees.static import StaticTree

DrafterFactory = Callable[[DecoderConfig, ModelRunner, Detokenizer, LoadedModel | None], Drafter]
Schedule = Callable[[str, DecoderConfig, ModelRunner, Detokenizer, Drafter], Decoder]


def model_drafter(
    config: DecoderConfig, target: ModelRunner, tokenizer: Detokenizer, draft: LoadedModel | None
) -> Drafter:
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
    runner = ModelRunner(draft.model, target.prefixes.budget, draft.static, draft.strict_graphs)
    return ModelDrafter(runner, config.draft_tree, target.vocab_size, target=target, coupled=config.verify.coupled)


def stand_drafter(config: DecoderConfig, target: ModelRunner) -> Drafter:
    """STAND's pool, with stand.suffix the suffix drafter's tree beside it (merged as one trie under
    the matched rules: a token both propose at the same place is verified once)."""
    stand = StandDrafter(config.stand, StaticTree.load(config.stand.tree), target.vocab_size, config.verify.coupled)
    if not config.stand.suffix:
        return stand
    return UnionDrafter([stand, SuffixDrafter(config.suffix, config.verify.coupled)], config.verify.rule != "rejection")


DRAFTERS: dict[str, DrafterFactory] = {
    "none": lambda c, target, tok, draft: NoDrafter(),
    "model": model_drafter,
    "stand": lambda c, target, tok, draft: stand_drafter(c, target),
    "suffix": lambda c, target, tok, draft: SuffixDrafter(c.suffix, c.verify.coupled),
    "pld": lambda c, target, tok, draft: PLDDrafter(c.pld),
    # aded.corpus, if any, is tokenised with the target's tokenizer
    "aded": lambda c, target, tok, draft: AdedDrafter(c.aded, tok, c.verify.coupled),
    "recycling": lambda c, target, tok, draft: RecyclingDrafter(
        c.recycling, StaticTree.load(c.stand.tree), c.verify.coupled
    ),
}

SCHEDULES: dict[str, Schedule] = {
    "hf": lambda name, c, target, tok, drafter: HFDecoder(target, tok, c.verify.rule),
    # Every sequence in flight in each forward (`ar`, `stand`, ...).
    "batch": lambda name, c, target, tok, drafter: Scheduler(name, target, tok, drafter, verify=c.verify),
    # One sequence at a time, as SEED's SD / MCSD baselines run.
    "serial": lambda name, c, target, tok, drafter: Scheduler(name, target, tok, drafter, max_live=1, verify=c.verify),
    # SEED's rounds, drafting beside the verifier with overlap; up to verify_batch queued drafts per
    # forward under verify.plan=fixed (SEED's Algorithm 1, `seed`'s default), every ready row under
    # the goodput plan (the planner sizes trees, it never makes a row wait).
    "seed": lambda name, c, target, tok, drafter: Scheduler(
        name,
        target,
        tok,
        drafter,
        c.seed.verify_batch if c.verify.plan == "fixed" else None,
        c.seed.overlap,
        verify=c.verify,
    ),
}


def make_decoder(
    config: DecoderConfig, target: ModelRunner, tokenizer: Detokenizer, draft: LoadedModel | None
) -> Decoder:
    kind = DECODERS[config.name]
    drafter = DRAFTERS[kind.drafter](config, target, tokenizer, draft)
    if kind.draft_model == "optional" and draft is not None:
        drafter = UnionDrafter(
            [model_drafter(config, target, tokenizer, draft), drafter], config.verify.rule != "rejection"
        )
    return SCHEDULES[kind.schedule](config.name, config, target, tokenizer, drafter)
