"""What every Hydra command of the project shares: one-line errors, early override checks, run folders
checked before Hydra writes into them (a single run's and each sweep member's), and a job log that
cannot print tracebacks."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn, cast

import hydra
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
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


class Refused(Exception):
    """A command's folder check (`hydra_command(before=...)`) saying no: one line, the reason and the fix."""


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised wherever the program is, as Ctrl-C raises KeyboardInterrupt: the same cleanup
    runs (a record cut mid-append is trimmed, the folder's lock let go)."""


# The exit status of a command a signal stopped: 128 + the signal's number, as a shell reports it.
STOPPED_STATUS = {"SIGINT": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}
# Hydra's flags that print or read something else than the config a run gets: no folder is checked.
ONLY_THESE_FLAGS = ("-m", "--multirun")
SAFE_PATH = re.compile(r"[\w./+-]+")  # a path that goes into an override as it is
HYDRA_FILES = ".hydra"  # where Hydra keeps a job's config (hydra.output_subdir's default)
REFUSALS = ".refused"  # in a sweep's folder: one record per member refused (members may run on other machines)
# A sweep of a command with a folder check: Hydra itself writes nothing into a member's folder before
# the member has checked it (checked_member writes .hydra/; the job log is made at its first line),
# and the sweep ends naming the members refused (RefusedMembers).
CHECKED_SWEEP = (
    "hydra.output_subdir=null",
    "+hydra.callbacks.refused_members._target_=decoding.base.cli.RefusedMembers",
)


def _stop(signum: int, frame: object) -> None:
    # The processes this one started end with it: a kernel build's compilers (torch kills only the
    # `ninja` it ran, which leaves its compilers orphaned, writing into the build folder), pip.
    end_descendants()
    raise Stopped(signum)


def _after_name(stat: str) -> list[str]:
    """A /proc/PID/stat's fields from the state on: the command's name before them sits in parentheses
    and may hold anything, so they follow the last ')'."""
    return stat[stat.rfind(")") + 2 :].split()


def descendants(pid: int) -> list[int]:
    """The processes started under `pid`, at any depth, parents before their children (Linux's /proc;
    elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended while we looked
            continue
        parent = int(_after_name(text)[1])
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        below = children.get(queue.pop(0), [])
        found += below
        queue += below
    return found


def _wait_stopped(pids: list[int], timeout_s: float = 0.5) -> None:
    """Until each of `pids` is stopped, a zombie or gone (its state in /proc), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                text = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                break
            if _after_name(text)[0] in "TtZX":
                break
            time.sleep(0.001)


def end_descendants(sig: int = signal.SIGTERM) -> None:
    """Send `sig` to every process started under this one. They are stopped first, scanning until a
    scan finds none new: a parent signalled while its children are still being listed (ninja, killed
    by torch right after) may start a compiler that no scan sees, left orphaned and running."""
    stopped: list[int] = []
    while new := [pid for pid in descendants(os.getpid()) if pid not in stopped]:
        for pid in new:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        _wait_stopped(new)  # a signal is taken moments after it is sent: a fork may come between
        stopped += new
    for resume in (sig, signal.SIGCONT):  # a stopped process takes `sig` when it resumes
        for pid in stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, resume)


@contextlib.contextmanager
def stopped_by_signals(what_is_kept: str) -> Iterator[None]:
    """SIGTERM raised as `Stopped` wherever the body is, so that its cleanup runs as for Ctrl-C
    (temporary files removed, child processes ended); either signal then ends the command with one
    line and exit status 130 / 143."""
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        yield
    except KeyboardInterrupt as e:
        name = "SIGTERM" if isinstance(e, Stopped) else "SIGINT"
        print(f"error: stopped by {name}; {what_is_kept}", file=sys.stderr)
        sys.exit(STOPPED_STATUS[name])
    finally:
        signal.signal(signal.SIGTERM, previous)


