"""Faults a run must survive (issue 28): a second run on a folder, a full disk, a refused write.

Each case runs the real command line; write failures are injected at the project's writer
(tests/fault_run.py), which works as root and without mount rights. Every case asserts one line,
exit status 2, no traceback, and that what was written before is intact and resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import REPO, subprocess_env
from test_run import FakeEngine, make_config

from decoding.base.errors import OutputError
from tot.collect import main as collect_main
from tot.runs.lock import run_lock
from tot.runs.results import ResultStore
from tot.runs.run import run

SMALL = [
    "model=smollm2-135m",
    "decoder=ar",
    "data.limit=3",
    "run.concurrency=1",  # problems finish in order, so the fault lands after the first is written
    "task.depth=1",
    "search=bfs",
    "search.n_thoughts=2",
    "gen.max_thought_tokens=8",
    "gen.max_eval_tokens=4",
]


def solve(
    model: Path | None, run_dir: Path, fault: tuple[str | int, ...] | None = None, *more: str
) -> subprocess.CompletedProcess:
    """tot.solve, small, on `model` (None: the embedded model); with `fault` = (errno name, file
    pattern, nth open), or several of these one after the other."""
    head = [str(REPO / "tests" / "fault_run.py"), *map(str, fault)] if fault else ["-m"]
    on = [] if model is None else [f"model.path={model}"]
    cmd = [sys.executable, *head, "tot.solve", *SMALL, *on, *more, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    report = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 2, report
    assert "Traceback" not in proc.stderr, report
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, report
    return errors[0]


def records(run_dir: Path) -> list[dict]:
    text = (run_dir / "results.jsonl").read_text()
    assert text == "" or text.endswith("\n")  # every line whole
    return [json.loads(line) for line in text.splitlines()]


def check_intact_and_resumes(model: Path, run_dir: Path, done: int) -> None:
    """What the failed run wrote is valid (`done` problems, no temporary files), and a rerun finishes
    the rest without running those again."""
    before = records(run_dir)
    assert len(before) == done
    assert not list(run_dir.rglob("*.tmp"))
    if (run_dir / "summary.json").exists():
        assert json.loads((run_dir / "summary.json").read_text())["n_problems"] <= done
    for r in before:
        json.loads((run_dir / "trees" / f"{r['id']}.json").read_text())
    proc = solve(model, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = records(run_dir)
    assert after[:done] == before  # kept as they were, not run again
    assert len({r["id"] for r in after}) == len(after) == 3
    assert json.loads((run_dir / "summary.json").read_text())["n_problems"] == 3


def test_no_space_while_writing_a_tree(gsm8k_tiny, tmp_path):
    run_dir = tmp_path / "run"
    line = one_error_line(solve(gsm8k_tiny, run_dir, ("ENOSPC", "bundled-2.json.tmp", 1)))
    assert line.startswith(f"error: no space left on the device writing {run_dir / 'trees' / 'bundled-2.json'};")
    assert "free space there" in line and "rerun the same command" in line
    check_intact_and_resumes(gsm8k_tiny, run_dir, done=1)


def test_no_space_halfway_through_a_result_line(gsm8k_tiny, tmp_path):
    run_dir = tmp_path / "run"
    line = one_error_line(solve(gsm8k_tiny, run_dir, ("ENOSPC", "results.jsonl", 2)))
    assert line.startswith(f"error: no space left on the device writing {run_dir / 'results.jsonl'};")
    check_intact_and_resumes(gsm8k_tiny, run_dir, done=1)  # the half line was cut back off


def test_a_full_disk_under_the_log_is_one_warning_then_the_runs_error(gsm8k_tiny, tmp_path):
    """The disk fills under a resumed run: its log file cannot be written (one line, once: no "---
    Logging error ---" traceback per record), the run goes on until its own write fails (its one-line
    error, exit 2)."""
    run_dir = tmp_path / "run"
    # One problem done: the rerun logs that it resumes.
    one_error_line(solve(gsm8k_tiny, run_dir, ("ENOSPC", "results.jsonl", 2)))
    proc = solve(gsm8k_tiny, run_dir, ("ENOSPC", "*.log", 1, "ENOSPC", "results.jsonl", 1))
    line = one_error_line(proc)
    assert line.startswith(f"error: no space left on the device writing {run_dir / 'results.jsonl'};")
    assert "Logging error" not in proc.stderr
    lines = proc.stderr.splitlines()
    (warning,) = [x for x in lines if x.startswith("warning: the log")]
    assert warning == (
        f"warning: the log {run_dir / 'solve.log'} cannot be written (No space left on device); "
        "the run goes on without it"
    )
    assert lines.index(warning) < lines.index(line)
    check_intact_and_resumes(gsm8k_tiny, run_dir, done=1)


def test_permission_refused(gsm8k_tiny, tmp_path):
    run_dir = tmp_path / "run"
    line = one_error_line(solve(gsm8k_tiny, run_dir, ("EACCES", "summary.json.tmp", 1)))
    assert line.startswith(f"error: permission denied writing {run_dir / 'summary.json'}; make {run_dir} writable")
    check_intact_and_resumes(gsm8k_tiny, run_dir, done=1)


def test_a_second_run_on_a_held_folder_stops_at_once(gsm8k_tiny, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "results.jsonl").write_text("")
    with run_lock(run_dir):  # this test process is the first run
        line = one_error_line(solve(gsm8k_tiny, run_dir))
    assert line.startswith(f"error: {run_dir} is in use by another run (host ")
    assert f"pid {os.getpid()}," in line and "hydra.run.dir=" in line
    assert (run_dir / "results.jsonl").read_text() == ""  # the second run wrote nothing


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import time; from pathlib import Path; from tot.runs.lock import run_lock\n"
            f"with run_lock(Path({str(tmp_path)!r})):\n    print('held', flush=True); time.sleep(600)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(OutputError, match=f"pid {holder.pid},"), run_lock(tmp_path):
        pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with run_lock(tmp_path):  # the kernel let go of the dead run's lock
        pass


def test_a_small_prefix_store_stays_under_its_cap(tmp_path):
    """model.prefix_memory_mb small enough to be reached by three problems: every problem's record
    shows the stored prefixes under the cap, the summary the evictions that kept them there."""
    run_dir = tmp_path / "run"
    proc = solve(None, run_dir, None, "model.prefix_memory_mb=8")  # its KV fills 8 MB
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in records(run_dir):
        assert 0 < r["memory"]["prefix_store_mb"] <= r["memory"]["prefix_store_cap_mb"] == 8
    memory = json.loads((run_dir / "summary.json").read_text())["memory"]
    assert memory["prefix_evictions"] > 0 and memory["prefix_store_mb"] <= 8
    # Nothing is live once the run is done: the pool has given all its memory back.
    assert memory["kv_pool_mb"] == 0 < memory["peak_kv_mb"] and memory["peak_rss_mb"] >= memory["rss_mb"] > 0


def test_problems_recorded_twice_count_once_and_nothing_is_rewritten(tmp_path, capsys):
    """A folder two runs wrote at once before the lock existed (or a problem solved again): collect
    and a resumed run count each problem once, its latest record, and results.jsonl stays as it is."""
    out = tmp_path / "old-run"
    run(make_config("data.limit=3"), out, engine=FakeEngine(), progress=False)
    results = out / "results.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    later = [json.dumps({**json.loads(line), "answer": "later"}) + "\n" for line in lines[:2]]
    results.write_text("".join(lines + later))  # the other run's records of two problems, written last
    summary = json.loads((out / "summary.json").read_text())
    summary["n_problems"] = 5
    (out / "summary.json").write_text(json.dumps(summary))
    assert collect_main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "collected.json").read_text())["runs"][0]["n_problems"] == 3
    counting = FakeEngine()
    assert run(make_config("data.limit=3"), out, engine=counting, progress=False)["n_problems"] == 3
    assert counting.calls == 0 and results.read_text() == "".join(lines + later)
    assert [r["answer"] for r in ResultStore(out).records] == ["later", "later", "12"]


class _Term(KeyboardInterrupt):
    """What the CLI's SIGTERM handler raises (decoding.base.cli.Stopped), told apart from a real Ctrl-C."""


