"""The built-in drafters' declarations: names, options, decoders, and builders imported on first build.

Declared apart from the drafters (which import torch: seconds) so that reading the tables, to list
the decoders or check a config's sections, loads none of them. A drafter from outside the project
is one module with its own `PLUGIN` (decoding/drafters/plugin.py); these are the table's entries
"decoding.drafters.builtin:NAME" (decoding/api/kinds.py).
"""

from __future__ import annotations

from decoding.base.plugins import Deferred
from decoding.drafters.options import AdedOptions, PLDOptions, RecyclingOptions, StandOptions, SuffixOptions
from decoding.drafters.plugin import DecoderKind, DrafterPlugin

NONE = DrafterPlugin(
    name="none",
    build=Deferred("decoding.drafters.base:build"),
    decoders=(
        # hf and ar read verify.rule alone: which sampler decides their tokens at temperature > 0.
        DecoderKind("hf", "hf", "none", ("verify",)),
        DecoderKind("ar", "batch", "none", ("verify",)),
    ),
)

MODEL = DrafterPlugin(
    name="model",
    build=Deferred("decoding.drafters.draft_model:build"),
    decoders=(
        # SEED's SD / MCSD baseline: one sequence at a time; the tree's options in draft_tree.*
        DecoderKind("sd", "serial", "model", ("draft_tree", "verify"), "required"),
        DecoderKind("seed", "rounds", "model", ("draft_tree", "rounds", "verify"), "required"),
    ),
)

PLD = DrafterPlugin(
    name="pld",
    build=Deferred("decoding.drafters.pld:build"),
    options=PLDOptions,
    section="pld",
    decoders=(DecoderKind("pld", "batch", "pld", ("pld", "verify")),),
)

RECYCLING = DrafterPlugin(
    name="recycling",
    build=Deferred("decoding.drafters.recycling:build"),  # its tree is STAND's (stand.tree)
    options=RecyclingOptions,
    section="recycling",
    decoders=(DecoderKind("recycling", "batch", "recycling", ("recycling", "stand", "verify")),),
)

STAND = DrafterPlugin(
    name="stand",
    build=Deferred("decoding.drafters.stand:build"),
    options=StandOptions,
    section="stand",
    decoders=(
        DecoderKind("stand", "batch", "stand", ("stand", "suffix", "verify")),
        # the project's default; with draft.path set, the draft model's tree joins the pool's
        DecoderKind("seed_stand", "rounds", "stand", ("draft_tree", "rounds", "stand", "suffix", "verify"), "optional"),
    ),
)

SUFFIX = DrafterPlugin(
    name="suffix",
    build=Deferred("decoding.drafters.suffix:build"),
    options=SuffixOptions,
    section="suffix",
    decoders=(DecoderKind("suffix", "batch", "suffix", ("suffix", "verify")),),
)

ADED = DrafterPlugin(
    name="aded",
    build=Deferred("decoding.drafters.aded:build"),  # aded.corpus, if any, is tokenised with the target's tokenizer
    options=AdedOptions,
    section="aded",
    decoders=(DecoderKind("aded", "batch", "aded", ("aded", "verify")),),
)
