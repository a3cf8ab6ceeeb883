"""`python -m tot.solve task=gsm8k ...`: run a ToT search over a task's problems (Hydra CLI)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from decoding.cli import check_overrides, fail, quiet_transformers
from decoding.errors import BackendError
from tasks.base import DataError
from tot.config import ConfigError, RunConfig
from tot.run import run, summary_line

USER_ERRORS = (ConfigError, DataError, BackendError)
GROUPS = ("task", "search", "decoder", "model")


@hydra.main(config_path="pkg://conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    quiet_transformers()
    try:
        run_cfg = RunConfig.from_omegaconf(cfg)
        summary = run(run_cfg, Path(HydraConfig.get().runtime.output_dir))
    except USER_ERRORS as e:
        fail(str(e).splitlines()[0])
    print(summary_line(summary))


def cli() -> None:
    check_overrides(sys.argv[1:], "config", GROUPS)
    main()


if __name__ == "__main__":
    cli()
