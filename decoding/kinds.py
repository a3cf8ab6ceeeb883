"""The plug-in tables, built by importing the plug-in modules: each declares `PLUGIN = DrafterPlugin(...)`.

`MODULES` lists the built-in drafters; the environment variable `TOT_SPEC_PLUGINS` adds modules
(comma-separated, importable from sys.path) before the tables are built. A listed module without a
declaration, or two declaring one name, stop the import with one line naming the module.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from decoding.core.errors import ConfigError
from decoding.drafters.plugin import DecoderKind, DrafterPlugin

MODULES = (
    "decoding.drafters.base",  # none: hf, ar
    "decoding.drafters.draft_model",  # model: sd, seed
    "decoding.drafters.pld",
    "decoding.drafters.recycling",
    "decoding.drafters.stand",  # stand, seed_stand
    "decoding.drafters.suffix",
    "decoding.drafters.aded",
)
ENV = "TOT_SPEC_PLUGINS"
# Config sections the schedules and the engine own: no drafter may read its options from them.
RESERVED = frozenset({"name", "draft_tree", "seed", "sd", "verify", "draft", "server", "decoder", "model"})


@dataclass(frozen=True)
class Tables:
    drafters: dict[str, DrafterPlugin]
    decoders: dict[str, DecoderKind]
    sections: dict[str, type]  # config section -> the options dataclass a drafter reads from it


def plugin_modules(environ: dict[str, str] | os._Environ = os.environ) -> tuple[str, ...]:
    extra = [m.strip() for m in environ.get(ENV, "").split(",") if m.strip()]
    return (*MODULES, *extra)


def declaration(module: str) -> DrafterPlugin:
    try:
        plugin = getattr(importlib.import_module(module), "PLUGIN", None)
    except ImportError as e:
        raise ConfigError(f"plug-in module {module} cannot be imported: {e}") from None
    if not isinstance(plugin, DrafterPlugin):
        raise ConfigError(f"plug-in module {module} declares no PLUGIN = DrafterPlugin(name=..., build=...)")
    if (plugin.options is None) != (plugin.section == ""):
        raise ConfigError(f"plug-in module {module}: PLUGIN declares options without a section, or a section alone")
    if plugin.section in RESERVED:
        raise ConfigError(f"plug-in module {module}: section {plugin.section} belongs to the schedules")
    return plugin


def build_tables(modules: tuple[str, ...]) -> Tables:
    tables = Tables({}, {}, {})
    owner: dict[tuple[str, str], str] = {}  # (what, name) -> the module that declared it

    def claim(what: str, name: str, module: str) -> None:
        if (what, name) in owner:
            raise ConfigError(f"plug-in module {module}: {what} {name} is already declared by {owner[what, name]}")
        owner[what, name] = module

    for module in modules:
        plugin = declaration(module)
        claim("drafter", plugin.name, module)
        tables.drafters[plugin.name] = plugin
        if plugin.options is not None:
            claim("section", plugin.section, module)
            tables.sections[plugin.section] = plugin.options
        for kind in plugin.decoders:
            claim("decoder", kind.name, module)
            tables.decoders[kind.name] = kind
    for kind in tables.decoders.values():
        if kind.drafter not in tables.drafters:
            module = owner["decoder", kind.name]
            raise ConfigError(
                f"plug-in module {module}: decoder {kind.name} drafts with {kind.drafter}, no plug-in's name"
            )
    return tables


TABLES = build_tables(plugin_modules())
DRAFTERS = TABLES.drafters
DECODERS = TABLES.decoders