def hydra_command(
    config_name: str,
    groups: tuple[str, ...] = (),
    before: Callable[[DictConfig, Path], None] | None = None,
) -> Callable[[Callable[[DictConfig], None]], Callable[[], None]]:
    """The one way a command starts: its overrides checked (one line naming a bad key or group
    choice, exit 2, before Hydra's long errors), its output folder resolved and checked (one line
    where it cannot be made or written) and `before(config, folder)` run before Hydra writes anything
    there (raising Refused to say no), library chatter off, then Hydra with conf/<config_name>.yaml.
    In a sweep (-m), `before` checks each member's folder in the member's own process, before anything
    is written there; a refused member is left as it was, the others run, and the sweep ends with one
    line naming the refused and exit status 2. `groups` are the config groups the command's overrides
    may choose. SIGINT and SIGTERM end the command with one line and exit status 130 / 143, after the
    cleanup an exception gets."""

    def wrap(body: Callable[[DictConfig], None]) -> Callable[[], None]:
        task = body if before is None else checked_member(body, before)
        run = hydra.main(config_path="pkg://conf", config_name=config_name, version_base="1.3")(task)

        def command() -> None:
            with stopped_by_signals("what finished is kept: rerun the same command to go on"):
                argv = sys.argv[1:]
                check_overrides(argv, config_name, groups)
                pin = prepare_folder(argv, config_name, before)
                if pin:
                    sys.argv.append(pin)
                if before is not None and checks_folders(argv) and multirun(argv):
                    sys.argv += CHECKED_SWEEP
                quiet_libraries()
                run()

        command.__doc__ = body.__doc__
        return command

    return wrap


def prepare_folder(argv: list[str], config_name: str, before: Callable[[DictConfig, Path], None] | None) -> str:
    """Resolve the folder Hydra will write (hydra.run.dir, or hydra.sweep.dir for -m), check it can be
    made and written, and run `before` on a single run's config and folder. Returns the override that
    pins the folder (a ${now:...} in it resolves again when Hydra starts), or ""."""
    if not checks_folders(argv):
        return ""  # --help, --cfg, -cn...: Hydra prints or composes something else
    key = "hydra.sweep.dir" if multirun(argv) else "hydra.run.dir"
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    if multirun(argv):  # a sweep's values are not one config: only what names its folder
        overrides = [a for a in overrides if a.startswith("hydra.") and "," not in a]
    try:
        with initialize_config_module(config_module="conf", version_base="1.3", job_name=Path(sys.argv[0]).stem):
            cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
        folder = Path(str(OmegaConf.select(cfg, key)))
    except Exception:  # a folder named from what only Hydra's run knows: Hydra checks it itself
        return ""
    check_folder(folder, key)
    if before is not None and not multirun(argv):  # a sweep member's folder: checked_member
        body = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])
        try:
            before(body, folder)
        except Refused as e:
            fail(str(e))
    given = any(a.startswith(f"{key}=") for a in argv)
    return f"{key}={folder}" if not given and SAFE_PATH.fullmatch(str(folder)) else ""


def checks_folders(argv: list[str]) -> bool:
    """Whether the command runs (a run or a sweep), rather than print or compose something else."""
    return not any(a.startswith("-") and a not in ONLY_THESE_FLAGS for a in argv)


def multirun(argv: list[str]) -> bool:
    return any(a in ONLY_THESE_FLAGS for a in argv)


def check_folder(path: Path, key: str) -> None:
    """The folder `key` names, made if need be and written to once (a file made and removed), or one
    line saying why it cannot be."""
    existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():
        what = "a file" if existing.is_file() else "not a folder"
        fail(f"{key}={path}: {existing} is {what}, where a folder should be; give another folder with {key}=...")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        fail(f"{key}={path} cannot be written ({e.strerror or e}); give a writable folder with {key}=...")


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
    searchpath = [a for a in overrides if a.startswith("hydra.searchpath=")]
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key in groups:
            known = group_choices(key, searchpath)
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
        cfgs = [
            compose(config_name=config_name, overrides=[*searchpath, *(f"{k}={v}" for k, v in o.items())])
            for o in variants
        ]
    for key in keys:
        if not any(_has_key(cfg, key) for cfg in cfgs):
            fail(f"{key} is not a config key; see docs/configuration.md (or add one with +{key}=...)")


def group_choices(group: str, searchpath: list[str]) -> list[str]:
    """The yamls of a config group in conf/ and in the folders `hydra.searchpath=[file://DIR,...]` adds
    (where a plug-in's decoder yaml lives: docs/decoding.md)."""
    folders = [resources.files("conf").joinpath(group)]
    for arg in searchpath:
        for entry in arg.partition("=")[2].strip("[]").split(","):
            if entry.strip().startswith("file://"):
                folders.append(Path(entry.strip().removeprefix("file://")) / group)
    return sorted({p.name[:-5] for f in folders if f.is_dir() for p in f.iterdir() if p.name.endswith(".yaml")})


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


# A sweep's members. Hydra writes a job's .hydra/ files before it calls the task, and before any
# callback's on_job_start (hydra.core.utils.run_job), in whichever process the launcher runs the job.
# So under CHECKED_SWEEP Hydra writes none, and the task itself checks the folder, then writes them.