def _raise_term(signum: int, frame: object) -> None:
    raise _Term


def test_sigterm_mid_search_unwinds_every_task_in_the_loop_then_runs_the_handler():
    """The shape the CLI's SIGTERM met: a signal landing in one task of a gather inside a gather. Raised
    inside the loop, the inner gather handed the error to a task already told to cancel, the loop
    closed with the run's own task unfinished, and its cleanup ran later, outside any loop, with a
    traceback. run_sync cancels instead, and the handler in place (the CLI's, which raises) runs once
    every task has unwound."""
    import asyncio
    import gc

    from tot.runs.run import gather_all
    from tot.search.base import run_sync

    cleaned: list[str] = []

    def clean(name: str) -> None:
        try:
            asyncio.get_running_loop()
            cleaned.append(name)
        except RuntimeError:
            cleaned.append(f"{name}, outside the loop")

    async def waits(name: str) -> None:
        try:
            await asyncio.sleep(30)
        finally:
            clean(name)

    async def signalled() -> None:
        await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(30)

    async def search() -> None:
        await asyncio.gather(signalled(), waits("sibling"))

    async def whole_run() -> None:
        try:
            await gather_all([search(), waits("other problem")])
        finally:
            clean("the run")

    previous = signal.signal(signal.SIGTERM, _raise_term)
    try:
        with pytest.raises(_Term):
            run_sync(whole_run())
        gc.collect()  # a task left unfinished by its loop runs its cleanup when collected
        assert sorted(cleaned) == ["other problem", "sibling", "the run"]
        assert signal.getsignal(signal.SIGTERM) is _raise_term
    finally:
        signal.signal(signal.SIGTERM, previous)


