"""Which decoder to run and with what options, read from the config and checked at load time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from decoding.api.kinds import DECODERS, SECTIONS
from decoding.api.server import NAME as SERVER
from decoding.api.server import ServerOptions
from decoding.base.errors import ConfigError
from decoding.base.options import from_dict
from decoding.base.plugins import unknown
from decoding.runtime.spec import ModelSpec
from decoding.schedules.options import RoundsOptions
from decoding.speculation.options import VerifyOptions
from decoding.trees.options import DraftTreeOptions

# The config section a schedule field is read from, where the two differ: SEED's rounds read `seed.*`.
SECTION_OF = {"rounds": "seed"}


def choices() -> tuple[str, ...]:
    """decoder=...: the in-process decoders (plug-ins included), and a server's engine."""
    return (*DECODERS, SERVER)


def unknown_decoder(name: str) -> ConfigError:
    return unknown("decoder", name, choices())


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder (a key of decoding.api.kinds.DECODERS) and the options of every section it reads: the
    schedules' own fields, and the drafters' sections (`options`, section -> its options; a section
    not given reads its defaults)."""

    name: str = "ar"
    draft_tree: DraftTreeOptions = field(default_factory=DraftTreeOptions)  # from draft_tree.*
    rounds: RoundsOptions = field(default_factory=RoundsOptions)  # from the seed.* section
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    draft: ModelSpec | None = None  # path "self" drafts with the target itself
    server: ServerOptions | None = None  # decoder=server: the serving engine to send requests to
    options: Mapping[str, Any] = field(default_factory=dict)  # a drafter's section -> its options

    def __post_init__(self) -> None:
        if self.name == SERVER:
            if self.server is None:
                raise ConfigError("decoder=server needs the server: options (server.url, server.model, ...)")
            return
        if self.name not in DECODERS:
            raise unknown_decoder(self.name)
        if DECODERS[self.name].draft_model == "required" and self.draft is None:
            raise ConfigError(
                f"decoder={self.name} drafts with a draft model: set draft.path=<Hugging Face id or directory "
                "sharing the target's tokenizer>, or draft.path=self to measure the machinery alone"
            )
        for section, value in self.options.items():
            if section not in SECTIONS or not isinstance(value, SECTIONS[section]):
                raise ConfigError(f"DecoderConfig.options[{section!r}] is not a drafter section's options: {value!r}")

    def section(self, name: str) -> Any:
        """The options a drafter reads from config section `name` (its defaults where not given)."""
        return self.options[name] if name in self.options else SECTIONS[name]()

    @classmethod
    def from_container(cls, c: dict[str, Any]) -> DecoderConfig:
        """From a resolved config: `decoder.name`, the namespaces the decoder reads, and `draft`."""
        name = str(c["decoder"]["name"])
        if name == SERVER:
            return cls(name=name, server=from_dict(ServerOptions, c.get("server"), "server"))
        if name not in DECODERS:
            raise unknown_decoder(name)
        kind = DECODERS[name]
        hints = {"draft_tree": DraftTreeOptions, "rounds": RoundsOptions, "verify": VerifyOptions, **SECTIONS}
        read: dict[str, Any] = {}
        for f in kind.options:
            namespace = SECTION_OF.get(f, f)
            read[f] = from_dict(hints[f], c.get(namespace), namespace)
        options = {f: v for f, v in read.items() if f not in SECTIONS}
        draft_cfg = c.get("draft") or {}
        draft = None
        if kind.draft_model != "none" and draft_cfg.get("path") not in (None, ""):
            draft = ModelSpec.from_config({k: v for k, v in draft_cfg.items() if v is not None}, "draft")
        if "verify" in options:
            options["verify"] = options["verify"].for_decoder(name)
        sections = {f: v for f, v in read.items() if f in SECTIONS}
        return cls(name=name, draft=draft, options=sections, **options)
