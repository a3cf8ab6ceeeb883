"""The drafter and decoder tables, built from the plug-in modules' declarations (`PLUGIN = DrafterPlugin(...)`).

`MODULES` lists the built-in drafters (declared in decoding/drafters/builtin.py, apart from their
implementations, which load torch); `TOT_SPEC_PLUGINS` adds modules (decoding/base/plugins.py). A
listed module without a declaration, or two declaring one drafter, decoder or section, stop the load
with one line naming the module.
"""

from __future__ import annotations

from typing import Any

from decoding.base.errors import ConfigError
from decoding.base.plugins import ENV, Entries, Lazy, table
from decoding.base.plugins import load as load_plugins
from decoding.drafters.plugin import DecoderKind, DrafterPlugin

MODULES = (
    "decoding.drafters.builtin:NONE",  # hf, ar
    "decoding.drafters.builtin:MODEL",  # a draft model: sd, seed
    "decoding.drafters.builtin:PLD",
    "decoding.drafters.builtin:RECYCLING",
    "decoding.drafters.builtin:STAND",  # stand, seed_stand
    "decoding.drafters.builtin:SUFFIX",
    "decoding.drafters.builtin:ADED",
)

__all__ = ["DECODERS", "DRAFTERS", "ENV", "MODULES", "SECTIONS", "check", "load"]


def check(entries: Entries[DrafterPlugin]) -> None:
    """What holds across declarations: one owner per decoder and section, each decoder's drafter declared."""
    owner: dict[tuple[str, str], str] = {}  # (what, name) -> the module that declared it

    def claim(what: str, name: str, module: str) -> None:
        if (what, name) in owner:
            raise ConfigError(f"plug-in module {module}: {what} {name} is already declared by {owner[what, name]}")
        owner[what, name] = module

    for module, plugin in entries.values():
        if plugin.options is not None:
            claim("section", plugin.section, module)
        for kind in plugin.decoders:
            claim("decoder", kind.name, module)
            if kind.drafter not in entries:
                raise ConfigError(
                    f"plug-in module {module}: decoder {kind.name} drafts with {kind.drafter}, no plug-in's name"
                )


def load(extra: tuple[str, ...] = ()) -> dict[str, DrafterPlugin]:
    """The drafters of `MODULES` and `extra`, checked (what the table loads, with extra modules given)."""
    return load_plugins(DrafterPlugin, MODULES, extra, check)


DRAFTERS = table(DrafterPlugin, MODULES, check)
DECODERS: Lazy[DecoderKind] = Lazy(lambda: {k.name: k for p in DRAFTERS.values() for k in p.decoders})
# config section -> the options dataclass a drafter reads from it
SECTIONS: Lazy[type[Any]] = Lazy(lambda: {p.section: p.options for p in DRAFTERS.values() if p.options is not None})