def working_in(folder: Path) -> list[int]:
    """The processes whose working folder is under `folder`."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(entry / "cwd")).is_relative_to(folder):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_sigterm_during_the_kernel_build_ends_its_compilers(gsm8k_tiny, tmp_path):
    """torch kills only the `ninja` it ran: the compilers under it must end with the command too."""
    build = tmp_path / "extensions"  # a fresh build: the command starts compiling the kernels
    cmd = [sys.executable, "-m", "tot.solve", *SMALL, f"model.path={gsm8k_tiny}", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**subprocess_env(), "TORCH_EXTENSIONS_DIR": str(build)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(working_in(build)) < 2:  # ninja and a compiler
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: stopped by SIGTERM; ")
    deadline = time.monotonic() + 10
    while working_in(build) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert working_in(build) == []


SPAWNER = """
import contextlib, subprocess, time
from pathlib import Path
from decoding.base.cli import descendants, end_descendants
# A shell starting sleeps as fast as it can, as ninja starts compilers: a parent ended while its
# children are listed must leave none running.
script = "i=0; while [ $i -lt 300 ]; do sleep 30.25 & i=$((i+1)); done; wait"
shell = subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while len(descendants(shell.pid)) < 20:
    time.sleep(0.001)
end_descendants()
shell.wait()


def left() -> int:
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # a process that ended while listed
            count += cmdline.read_bytes().startswith(b"sleep\\x0030.25")
    return count


deadline = time.monotonic() + 10  # a sleep signalled ends within moments; one missed lives 30 s
while left() and time.monotonic() < deadline:
    time.sleep(0.1)
print(left())
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="processes are listed from /proc")
def test_ending_descendants_catches_the_ones_started_while_they_are_listed():
    # In a process of its own: this pytest worker's descendants include other tests' servers.
    cmd = [sys.executable, "-c", SPAWNER]
    out = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0"]


def test_each_checkout_builds_its_kernels_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Build files name their sources by path: two checkouts sharing one build folder rebuilt all of it
    at every alternation."""
    from decoding.runtime import kernels

    here = kernels.module_name()
    assert here == kernels.module_name() and here.startswith("tot_kernels_")
    monkeypatch.setattr(kernels, "CSRC", tmp_path / "other" / "decoding" / "runtime" / "csrc")
    assert kernels.module_name() != here
