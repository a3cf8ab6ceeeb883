"""The decoders by name: each is a schedule plus a drafter, and the option sections it reads.

The config (decoding/config.py) checks names and options against this table at load time; the
builders of each schedule and drafter are in decoding/decoders.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DraftModel = Literal["none", "required", "optional"]


@dataclass(frozen=True)
class DecoderKind:
    schedule: str  # a key of SCHEDULES
    drafter: str  # a key of DRAFTERS
    options: tuple[str, ...] = ()  # the DecoderConfig fields (config namespaces) it reads
    draft_model: DraftModel = "none"  # optional: with draft.path set, the model's tree joins the drafter's
    tree_section: str = ""  # the namespace of its draft-model tree options (sd or seed)


DECODERS: dict[str, DecoderKind] = {
    # hf and ar read verify.rule alone: which sampler decides their tokens at temperature > 0.
    "hf": DecoderKind("hf", "none", ("verify",)),
    "ar": DecoderKind("batch", "none", ("verify",)),
    "sd": DecoderKind("serial", "model", ("draft_tree", "verify"), "required", "sd"),
    "seed": DecoderKind("seed", "model", ("draft_tree", "seed", "verify"), "required", "seed"),
    "pld": DecoderKind("batch", "pld", ("pld", "verify")),
    "recycling": DecoderKind("batch", "recycling", ("recycling", "stand", "verify")),
    "stand": DecoderKind("batch", "stand", ("stand", "suffix", "verify")),
    "seed_stand": DecoderKind("seed", "stand", ("draft_tree", "seed", "stand", "suffix", "verify"), "optional", "seed"),
    "suffix": DecoderKind("batch", "suffix", ("suffix", "verify")),
    "aded": DecoderKind("batch", "aded", ("aded", "verify")),
}
