"""What every Hydra command of the project shares: one-line errors and early override checks."""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable
from importlib import resources
from typing import NoReturn

import hydra
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

# Config keys renamed on 2026-11-23 (issue 15): an old key gets one line naming the new one.
RENAMED = {
    "stand.seed_prompt": "stand.prime_with_prompt",
    "aded.seed_prompt": "aded.prime_with_prompt",
    **{f"sequoia.{k}": f"calibrate.{k}" for k in ("drafter", "calibration", "profile", "tree_sizes", "context")},
    **{f"sequoia.{k}": f"calibrate.{k}" for k in ("repeats", "batch", "max_budget", "max_depth", "out")},
    "sequoia.from_counts": "calibrate.from_counts",
    "optimize.nodes": "calibrate.nodes",
    "optimize.out": "calibrate.out",
    "optimize.from_hits": "calibrate.from_counts",
    "model.dtype": "model.weights",
    "draft.dtype": "draft.weights",
}

# hydra/launcher choices -> (their plugin module under hydra_plugins, the extra that installs it);
# slurm and ray_cluster are the project's presets (conf/hydra/launcher).
LAUNCHERS = {
    "joblib": ("hydra_joblib_launcher", "sweeps"),
    "submitit_local": ("hydra_submitit_launcher", "slurm"),
    "submitit_slurm": ("hydra_submitit_launcher", "slurm"),
    "slurm": ("hydra_submitit_launcher", "slurm"),
    "ray": ("hydra_ray_launcher", "ray"),
    "ray_cluster": ("hydra_ray_launcher", "ray"),
}


def quiet_libraries() -> None:
    """Keep a command's output to its own lines: no weight-loading bars or library warnings."""
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    for name in ("httpx", "httpx2", "openai"):  # decoder=server: not a log line per request
        logging.getLogger(name).setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()


def fail(message: str) -> NoReturn:
    """Bad input ends with one line naming the value and the fix, and exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def hydra_command(
    config_name: str, groups: tuple[str, ...] = ()
) -> Callable[[Callable[[DictConfig], None]], Callable[[], None]]:
    """The one way a command starts: its overrides checked (one line naming a bad key or group
    choice, exit 2, before Hydra's long errors), library chatter off, then Hydra with
    conf/<config_name>.yaml. `groups` are the config groups the command's overrides may choose."""

    def wrap(body: Callable[[DictConfig], None]) -> Callable[[], None]:
        run = hydra.main(config_path="pkg://conf", config_name=config_name, version_base="1.3")(body)

        def command() -> None:
            check_overrides(sys.argv[1:], config_name, groups)
            quiet_libraries()
            run()

        command.__doc__ = body.__doc__
        return command

    return wrap


def check_overrides(argv: list[str], config_name: str, groups: tuple[str, ...]) -> None:
    """Name an unknown config group choice or key in one line, before Hydra prints its own long error."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key == "hydra/launcher" and value in LAUNCHERS:
            plugin, extra = LAUNCHERS[value]
            if not _installed(f"hydra_plugins.{plugin}"):
                fail(f"hydra/launcher={value} needs Hydra's launcher plugin: pip install 'tot-spec[{extra}]'")
    chosen: dict[str, list[str]] = {}
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key in groups:
            options = resources.files("conf").joinpath(key).iterdir()
            known = sorted(p.name[:-5] for p in options if p.name.endswith(".yaml"))
            for choice in value.split(","):
                if choice not in known:
                    fail(f"{key}={choice} is unknown; choose one of {', '.join(known)}")
            chosen[key] = value.split(",")
    keys = [a.partition("=")[0] for a in overrides]
    keys = [k for k in keys if k not in groups and not k.startswith(("+", "~", "hydra.", "hydra/"))]
    for key in keys:
        if key in RENAMED:
            fail(f"{key} was renamed {RENAMED[key]}; use {RENAMED[key]}=...")
    if not keys:
        return
    # A sweep over a group (task=gsm8k,blocksworld) may set keys that only some of its choices have.
    first = {k: v[0] for k, v in chosen.items()}
    variants = [first] + [{**first, k: c} for k, v in chosen.items() for c in v[1:]]
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfgs = [compose(config_name=config_name, overrides=[f"{k}={v}" for k, v in o.items()]) for o in variants]
    for key in keys:
        if not any(_has_key(cfg, key) for cfg in cfgs):
            fail(f"{key} is not a config key; see docs/configuration.md (or add one with +{key}=...)")


def _installed(module: str) -> bool:
    try:  # hydra_plugins itself exists only once some plugin is installed
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _has_key(cfg: DictConfig, key: str) -> bool:
    absent = object()
    try:
        return OmegaConf.select(cfg, key, default=absent, throw_on_missing=True) is not absent
    except MissingMandatoryValue:  # a required value (???) not given yet: the key exists
        return True
