"""One writer per run folder: a run holds an OS lock on `<folder>/.run.lock` while it runs.

The lock is `flock`'s: the kernel releases it when the process ends however it ends, so a killed run
never leaves a stale lock behind, and the file's text (host, process id, start time) only names the
holder for the message a second run prints. Where the folder's filesystem does not honour locks
(some network filesystems), the run says so and goes on unguarded rather than pretend.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from decoding import OutputError
from tot.runs.output import output_error

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def holder_of(folder: Path) -> str:
    """Who holds the folder, as the holder wrote it ("host <name>, pid <n>, since <time>")."""
    try:
        text = (folder / LOCK_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        text = ""
    return text or "a process that has not yet written its name"


@contextmanager
def run_lock(folder: Path) -> Iterator[None]:
    """Hold `folder` for one run; a second run on it ends at once with OutputError naming the holder."""
    path = folder / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise output_error(path, e) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputError(
                f"{folder} is in use by another run ({holder_of(folder)}); wait for it to end, or give this run "
                "its own folder with hydra.run.dir=..."
            ) from None
        except OSError as e:
            if e.errno not in UNSUPPORTED:
                raise output_error(path, e) from None
            log.warning(
                "%s's filesystem does not honour file locks: a second run on this folder would not be "
                "stopped, so start one run per folder",
                folder,
            )
        else:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            os.ftruncate(fd, 0)
            os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {stamp}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock
