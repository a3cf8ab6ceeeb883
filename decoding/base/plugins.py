"""One plug-in mechanism for every kind: drafters, searches, tasks, model architectures.

A plug-in is one module that ends with its declaration, `PLUGIN = <Kind>(name=..., build=...,
options=..., section=...)`, where `<Kind>` is a subclass of `Plugin` (DrafterPlugin, SearchPlugin,
TaskPlugin, ArchitecturePlugin); `options` is a frozen dataclass read from the config section
`section`. Each kind's table is a `Table` of its built-in modules; the environment variable
`TOT_SPEC_PLUGINS` adds modules (comma-separated, importable from sys.path), each joining the table of
the kind it declares. An entry "module:NAME" names one of several declarations a module holds, and
`build=Deferred("module:function")` imports a builder on its first call: the built-in drafters are
declared that way (decoding/drafters/builtin.py), apart from their implementations, which load torch.
Tables load on first use, not at import: a plug-in module may import the package whose table lists it
(a search imports `tot.search.plugin`, which imports `decoding`).

A listed module that cannot be imported or declares nothing, a built-in module declaring another
kind, and two modules claiming one name stop the load with one line naming the module.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, is_dataclass
from typing import Any, ClassVar, Generic, TypeVar

from decoding.base.errors import ConfigError

ENV = "TOT_SPEC_PLUGINS"


@dataclass(frozen=True)
class Plugin:
    """What every plug-in declares; each kind's subclass says what `build` receives and returns."""

    KIND: ClassVar[str] = "plug-in"  # the kind's name in messages: drafter, search, task, architecture

    name: str
    build: Callable[..., Any]
    options: type[Any] | None = None  # a frozen dataclass of its options, read from `section`
    section: str = ""  # its config section; kinds that share one (search, task) name it themselves

    def check(self, module: str) -> None:
        """What every declaration must hold; kinds add their own rules."""
        if self.options is not None and not is_dataclass(self.options):
            raise ConfigError(f"plug-in module {module}: PLUGIN's options {self.options!r} is not a dataclass")


@dataclass(frozen=True)
class Deferred:
    """A builder named "module:function", imported on its first call. A declaration whose builder
    needs torch (seconds of imports) then loads none of it: a table read only to check options or
    list names stays light, and the command stops at a bad option in about a second."""

    target: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)


P = TypeVar("P", bound=Plugin)
V = TypeVar("V")
Entries = dict[str, tuple[str, P]]  # name -> (the declaring module, its declaration)


def extra_modules(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    return tuple(m.strip() for m in environ.get(ENV, "").split(",") if m.strip())


def declaration(entry: str) -> Plugin:
    """The declaration a table entry names: a module's `PLUGIN`, or with "module:NAME" its `NAME`."""
    module, _, name = entry.partition(":")
    try:
        plugin = getattr(importlib.import_module(module), name or "PLUGIN", None)
    except Exception as e:  # a module that raises anything on import is one line, as a missing one is
        said = (str(e).strip().splitlines() or [""])[0][:200]
        kind = "" if isinstance(e, ImportError) else f"{type(e).__name__}: "
        raise ConfigError(
            f"plug-in module {module} cannot be imported ({kind}{said}); fix the module or take it out of {ENV}"
        ) from None
    if not isinstance(plugin, Plugin):
        raise ConfigError(f"plug-in module {module} declares no {name or 'PLUGIN'} = <Kind>Plugin(name=..., build=...)")
    plugin.check(module)
    return plugin


def declared(kind: type[P], builtin: tuple[str, ...], extra: tuple[str, ...] = ()) -> Entries[P]:
    """Every `kind` plug-in of the modules: each built-in module must declare one; an extra module
    joins if it does (it may declare another kind, for another table)."""
    entries: Entries[P] = {}
    for module in (*builtin, *extra):
        plugin = declaration(module)
        if not isinstance(plugin, kind):
            if module in builtin:
                raise ConfigError(f"plug-in module {module} declares a {plugin.KIND}, not a {kind.KIND}")
            continue
        if plugin.name in entries:
            raise ConfigError(
                f"plug-in module {module}: {kind.KIND} {plugin.name} is already declared by {entries[plugin.name][0]}"
            )
        entries[plugin.name] = (module, plugin)
    return entries


class Lazy(Mapping[str, V], Generic[V]):
    """A table loaded on first use (see the module's doc for why not at import)."""

    def __init__(self, load: Callable[[], dict[str, V]]) -> None:
        self._load = load
        self._table: dict[str, V] | None = None

    def _get(self) -> dict[str, V]:
        if self._table is None:
            self._table = self._load()
        return self._table

    def __getitem__(self, name: str) -> V:
        return self._get()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def table(
    kind: type[P],
    builtin: tuple[str, ...],
    check: Callable[[Entries[P]], None] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Lazy[P]:
    """name -> declaration of every `kind` plug-in: the built-in modules' and TOT_SPEC_PLUGINS', loaded
    on first use."""
    return Lazy(lambda: load(kind, builtin, extra_modules(environ), check))


def load(
    kind: type[P],
    builtin: tuple[str, ...],
    extra: tuple[str, ...] = (),
    check: Callable[[Entries[P]], None] | None = None,
) -> dict[str, P]:
    """name -> declaration of the modules' `kind` plug-ins; `check` sees them all first (rules across
    declarations)."""
    entries = declared(kind, builtin, extra)
    if check is not None:
        check(entries)
    return {name: plugin for name, (_, plugin) in entries.items()}


def unknown(what: str, name: str, names: Iterable[str]) -> ConfigError:
    """The error for a name no plug-in declares."""
    return ConfigError(
        f"{what}={name} is not one of {', '.join(names)} (a plug-in outside the project is named in {ENV})"
    )
