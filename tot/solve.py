"""`python -m tot.solve task=gsm8k ...`: run a ToT search over a task's problems (Hydra CLI)."""

from __future__ import annotations

import logging
import sys
from importlib import resources
from pathlib import Path

import hydra
import transformers
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from decoding.errors import BackendError
from tasks.base import DataError
from tot.config import ConfigError, RunConfig
from tot.run import run, summary_line

USER_ERRORS = (ConfigError, DataError, BackendError)
GROUPS = ("task", "search", "decoder", "model")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_overrides(argv: list[str]) -> None:
    """Name an unknown config group choice or key in one line, before Hydra prints its own long error."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    chosen = {}
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key in GROUPS:
            options = resources.files("conf").joinpath(key).iterdir()
            known = sorted(p.name[:-5] for p in options if p.name.endswith(".yaml"))
            for choice in value.split(","):
                if choice not in known:
                    fail(f"{key}={choice} is unknown; choose one of {', '.join(known)}")
            chosen[key] = value.split(",")[0]
    keys = [a.partition("=")[0] for a in overrides]
    keys = [k for k in keys if k not in GROUPS and not k.startswith(("+", "~", "hydra."))]
    if not keys:
        return
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"{k}={v}" for k, v in chosen.items()])
    missing = object()
    for key in keys:
        if OmegaConf.select(cfg, key, default=missing) is missing:
            fail(
                f"{key} is not a config key; see the configuration reference in README.md (or add one with +{key}=...)"
            )


@hydra.main(config_path="pkg://conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    try:
        run_cfg = RunConfig.from_omegaconf(cfg)
        summary = run(run_cfg, Path(HydraConfig.get().runtime.output_dir))
    except USER_ERRORS as e:
        fail(str(e).splitlines()[0])
    print(summary_line(summary))


def cli() -> None:
    check_overrides(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
