"""`python -m tot.solve task=gsm8k ...`: run a ToT search over a task's problems (Hydra CLI)."""

from __future__ import annotations

import logging
import sys
from importlib import resources
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from decoding.errors import BackendError
from tasks.base import DataError
from tot.config import ConfigError, RunConfig
from tot.run import run, summary_line

USER_ERRORS = (ConfigError, DataError, BackendError)
GROUPS = ("task", "search", "decoder", "model")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_group_choices(argv: list[str]) -> None:
    """Name an unknown config group choice in one line, before Hydra prints its own long error."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key.lstrip("+") not in GROUPS:
            continue
        group = key.lstrip("+")
        known = sorted(
            p.name[:-5] for p in resources.files("conf").joinpath(group).iterdir() if p.name.endswith(".yaml")
        )
        for choice in value.split(","):
            if choice not in known:
                fail(f"{group}={choice} is unknown; choose one of {', '.join(known)}")


@hydra.main(config_path="pkg://conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        run_cfg = RunConfig.from_omegaconf(cfg)
        summary = run(run_cfg, Path(HydraConfig.get().runtime.output_dir))
    except USER_ERRORS as e:
        fail(str(e).splitlines()[0])
    print(summary_line(summary))


def cli() -> None:
    check_group_choices(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
