"""The schedules, and a decoder built from its kind: a schedule plus a drafter.

The drafters and the decoders that use them are declared by their plug-in modules (decoding/api/kinds.py
builds the tables); a schedule is one entry of `SCHEDULES`.
"""

from __future__ import annotations

from collections.abc import Callable

from decoding.api.config import DecoderConfig
from decoding.api.kinds import DECODERS, DRAFTERS
from decoding.drafters.base import Drafter
from decoding.drafters.draft_model import build as model_drafter
from decoding.drafters.union import UnionDrafter
from decoding.runtime.models import LoadedModel
from decoding.runtime.runner import ModelRunner
from decoding.schedules.base import Decoder
from decoding.schedules.hf import HFDecoder
from decoding.schedules.planner import Planner, goodput_planner
from decoding.schedules.scheduler import Scheduler
from decoding.speculation.stopping import Detokenizer

Schedule = Callable[[str, DecoderConfig, ModelRunner, Detokenizer, Drafter], Decoder]


def planner_for(c: DecoderConfig, target: ModelRunner, drafter: Drafter) -> Planner | None:
    """The step planner where verify.plan=goodput has trees to plan (its cost profile is measured
    here, once per machine and cached, not by the schedule)."""
    goodput = c.verify.for_decoder(c.name).plan == "goodput"
    return goodput_planner(target, c.verify.cost) if goodput and drafter.max_nodes else None


SCHEDULES: dict[str, Schedule] = {
    "hf": lambda name, c, target, tok, drafter: HFDecoder(target, tok, c.verify.rule),
    # Every sequence in flight in each forward (`ar`, `stand`, ...).
    "batch": lambda name, c, target, tok, drafter: Scheduler(
        name, target, tok, drafter, verify=c.verify, planner=planner_for(c, target, drafter)
    ),
    # One sequence at a time, as SEED's SD / MCSD baselines run.
    "serial": lambda name, c, target, tok, drafter: Scheduler(
        name, target, tok, drafter, max_live=1, verify=c.verify, planner=planner_for(c, target, drafter)
    ),
    # SEED's rounds, drafting beside the verifier with overlap; up to verify_batch queued drafts per
    # forward under verify.plan=fixed (SEED's Algorithm 1, `seed`'s default), every ready row under
    # the goodput plan (the planner sizes trees, it never makes a row wait).
    "rounds": lambda name, c, target, tok, drafter: Scheduler(
        name,
        target,
        tok,
        drafter,
        c.rounds.verify_batch if c.verify.plan == "fixed" else None,
        c.rounds.overlap,
        verify=c.verify,
        planner=planner_for(c, target, drafter),
    ),
}


def make_decoder(
    config: DecoderConfig, target: ModelRunner, tokenizer: Detokenizer, draft: LoadedModel | None
) -> Decoder:
    kind = DECODERS[config.name]
    drafter = DRAFTERS[kind.drafter].build(config, target, tokenizer, draft)
    if kind.draft_model == "optional" and draft is not None:
        drafter = UnionDrafter(
            [model_drafter(config, target, tokenizer, draft), drafter], config.verify.rule != "rejection"
        )
    return SCHEDULES[kind.schedule](config.name, config, target, tokenizer, drafter)