@dataclass(frozen=True)
class RefusedMember:
    num: int  # hydra.job.num
    overrides: list[str]  # the member's own overrides (hydra.overrides.task)
    reason: str

    def name(self, swept: set[str]) -> str:
        """#num, with the member's values of the keys the sweep varies."""
        values = " ".join(o for o in self.overrides if o.partition("=")[0].lstrip("+~") in swept)
        return f"#{self.num} ({values})" if values else f"#{self.num}"


def checked_member(
    body: Callable[[DictConfig], None], before: Callable[[DictConfig, Path], None]
) -> Callable[[DictConfig], None]:
    """The task Hydra runs: for a sweep member, its folder checked by `before` first; refused, the folder
    is left as it was, else Hydra's .hydra/ files are written and `body` runs. (A single run's folder
    was checked before Hydra started: prepare_folder.)"""

    @functools.wraps(body)  # Hydra unwraps it to name the job (the log file) after the command
    def task(cfg: DictConfig) -> None:
        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return body(cfg)
        hydra_cfg = HydraConfig.get()
        folder = Path(hydra_cfg.runtime.output_dir)
        try:
            before(cfg, folder)
        except Refused as e:
            refuse(RefusedMember(hydra_cfg.job.num, list(hydra_cfg.overrides.task), str(e)), folder)
            return None
        save_hydra_files(cfg, folder / HYDRA_FILES)
        return body(cfg)

    return task


def save_hydra_files(cfg: DictConfig, out: Path) -> None:
    """The files Hydra writes for a job (hydra.core.utils.run_job), as it writes them."""
    hydra_cfg = cast(DictConfig, HydraConfig.instance().cfg)  # typed HydraConf, it holds {"hydra": ...}
    assert hydra_cfg is not None
    out.mkdir(parents=True, exist_ok=True)
    files = {"config.yaml": cfg, "hydra.yaml": hydra_cfg, "overrides.yaml": hydra_cfg.hydra.overrides.task}
    for name, node in files.items():
        OmegaConf.save(node, out / name)


def refuse(member: RefusedMember, folder: Path) -> None:
    """One line now, and the member's record in the sweep's folder for the sweep's end."""
    let_go_of_logs(folder)
    print(f"error: sweep member #{member.num} refused: {member.reason}", file=sys.stderr)
    records = Path(HydraConfig.get().sweep.dir).absolute() / REFUSALS
    records.mkdir(parents=True, exist_ok=True)
    (records / f"{member.num}.json").write_text(json.dumps(asdict(member)) + "\n", encoding="utf-8")


def let_go_of_logs(folder: Path) -> None:
    """Close the job log Hydra opened in `folder` (not made yet: it is made at its first line), so that
    no later line (the launcher's, about the next member) makes it there."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(folder):
            root.removeHandler(handler)
            handler.close()


class RefusedMembers(Callback):
    """A checked sweep's start and end, in the process that launched it: an earlier sweep's records in
    the same folder cleared; the members refused named in one line, exit status 2."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        shutil.rmtree(Path(config.hydra.sweep.dir) / REFUSALS, ignore_errors=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        records = Path(config.hydra.sweep.dir) / REFUSALS
        refused = sorted(
            (RefusedMember(**json.loads(p.read_text(encoding="utf-8"))) for p in records.glob("*.json")),
            key=lambda m: m.num,
        )
        if not refused:
            return
        parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
        swept = {o.key_or_group for o in parsed if o.is_sweep_override()}
        # The reasons again: a member's own line may be in a cluster job's log, or not printed yet (Ray).
        by_reason: dict[str, list[str]] = {}
        for member in refused:
            by_reason.setdefault(member.reason, []).append(member.name(swept))
        named = "; ".join(f"{', '.join(names)} because {reason}" for reason, names in by_reason.items())
        fail(f"sweep members refused, their folders left as they were (the others ran): {named}")


class LogFile(logging.FileHandler):
    """A job's log file that cannot print tracebacks: a line it cannot write (a full disk) is reported
    once, in one line, and the run goes on (to its own error, where its own writes fail too)."""

    reported = False  # set on the handler at its first line that fails

    def handleError(self, record: logging.LogRecord) -> None:
        if self.reported:
            return
        self.reported = True
        error = sys.exc_info()[1]
        why = (error.strerror if isinstance(error, OSError) else None) or str(error) or type(error).__name__
        line = f"warning: the log {self.baseFilename} cannot be written ({why}); the run goes on without it"
        print(line, file=sys.stderr)
