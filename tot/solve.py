"""`python -m tot.solve task=gsm8k ...`: run a ToT search over a task's problems (Hydra CLI)."""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from decoding import BackendError, ConfigError, OutputError
from decoding.base.cli import Refused, fail, hydra_command
from tasks.base import DataError
from tot.runs.results import ResultsError

USER_ERRORS = (ConfigError, DataError, BackendError, OutputError, ResultsError)
GROUPS = ("task", "search", "decoder", "model")


def check_run(cfg: DictConfig, run_dir: Path) -> None:
    """Before Hydra writes into the run folder: the config, the data and what the folder holds
    (its configuration, its results) checked, so a refused run (or sweep member) leaves every file as it was."""
    # Imported here, and the runtime (torch, transformers: seconds) only once the options hold: an option
    # that is no config key stops at Hydra's check, a bad value at RunConfig's, each in about a second.
    from tot.runs.config import RunConfig

    try:
        run_cfg = RunConfig.from_omegaconf(cfg)
    except USER_ERRORS as e:
        raise Refused(str(e).splitlines()[0]) from None
    from tot.runs.run import build_task, open_run

    try:
        build_task(run_cfg).load(run_cfg.data)
        open_run(run_cfg, run_dir)
    except USER_ERRORS as e:
        raise Refused(str(e).splitlines()[0]) from None


@hydra_command("solve", groups=GROUPS, before=check_run)
def main(cfg: DictConfig) -> None:
    from tot.runs.config import RunConfig
    from tot.runs.run import run, summary_line

    try:
        run_cfg = RunConfig.from_omegaconf(cfg)
        summary = run(run_cfg, Path(HydraConfig.get().runtime.output_dir))
    except USER_ERRORS as e:
        fail(str(e).splitlines()[0])
    print(summary_line(summary))


if __name__ == "__main__":
    main()
