"""`python tests/fault_run.py ERRNO PATTERN NTH [ERRNO PATTERN NTH ...] MODULE ARGS...`: run
`python -m MODULE ARGS...` with write failures injected at the project's writer (tot.runs.output.open_for_write)
and at the opening of log files (logging.FileHandler), which works as root and without mount rights,
where chmod and small filesystems do not.

For each ERRNO PATTERN NTH, the NTH file opened for writing whose name matches PATTERN (fnmatch)
fails with ERRNO: ENOSPC once half of a write is on disk (a disk that fills mid-line), any other
errno at the open (a permission refused).
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import runpy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import tot.runs.output


class FillingFile:
    """A file whose first write stops halfway with ENOSPC, as a disk that fills does."""

    def __init__(self, f: IO[str], path: Path) -> None:
        self.f, self.path = f, path

    def write(self, text: str) -> int:
        self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    def __enter__(self) -> FillingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def close(self) -> None:
        self.f.close()


@dataclass
class Fault:
    code: int  # an errno
    pattern: str  # fnmatch, on the file's name
    nth: int  # the matching open that fails
    seen: int = 0

    def hits(self, path: Path) -> bool:
        if not fnmatch.fnmatch(path.name, self.pattern):
            return False
        self.seen += 1
        return self.seen == self.nth


def opened(path: Path, faults: list[Fault], open_file: Callable[[], IO[str]]) -> IO[str]:
    """The file `open_file` opens at `path`, or the failure of the first fault it hits."""
    hit = [f for f in faults if f.hits(path)]  # every fault counts every open of its files
    if not hit:
        return open_file()
    if hit[0].code == errno.ENOSPC:
        return FillingFile(open_file(), path)  # type: ignore[return-value]
    raise OSError(hit[0].code, os.strerror(hit[0].code), str(path))


def main() -> None:
    args = sys.argv[1:]
    faults = []
    while hasattr(errno, args[0]):
        faults.append(Fault(getattr(errno, args[0]), args[1], int(args[2])))
        args = args[3:]
    module, *rest = args
    real, real_log = tot.runs.output.open_for_write, logging.FileHandler._open

    def open_for_write(path: Path, mode: str) -> IO[str]:
        return opened(path, faults, lambda: real(path, mode))

    def open_log(handler: logging.FileHandler) -> IO[str]:
        return opened(Path(handler.baseFilename), faults, lambda: real_log(handler))

    tot.runs.output.open_for_write = open_for_write
    logging.FileHandler._open = open_log  # type: ignore[method-assign]
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
