"""Which decoder to run and with what options, read from the config and checked at load time."""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any

from decoding.core.errors import ConfigError
from decoding.core.models import ModelSpec
from decoding.core.options import from_dict, option_names
from decoding.kinds import DECODERS, ENV, TABLES
from decoding.schedules.base import VerifyOptions
from decoding.schedules.seed import SeedOptions
from decoding.server import NAME as SERVER
from decoding.server import ServerOptions
from decoding.trees.policies import DraftTreeOptions

CHOICES = (*DECODERS, SERVER)  # decoder=...: the in-process decoders, and a server's engine


def unknown_decoder(name: str) -> ConfigError:
    return ConfigError(
        f"decoder={name} is not one of {', '.join(CHOICES)} (a plug-in outside decoding/ is named in {ENV})"
    )


@dataclass(frozen=True)
class ScheduleConfig:
    """The fields of `DecoderConfig` the schedules own; the drafters' sections follow them."""

    name: str = "ar"
    draft_tree: DraftTreeOptions = field(default_factory=DraftTreeOptions)  # from sd.* or seed.*
    seed: SeedOptions = field(default_factory=SeedOptions)
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    draft: ModelSpec | None = None  # path "self" drafts with the target itself
    server: ServerOptions | None = None  # decoder=server: the serving engine to send requests to

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

    @classmethod
    def from_container(cls, c: dict[str, Any]) -> DecoderConfig:
        """From a resolved config: `decoder.name`, the namespaces the decoder reads, and `draft`."""
        name = str(c["decoder"]["name"])
        if name == SERVER:
            return cls(name=name, server=from_dict(ServerOptions, c.get("server"), "server"))
        if name not in DECODERS:
            raise unknown_decoder(name)
        kind = DECODERS[name]
        hints = {"draft_tree": DraftTreeOptions, "seed": SeedOptions, "verify": VerifyOptions, **TABLES.sections}
        options: dict[str, Any] = {}
        for f in kind.options:
            namespace = kind.tree_section if f == "draft_tree" else f
            # `seed:` holds both SEED's schedule options and its draft tree's: each reader skips the other's.
            shared = option_names(SeedOptions if f == "draft_tree" else DraftTreeOptions) if namespace == "seed" else ()
            options[f] = from_dict(hints[f], c.get(namespace), namespace, ignore=shared)
        draft_cfg = c.get("draft") or {}
        draft = None
        if kind.draft_model != "none" and draft_cfg.get("path") not in (None, ""):
            draft = ModelSpec.from_config({k: v for k, v in draft_cfg.items() if v is not None}, "draft")
        if "verify" in options:
            options["verify"] = options["verify"].for_decoder(name)
        return cls(name=name, draft=draft, **options)


DecoderConfig = make_dataclass(
    "DecoderConfig",
    [(section, options, field(default_factory=options)) for section, options in TABLES.sections.items()],
    bases=(ScheduleConfig,),
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": "A decoder (a key of decoding.kinds.DECODERS) and the options of every section it reads: "
        "the schedules' fields, then one field per drafter section (config.stand, config.pld, ...), "
        "made from the plug-in declarations.",
    },
)
