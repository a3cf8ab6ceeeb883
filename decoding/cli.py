"""What every Hydra command of the project shares: one-line errors and early override checks."""

from __future__ import annotations

import logging
import sys
from importlib import resources
from typing import NoReturn

from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue


def quiet_transformers() -> None:
    """Keep a command's output to its own lines: no weight-loading bars or library warnings."""
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()


def fail(message: str) -> NoReturn:
    """Bad input ends with one line naming the value and the fix, and exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_overrides(argv: list[str], config_name: str, groups: tuple[str, ...]) -> None:
    """Name an unknown config group choice or key in one line, before Hydra prints its own long error."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    chosen = {}
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key in groups:
            options = resources.files("conf").joinpath(key).iterdir()
            known = sorted(p.name[:-5] for p in options if p.name.endswith(".yaml"))
            for choice in value.split(","):
                if choice not in known:
                    fail(f"{key}={choice} is unknown; choose one of {', '.join(known)}")
            chosen[key] = value.split(",")[0]
    keys = [a.partition("=")[0] for a in overrides]
    keys = [k for k in keys if k not in groups and not k.startswith(("+", "~", "hydra."))]
    if not keys:
        return
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=[f"{k}={v}" for k, v in chosen.items()])
    for key in keys:
        if not _has_key(cfg, key):
            fail(
                f"{key} is not a config key; see the configuration reference in README.md (or add one with +{key}=...)"
            )


def _has_key(cfg: DictConfig, key: str) -> bool:
    absent = object()
    try:
        return OmegaConf.select(cfg, key, default=absent, throw_on_missing=True) is not absent
    except MissingMandatoryValue:  # a required value (???) not given yet: the key exists
        return True
