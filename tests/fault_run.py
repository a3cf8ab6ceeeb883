"""`python tests/fault_run.py ERRNO PATTERN NTH MODULE ARGS...`: run `python -m MODULE ARGS...` with one
write failure injected at the project's writer (tot.output.open_for_write), which works as root and
without mount rights, where chmod and small filesystems do not.

The NTH file opened for writing whose name matches PATTERN (fnmatch) fails with ERRNO: ENOSPC once
half of the first write is on disk (a disk that fills mid-line), any other errno at the open (a
permission refused).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import runpy
import sys
from pathlib import Path
from typing import IO

import tot.output


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


def main() -> None:
    name, pattern, nth, module, *args = sys.argv[1:]
    code = getattr(errno, name)
    real = tot.output.open_for_write
    seen = [0]

    def open_for_write(path: Path, mode: str):
        if fnmatch.fnmatch(path.name, pattern):
            seen[0] += 1
            if seen[0] == int(nth):
                if code == errno.ENOSPC:
                    return FillingFile(real(path, mode), path)
                raise OSError(code, os.strerror(code), str(path))
        return real(path, mode)

    tot.output.open_for_write = open_for_write
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
