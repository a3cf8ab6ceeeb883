"""What a drafter module declares to be a plug-in: `PLUGIN = DrafterPlugin(...)`.

The declaration names the drafter, the options dataclass and the config section it reads, its
builder, and the decoders (`DecoderKind`: a schedule plus a drafter) it adds. decoding/kinds.py
imports the plug-in modules (its `MODULES`, and those `TOT_SPEC_PLUGINS` names) and builds the
tables and `DecoderConfig`'s sections from their declarations alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from decoding.config import DecoderConfig
    from decoding.core.models import LoadedModel
    from decoding.core.runner import ModelRunner
    from decoding.core.stopping import Detokenizer
    from decoding.drafters.base import Drafter

DraftModel = Literal["none", "required", "optional"]
# (config, target, tokenizer, draft model or None) -> the drafter of one engine
Builder = Callable[["DecoderConfig", "ModelRunner", "Detokenizer", "LoadedModel | None"], "Drafter"]


@dataclass(frozen=True)
class DecoderKind:
    """A decoder (`decoder=name`): a schedule, a drafter, and the config sections it reads."""

    name: str
    schedule: str  # a key of decoding.decoders.SCHEDULES: hf, batch, serial, seed
    drafter: str  # the name of a DrafterPlugin
    options: tuple[str, ...] = ()  # the DecoderConfig fields (config sections) it reads
    draft_model: DraftModel = "none"  # optional: with draft.path set, the model's tree joins the drafter's
    tree_section: str = ""  # the section of its draft-model tree options (sd or seed)


@dataclass(frozen=True)
class DrafterPlugin:
    name: str
    build: Builder
    options: type[Any] | None = None  # a frozen dataclass of the drafter's options, read from `section`
    section: str = ""  # its config section (`pld:` -> config.pld), in options.yaml or the decoder's own yaml
    decoders: tuple[DecoderKind, ...] = ()
