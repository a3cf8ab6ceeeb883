"""`python -m tot.solve task=gsm8k ...`: run a ToT search over a task's problems (Hydra CLI)."""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from decoding.cli import fail, hydra_command
from decoding.core.errors import BackendError, OutputError
from tasks.base import DataError
from tot.config import ConfigError, RunConfig
from tot.run import run, summary_line

USER_ERRORS = (ConfigError, DataError, BackendError, OutputError)
GROUPS = ("task", "search", "decoder", "model")


@hydra_command("config", groups=("task", "search", "decoder", "model"))
def main(cfg: DictConfig) -> None:
    try:
        run_cfg = RunConfig.from_omegaconf(cfg)
        summary = run(run_cfg, Path(HydraConfig.get().runtime.output_dir))
    except USER_ERRORS as e:
        fail(str(e).splitlines()[0])
    print(summary_line(summary))


if __name__ == "__main__":
    main()
