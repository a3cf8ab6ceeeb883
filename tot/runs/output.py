"""Every file a run writes goes through here, so a write that fails is one line naming the path and
the fix (decoding.base.errors.OutputError), never a half-written file.

`write_atomic` writes through a temporary file and renames it (a reader never sees half a file, and
the temporary file is removed if the write fails); `append_line` appends one line and, if the write
fails, cuts the file back to where it was, so every line in it is whole.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from types import ModuleType
from typing import IO, Any

from decoding import OutputError

RESUME = "rerun the same command: what finished is kept and the run resumes"


def output_error(path: Path, error: OSError) -> OutputError:
    """One line for a failed write: what went wrong at `path`, and what to do about it."""
    code = error.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(
            f"no space left on the device writing {path}; free space there (or give this run a folder "
            f"on another disk with hydra.run.dir=...), then {RESUME}"
        )
    if code in (errno.EACCES, errno.EPERM):
        return OutputError(
            f"permission denied writing {path}; make {path.parent} writable (or give this run another "
            f"folder with hydra.run.dir=...), then {RESUME}"
        )
    if code == errno.EROFS:
        return OutputError(
            f"{path} is on a read-only filesystem; give this run a writable folder with "
            f"hydra.run.dir=..., then {RESUME}"
        )
    return OutputError(f"could not write {path} ({error.strerror or error}); fix that, then {RESUME}")


def open_for_write(path: Path, mode: str) -> IO[str]:
    """The one place run files are opened for writing (the fault tests inject failures here)."""
    return path.open(mode, encoding="utf-8")


def make_dirs(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise output_error(path, e) from None


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and rename it, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open_for_write(tmp, "w") as f:
            f.write(text)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise output_error(path, e) from None


def append_line(path: Path, line: str) -> None:
    """Append one line (with its newline) whole, or leave the file as it was."""
    size = path.stat().st_size if path.exists() else 0
    try:
        with open_for_write(path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())  # a line counts as done only once it is on disk
    except BaseException as e:
        # A failed write, or a signal (tot.solve stopped) before the line is on disk: the file is cut
        # back to its whole lines, so what is there was finished.
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        if isinstance(e, OSError):
            raise output_error(path, e) from None
        raise


def pyplot() -> ModuleType | None:
    """matplotlib's pyplot on the file-only backend, or None where matplotlib is not installed (a
    command then writes its tables without the picture)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Save and close a matplotlib figure; a failed write is one OutputError line."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise output_error(path, e) from None
    finally:
        plt.close(fig)
