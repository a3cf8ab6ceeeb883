"""One way to read an options dataclass from a config namespace, checked by its field annotations.

Every options dataclass of the backend (a drafter's, a schedule's, a model's) is read by
`from_dict`: a value of the wrong type, or a key the dataclass does not have, ends in one
`ConfigError` line that names the full key (`stand.capacity=...`) and what to give instead. The
dataclass's own `__post_init__` then checks what types cannot say (ranges, combinations).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from decoding.base.errors import ConfigError

T = TypeVar("T")
INTERNAL = ("key",)  # fields that name the namespace, never read from the config


def as_bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")
    return value


def as_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} is not an integer")
    return value


def held_text(key: str, value: object) -> str:
    """A GSM8K jsonl file (question and answer per line) that exists: the held text tools read."""
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key}={path} does not exist; give a GSM8K jsonl file (question, answer per line)")
    return str(path)


def held_rows(path: str) -> list[dict[str, Any]]:
    """The held texts' rows; a line that is not a JSON object with a question and an answer is refused."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or not {"question", "answer"} <= row.keys():
                raise ConfigError(f"data={path} line {n} is not a JSON object with question and answer (GSM8K jsonl)")
            rows.append(row)
    return rows


def as_float(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r} is not a number")
    # nan passes every range check (each comparison is false) and inf overflows later: both refused
    # here, as is an integer too large for a float.
    number = float(value) if isinstance(value, float) or abs(value) < 2**1023 else math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{key}={value} is not a finite number; give a finite one")
    return number


def as_list(key: str, value: object, example: str = "[1,2,3]") -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}={value!r} must be a list such as {example}")
    return list(value)


def convert(key: str, value: object, annotation: Any) -> Any:
    """`value` as the type `annotation` names (a field's type hint), or a ConfigError naming `key`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and value in (None, ""):  # an empty value means "not set"
            return None
        inner = [a for a in args if a is not type(None)]
        return convert(key, value, inner[0]) if len(inner) == 1 else value
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        return tuple(convert(key, v, args[0]) for v in as_list(key, value))
    if annotation is bool:
        return as_bool(key, value)
    if annotation is int:
        return as_int(key, value)
    if annotation is float:
        return as_float(key, value)
    if annotation is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{key}={value!r} must be a single value")
        return value if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    return value


def option_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name not in INTERNAL]


def from_dict(cls: type[T], values: Mapping[str, Any] | None, key: str, ignore: Iterable[str] = ()) -> T:
    """`cls` from the config namespace `key` (its `values`); keys in `ignore` belong to another
    reader of the same namespace (`seed:` holds both the schedule's and the draft tree's options)."""
    hints = typing.get_type_hints(cls)
    known = option_names(cls)
    skip = set(ignore)
    given: dict[str, Any] = {}
    for name, value in (values or {}).items():
        if name in skip:
            continue
        if name not in known:
            raise ConfigError(f"{key}.{name} is not an option of {key} (options: {', '.join(known)})")
        given[name] = convert(f"{key}.{name}", value, hints[name])
    if "key" in hints:
        given["key"] = key
    return cls(**given)
