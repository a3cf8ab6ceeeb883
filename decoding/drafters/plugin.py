"""What a drafter module declares to be a plug-in: `PLUGIN = DrafterPlugin(...)`.

The declaration names the drafter, the options dataclass and the config section it reads, its
builder, and the decoders (`DecoderKind`: a schedule plus a drafter) it adds. decoding/api/kinds.py
builds the tables from the declarations alone (decoding/base/plugins.py: the one mechanism every
kind of plug-in shares).

`build(config, target, tokenizer, draft)`: the decoder's config (`BuildConfig`: what a builder reads
of decoding/api/config.py's `DecoderConfig`), the target's `ModelRunner`, its `Detokenizer`, and the draft
model's `LoadedModel` or None; it returns the engine's `Drafter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from decoding.base.errors import ConfigError
from decoding.base.plugins import Plugin
from decoding.runtime.spec import ModelSpec
from decoding.speculation.options import VerifyOptions
from decoding.trees.options import DraftTreeOptions

DraftModel = Literal["none", "required", "optional"]
# Config sections the schedules and the engine own: no drafter may read its options from them.
RESERVED = frozenset({"name", "draft_tree", "seed", "rounds", "verify", "draft", "server", "decoder", "model"})


class BuildConfig(Protocol):
    """What a drafter's builder reads of the decoder's config (`DecoderConfig` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def verify(self) -> VerifyOptions: ...
    @property
    def draft_tree(self) -> DraftTreeOptions: ...  # the draft model's tree (draft_tree.*)
    @property
    def draft(self) -> ModelSpec | None: ...

    def section(self, name: str) -> Any:
        """The options of a drafter's config section (its defaults where not given)."""
        ...


@dataclass(frozen=True)
class DecoderKind:
    """A decoder (`decoder=name`): a schedule, a drafter, and the config sections it reads."""

    name: str
    schedule: str  # a key of decoding.api.decoders.SCHEDULES: hf, batch, serial, rounds
    drafter: str  # the name of a DrafterPlugin
    options: tuple[str, ...] = ()  # the DecoderConfig fields (config sections) it reads
    draft_model: DraftModel = "none"  # optional: with draft.path set, the model's tree joins the drafter's


@dataclass(frozen=True)
class DrafterPlugin(Plugin):
    KIND: ClassVar[str] = "drafter"

    decoders: tuple[DecoderKind, ...] = ()

    def check(self, module: str) -> None:
        super().check(module)
        if (self.options is None) != (self.section == ""):
            raise ConfigError(f"plug-in module {module}: PLUGIN declares options without a section, or a section alone")
        if self.section in RESERVED:
            raise ConfigError(f"plug-in module {module}: section {self.section} belongs to the schedules")
