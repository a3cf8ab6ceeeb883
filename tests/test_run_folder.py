"""What a run folder promises (issue 45; docs/tools.md): one configuration, results read and never
rewritten before they are checked, derived outputs that never shrink silently, every fault one line.

Each fault goes through the command line on a tiny random checkpoint (seconds a run) and asserts one
`error:` line, the exit status, no traceback, and that every file that was there is unchanged (for
results.jsonl: its whole lines are a prefix of the new file) unless changing it is the command's job.
The faults work as root and without mount rights: a file where a folder should be, a folder under a
file, a path under /proc, a folder where results.jsonl should be.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from test_cli import REPO, subprocess_env
from test_faults import one_error_line
from test_run import FakeEngine, make_config

import tot.runs.output
from decoding.base.cli import Stopped, prepare_folder
from tot.runs.config import ConfigError
from tot.runs.folder import RECORD, SELECTION, SPEED_ONLY, Configuration, _on_cpu, flatten, settings_of
from tot.runs.results import ResultStore, read_results
from tot.runs.run import run

TINY = [
    "decoder=ar",
    "run.concurrency=1",
    "task.depth=1",
    "search=bfs",
    "search.n_thoughts=2",
    "gen.max_thought_tokens=8",
    "gen.max_eval_tokens=4",
]


@pytest.fixture(scope="module")
def tiny(gsm8k_tiny: Path) -> Path:
    return gsm8k_tiny


def command(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def solve(tiny: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return command("tot.solve", f"model.path={tiny}", *TINY, *args, f"hydra.run.dir={run_dir}")


@pytest.fixture(scope="module")
def finished(tiny, tmp_path_factory) -> Path:
    """A folder tot.solve finished: two problems."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = solve(tiny, run_dir, "data.limit=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "run"))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes but the lock's (tot/runs/lock.py): that names who last held the folder, not a result."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".run.lock"
    }


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def whole_lines_kept(before: bytes, after: bytes) -> bool:
    """results.jsonl's whole lines before a run are a prefix of the file after it."""
    return after.startswith(before[: before.rfind(b"\n") + 1])


# ----------------------------------------------------------------------------- one configuration


def test_the_folder_records_its_configuration_once_resolved(finished):
    record = json.loads((finished / RECORD).read_text())
    settings = record["settings"]
    assert (settings["model.device"], settings["model.weights"], settings["model.attention"]) == (
        "cpu",
        "bfloat16",
        "invariant",
    )  # what auto chose, not "auto"
    assert settings["decoder.name"] == "ar" and settings["gen.temperature"] == 0.5  # GSM8K's own
    assert not set(SELECTION) & set(settings) and "run.concurrency" not in settings  # CPU: speed only
    assert {r["configuration"] for r in lines_of(finished / "results.jsonl")} == {record["fingerprint"]}
    assert json.loads((finished / "summary.json").read_text())["fingerprint"] == record["fingerprint"]


@pytest.mark.parametrize(
    "change, named, fix",
    [
        (["gen.temperature=0.3"], "gen.temperature=0.5 there, 0.3 here", "gen.temperature=0.5"),
        (["decoder=hf"], "decoder.name=ar there, hf here", "decoder=ar"),
        (["search.n_thoughts=3"], "search.n_thoughts=2 there, 3 here", "search.n_thoughts=2"),
        (["gen.seed=1"], "gen.seed=0 there, 1 here", "gen.seed=0"),
        (["model.attention=sdpa"], "model.attention=invariant there, sdpa here", "model.attention=invariant"),
    ],
)
def test_a_rerun_under_other_settings_is_refused_before_anything_is_written(
    tiny, finished, tmp_path, change, named, fix
):
    run_dir = copy_of(finished, tmp_path)
    before = snapshot(run_dir)
    line = one_error_line(solve(tiny, run_dir, "data.limit=3", *change))
    assert line.startswith(f"error: {run_dir} holds results of another configuration (")
    assert named in line and f"recorded in {run_dir / RECORD}" in line
    assert f"rerun with the folder's settings ({fix}" in line and "hydra.run.dir=..." in line
    assert snapshot(run_dir) == before  # .hydra/ too: Hydra never started


def test_the_selection_and_speed_only_keys_may_differ(tiny, finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    results = (run_dir / "results.jsonl").read_bytes()
    proc = solve(tiny, run_dir, "data.limit=1", "run.concurrency=3", f"model.cache_dir={tmp_path / 'cache'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "results.jsonl").read_bytes() == results  # the problem was done: nothing solved
    assert json.loads((run_dir / "summary.json").read_text())["n_problems"] == 2  # the folder's, not the selection's


def test_a_folder_made_before_configuration_json(tiny, finished, tmp_path):
    """It resumes under the settings its .hydra/config.yaml records (and gets its configuration.json
    then), is refused under others, and is refused with the way forward where nothing records them."""
    run_dir = copy_of(finished, tmp_path)
    (run_dir / RECORD).unlink()
    records = lines_of(run_dir / "results.jsonl")
    for r in records:
        r.pop("configuration")
    (run_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    before = snapshot(run_dir)
    line = one_error_line(solve(tiny, run_dir, "data.limit=2", "gen.top_k=5"))
    assert "gen.top_k=0 there, 5 here" in line and f"recorded in {run_dir / '.hydra' / 'config.yaml'}" in line
    assert snapshot(run_dir) == before
    proc = solve(tiny, run_dir, "data.limit=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run_dir / RECORD).read_text())["from"] == str(run_dir / ".hydra" / "config.yaml")
    assert (run_dir / "results.jsonl").read_bytes() == before["results.jsonl"]

    shutil.rmtree(run_dir / ".hydra")
    (run_dir / RECORD).unlink()
    before = snapshot(run_dir)
    line = one_error_line(solve(tiny, run_dir, "data.limit=2"))
    assert "holds results made before runs recorded their configuration" in line
    assert "hydra.run.dir=..." in line and "move its results.jsonl and trees/ aside" in line
    assert snapshot(run_dir) == before


def test_every_key_but_the_allow_list_counts_as_configuration():
    """Each key of the config, for every decoder: a changed value changes the fingerprint, unless the
    key is the selection or in SPEED_ONLY where it holds (run.concurrency on a CPU)."""
    speed_only = {key for key, _ in SPEED_ONLY}
    checked = 0
    for decoder in ("ar", "seed_stand", "sd", "server"):
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"decoder={decoder}", "draft.path=self"])
        container = OmegaConf.to_container(cfg, resolve=True)
        resolved = {"model.device": "cpu"}
        base = Configuration.from_settings(settings_of(container, resolved)).fingerprint
        for key, value in flatten(container).items():
            changed = json.loads(json.dumps(container))
            node = changed
            *parents, leaf = key.split(".")
            for p in parents:
                node = node[p]
            node[leaf] = [value, "changed"]
            moved = Configuration.from_settings(settings_of(changed, resolved)).fingerprint != base
            if key in SELECTION or key in resolved:
                assert not moved, key
            elif key in speed_only:
                # At temperature 0.7 the rule counts; a server's batching is its own, so there the
                # keys that hold on the CPU (concurrency, the KV memory, the buckets) do.
                on_cpu = dict(SPEED_ONLY)[key] is _on_cpu
                assert moved == (decoder == "server" if on_cpu else key == "verify.rule"), key
            else:
                assert moved, key
                checked += 1
    assert checked > 300
    # On a GPU the problems in flight change bits (bfloat16 kernels chosen by shape): there it counts.
    with initialize_config_module(config_module="conf", version_base="1.3"):
        container = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    gpu = [settings_of({**container, "run": {"concurrency": n}}, {"model.device": "cuda"}) for n in (1, 4)]
    assert gpu[0] != gpu[1]
    cpu = [settings_of({**container, "run": {"concurrency": n}}, {"model.device": "cpu"}) for n in (1, 4)]
    assert cpu[0] == cpu[1]
    # gen.temperature=0 and gen.temperature=0.0 are one setting, with one fingerprint (shards collect as one).
    zero = [settings_of({**container, "gen": {**container["gen"], "temperature": t}}, {}) for t in (0, 0.0)]
    assert len({Configuration.from_settings(z).fingerprint for z in zero}) == 1
    # Without a draft model (draft.path unset) nothing reads the draft's options.
    assert "draft.path" in cpu[0] and not [k for k in cpu[0] if k.startswith("draft.") and k != "draft.path"]


def test_a_depth_left_to_the_task_is_recorded_as_the_task_runs_it():
    """task.depth null (GSM8K's default) is recorded as the depth the task takes, so a folder made
    with it resumes under the same depth given outright, and the thoughts' kind decides it."""
    with initialize_config_module(config_module="conf", version_base="1.3"):
        containers = [
            OmegaConf.to_container(compose(config_name="config", overrides=list(o)), resolve=True)
            for o in ((), ("task.depth=10",), ("task.thoughts=subquestions",), ("task.depth=4",))
        ]
    default, ten, sub, four = (Configuration.of(c) for c in containers)
    assert default.settings["task.depth"] == 10 and default.fingerprint == ten.fingerprint
    assert sub.settings["task.depth"] == 4 and sub.fingerprint != four.fingerprint  # the thoughts differ


def test_at_temperature_0_any_sampling_rule_resumes(tmp_path):
    greedy = ("gen.temperature=0", "gen.eval_temperature=0")
    run(make_config("data.limit=1", *greedy), tmp_path, engine=FakeEngine(), progress=False)
    run(make_config("data.limit=2", *greedy, "verify.rule=rejection"), tmp_path, engine=FakeEngine(), progress=False)
    with pytest.raises(ConfigError, match=r"gen\.temperature=0 there, 0\.5 here"):
        run(make_config("data.limit=2"), tmp_path, engine=FakeEngine(), progress=False)


def test_the_folder_is_resolved_once_and_pinned(tmp_path, monkeypatch):
    """Hydra's default folder names the time: the wrapper resolves it, checks it and pins it, so
    the folder checked is the folder written."""
    monkeypatch.chdir(tmp_path)
    seen = []
    pin = prepare_folder(["data.limit=1"], "config", lambda cfg, folder: seen.append((cfg, folder)))
    assert pin.startswith("hydra.run.dir=runs/gsm8k/seed_stand/")
    folder = Path(pin.partition("=")[2])
    assert (tmp_path / folder).is_dir() and not list((tmp_path / folder).iterdir())
    assert seen[0][1] == folder and "hydra" not in seen[0][0] and seen[0][0].data.limit == 1
    assert prepare_folder(["data.limit=1", f"hydra.run.dir={tmp_path / 'x'}"], "config", None) == ""
    assert prepare_folder(["--cfg", "job"], "config", None) == ""  # Hydra prints; nothing is written


def test_a_failed_write_of_the_record_is_one_line_and_the_rerun_writes_it(tiny, tmp_path):
    """The write of configuration.json refused (injected at the project's writer, tests/fault_run.py):
    one line, nothing solved; the rerun records the configuration and solves."""
    run_dir = tmp_path / "run"
    fault = [str(REPO / "tests" / "fault_run.py"), "EACCES", f"{RECORD}.tmp", "1", "tot.solve"]
    args = [f"model.path={tiny}", *TINY, "data.limit=1", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        [sys.executable, *fault, *args], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert one_error_line(proc).startswith(f"error: permission denied writing {run_dir / RECORD}; make {run_dir}")
    assert not (run_dir / RECORD).exists() and not (run_dir / "results.jsonl").exists()
    assert solve(tiny, run_dir, "data.limit=1").returncode == 0
    assert json.loads((run_dir / RECORD).read_text())["settings"]["decoder.name"] == "ar"


# ----------------------------------------------------------------------------- loading never rewrites


def test_reading_results_changes_nothing_and_the_latest_record_wins(tmp_path):
    def line(pid: str, answer: str) -> str:
        return json.dumps({"id": pid, "correct": False, "wall_s": 1.0, "phases": {}, "answer": answer}) + "\n"

    path = tmp_path / "results.jsonl"
    text = line("a", "1") + "\n" + line("b", "2") + line("a", "3") + '{"id": "c", "cor'
    path.write_text(text)
    results = read_results(path)
    assert path.read_text() == text
    assert {pid: r["answer"] for pid, r in results.latest.items()} == {"a": "3", "b": "2"}
    assert results.redone == ["a"] and results.torn_line == 5
    store = ResultStore(tmp_path)
    assert path.read_text() == text
    store.append(json.loads(line("c", "4")))  # the torn tail goes just before the first new line
    assert path.read_text() == text[: text.rindex("\n") + 1] + line("c", "4")
    assert [r["answer"] for r in store.records] == ["3", "2", "4"]


def test_a_torn_last_line_is_ignored_with_a_warning_and_the_problem_solved_again(tiny, finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    results = run_dir / "results.jsonl"
    whole = results.read_bytes()
    results.write_bytes(whole + b'{"id": "bundled-3", "question": "A')  # a kill mid-append
    proc = solve(tiny, run_dir, "data.limit=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "cut short" in line]
    assert len(warnings) == 1 and f"{results}:3 is a record cut short" in warnings[0]
    assert results.read_bytes().startswith(whole)
    assert [r["id"] for r in lines_of(results)] == ["bundled-1", "bundled-2", "bundled-3"]


@pytest.mark.parametrize(
    "damage, named",
    [
        ("not json\n", "not a JSON record (Expecting value)"),
        ('{"id": "bundled-1"}\n', "not a whole record of tot.solve (no valid correct, wall_s, phases)"),
        ("[1, 2]\n", "not a JSON object"),
    ],
)
def test_damage_in_the_middle_is_refused_naming_file_and_line(tiny, finished, tmp_path, damage, named):
    run_dir, results = damaged(finished, tmp_path, damage)
    before = snapshot(run_dir)
    line = one_error_line(solve(tiny, run_dir, "data.limit=2"))
    assert line.startswith(f"error: {results}:2: {named}; remove or repair that line")
    assert snapshot(run_dir) == before


def damaged(finished: Path, tmp_path: Path, damage: str) -> tuple[Path, Path]:
    """A copy of a finished folder with `damage` between its two records: the folder, its results."""
    run_dir = copy_of(finished, tmp_path)
    results = run_dir / "results.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    results.write_text(lines[0] + damage + lines[1])
    return run_dir, results


def test_the_folder_tools_name_a_damaged_line_and_change_nothing(finished, tmp_path):
    """show, rescore and collect read a folder through the reader `solve` refuses damage with (each
    kind of damage checked above): each names the line, in one line, and writes nothing."""
    run_dir, results = damaged(finished, tmp_path, "not json\n")
    before, named = snapshot(run_dir), "not a JSON record (Expecting value)"
    for module, args in (("tot.show", ["--no-image"]), ("tot.rescore", []), ("tot.collect", [])):
        where = run_dir.parent if module == "tot.collect" else run_dir
        line = one_error_line(command(module, str(where), *args))
        assert f"{results}:2: {named}" in line, module
        assert snapshot(run_dir) == before, module


def test_a_record_of_another_configuration_is_refused(tiny, finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    results = run_dir / "results.jsonl"
    records = lines_of(results)
    records[0]["configuration"] = "0123456789abcdef"
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    before = snapshot(run_dir)
    line = one_error_line(solve(tiny, run_dir, "data.limit=2"))
    assert f"{results}:1: a record of configuration 0123456789abcdef, not this folder's" in line
    assert snapshot(run_dir) == before


def test_an_unreadable_tree_is_named_by_show_and_solved_again_by_a_rerun(tiny, finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    broken = run_dir / "trees" / "bundled-1.json"
    broken.write_text('{"nodes": [')
    shown = command("tot.show", str(run_dir), "--no-image")
    assert one_error_line(shown).startswith(f"error: {broken} cannot be read (")
    assert "problem bundled-2:" in shown.stdout and "problem bundled-1:" not in shown.stdout
    page = tmp_path / "trees.html"
    html = command("tot.show", str(run_dir), "--html", "--out", str(page))
    assert one_error_line(html).startswith(f"error: {broken} cannot be read (")
    assert "(1 trees;" in html.stdout and "bundled-2" in page.read_text()

    results = (run_dir / "results.jsonl").read_bytes()
    proc = solve(tiny, run_dir, "data.limit=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "problem bundled-1 is solved again" in proc.stdout + proc.stderr
    after = (run_dir / "results.jsonl").read_bytes()
    assert after.startswith(results)
    assert [r["id"] for r in lines_of(run_dir / "results.jsonl")] == ["bundled-1", "bundled-2", "bundled-1"]
    json.loads(broken.read_text())  # written again
    assert json.loads((run_dir / "summary.json").read_text())["n_problems"] == 2


def test_a_record_cut_mid_append_by_a_signal_is_trimmed(tmp_path, monkeypatch):
    """SIGTERM (Stopped) or Ctrl-C halfway through a record's write: the file is cut back to its
    whole lines, and the signal goes on to end the command."""
    path = tmp_path / "results.jsonl"
    path.write_text('{"id": "a"}\n')
    real = tot.runs.output.open_for_write

    class Halfway:
        def __init__(self, f: IO[str]) -> None:
            self.f = f

        def write(self, text: str) -> int:
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise Stopped(signal.SIGTERM)

        def __enter__(self) -> Halfway:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    monkeypatch.setattr(tot.runs.output, "open_for_write", lambda p, mode: Halfway(real(p, mode)))
    with pytest.raises(Stopped):
        tot.runs.output.append_line(path, '{"id": "b", "answer": "12"}')
    assert path.read_text() == '{"id": "a"}\n'


def test_compare_names_an_unreadable_tree_in_one_line(finished, tmp_path):
    other = copy_of(finished, tmp_path)
    (other / "trees" / "bundled-2.json").write_text("{")
    line = one_error_line(command("tot.compare", str(finished), str(other)))
    assert line.startswith(f"error: {other / 'trees' / 'bundled-2.json'} cannot be read (")


# ----------------------------------------------------------------------------- derived outputs


def test_rescore_never_shrinks_a_summary(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    (run_dir / "results.jsonl").rename(tmp_path / "aside.jsonl")
    before = snapshot(run_dir)
    line = one_error_line(command("tot.rescore", str(run_dir)))
    assert line == f"error: {run_dir / 'results.jsonl'} is missing, so there is nothing to rescore and " + (
        f"{run_dir / 'summary.json'} is kept; restore it"
    )
    assert snapshot(run_dir) == before
    lines = (tmp_path / "aside.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "results.jsonl").write_text(lines[0])  # one of the summary's two problems
    before = snapshot(run_dir)
    line = one_error_line(command("tot.rescore", str(run_dir)))
    assert "summary.json counts 2 problems" in line and "holds 1 of them: nothing rewritten" in line
    assert snapshot(run_dir) == before


def test_rescore_keeps_every_line(finished, tmp_path):
    """A problem solved again has two records: both lines stay; a torn last line stays as it was."""
    run_dir = copy_of(finished, tmp_path)
    results = run_dir / "results.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    torn = '{"id": "bundled-3", "qu'
    results.write_text("".join([*lines, lines[0], torn]))
    proc = command("tot.rescore", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = results.read_text()
    assert len(text.splitlines()) == 4 and text.endswith(torn)


def test_collect_keeps_configurations_apart_and_counts_each_problem_once(tmp_path, capsys):
    from tot.collect import main as collect_main

    root = tmp_path / "sweep"
    for name, overrides in {
        "a0": ("data.limit=3", "data.shard=0", "data.num_shards=2"),
        "a1": ("data.limit=3", "data.shard=1", "data.num_shards=2"),
        "a-copy": ("data.limit=1",),  # bundled-1 again, under the same configuration
        "b": ("data.limit=2", "gen.temperature=0.3"),
    }.items():
        run(make_config(*overrides), root / name, engine=FakeEngine(), progress=False)
    assert collect_main([str(root)]) == 0
    printed = capsys.readouterr().out
    assert "1 problem(s) in more than one run (bundled-1; in a-copy, a0): each counted once" in printed
    combined = {r["run"]: r["n_problems"] for r in json.loads((root / "collected.json").read_text())["combined"]}
    assert combined == {"3 run(s)": 3, "1 run(s)": 2}

    shutil.rmtree(root / "a1")  # a shard gone missing: the collection would count fewer problems
    before = snapshot(root)
    proc = command("tot.collect", str(root))
    line = one_error_line(proc)
    assert f"error: {root / 'collected.json'} counts 3 problems of configuration " in line
    assert "now 2; restore the missing runs, or delete" in line
    assert snapshot(root) == before

    (root / "b" / "results.jsonl").unlink()
    line = one_error_line(command("tot.collect", str(root)))
    assert f"{root / 'b'} has a summary.json but no results.jsonl" in line
    assert snapshot(root) == {k: v for k, v in before.items() if k != "b/results.jsonl"}


# ----------------------------------------------------------------------------- faults before and around Hydra


@pytest.mark.parametrize("where", ["file", "under_file", "proc", "results_dir"])
def test_an_impossible_folder_is_one_line_before_hydra(tiny, tmp_path, where):
    taken = tmp_path / "taken"
    taken.write_text("a file\n")
    run_dir = {
        "file": taken,
        "under_file": taken / "run",
        "proc": Path("/proc/no-such-process/run"),
        "results_dir": tmp_path / "run",
    }[where]
    if where == "results_dir":
        (run_dir / "results.jsonl").mkdir(parents=True)
    line = one_error_line(solve(tiny, run_dir, "data.limit=1"))
    expected = {
        "file": f"error: hydra.run.dir={taken}: {taken} is a file, where a folder should be;",
        "under_file": f"error: hydra.run.dir={taken}/run: {taken} is a file, where a folder should be;",
        "proc": "error: hydra.run.dir=/proc/no-such-process/run cannot be written (",
        "results_dir": f"error: {run_dir / 'results.jsonl'} is a folder, not the run's results file;",
    }[where]
    assert line.startswith(expected) and "hydra.run.dir=..." in line
    assert taken.read_text() == "a file\n"
    if where == "results_dir":
        assert sorted(p.name for p in run_dir.iterdir()) == ["results.jsonl"]


def test_bench_and_sweep_folders_are_checked_before_hydra(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("")
    line = one_error_line(command("tot.bench", "data.limit=1", f"hydra.run.dir={taken / 'bench'}"))
    assert line.startswith(f"error: hydra.run.dir={taken}/bench: {taken} is a file")
    line = one_error_line(command("tot.solve", "-m", "decoder=ar,hf", f"hydra.sweep.dir={taken}"))
    assert line.startswith(f"error: hydra.sweep.dir={taken}: {taken} is a file")


@pytest.mark.parametrize(
    "override, named",
    [
        ("gen.temperature=nan", "error: gen.temperature=nan is not a finite number"),
        ("gen.top_p=inf", "error: gen.top_p=inf is not a finite number"),
        ("model.prefix_memory=-inf", "error: model.prefix_memory=-inf is not a finite number"),
    ],
)
def test_non_finite_numbers_are_refused_at_load(tmp_path, override, named):
    line = one_error_line(command("tot.solve", override, f"hydra.run.dir={tmp_path / 'run'}"))
    assert line.startswith(named)
    assert not list((tmp_path / "run").iterdir())


GOOD_LINE = b'{"question": "1 + 1?", "answer": "#### 2"}\n'


@pytest.mark.parametrize(
    "content, named",
    [
        (GOOD_LINE + b'{"question": "caf\xe9?", "answer": "#### 3"}\n', ":2: byte 0xe9 at column 18 is not UTF-8"),
        (b'{"question": "  ", "answer": "#### 2"}\n', ":1: the question is '  '; give each problem its question"),
    ],
)
def test_data_files_are_checked_line_by_line(tmp_path, content, named):
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    line = one_error_line(command("tot.solve", f"data.path={data}", f"hydra.run.dir={tmp_path / 'run'}"))
    assert line.startswith(f"error: {data}{named}")


@pytest.mark.parametrize("name, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_ends_the_run_in_one_line_keeping_what_finished(tiny, tmp_path, name, status):
    data = tmp_path / "many.jsonl"
    problems = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(200)]
    data.write_text("".join(json.dumps(p) + "\n" for p in problems))
    run_dir = tmp_path / "run"
    args = [f"model.path={tiny}", *TINY, f"data.path={data}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tot.solve", *args],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    results = run_dir / "results.jsonl"
    deadline = time.monotonic() + 240
    while not (results.exists() and results.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(getattr(signal, name))
    _, err = proc.communicate(timeout=120)
    report = f"exit {proc.returncode}\nstderr:\n{err[-4000:]}"
    assert proc.returncode == status, report
    assert "Traceback" not in err, report
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: stopped by {name}; what finished is kept: rerun the same command to go on"], report
    text = results.read_text()
    assert text.endswith("\n") and len(lines_of(results)) >= 2  # every line whole, what finished kept
    assert not list(run_dir.rglob("*.tmp"))


def test_the_kv_memory_queues_samples_and_the_summary_says_so(tiny, tmp_path):
    """model.kv_memory_mb too small for a step's samples at once: the run finishes with the same
    answers as without the bound (on a CPU the forward is batch-invariant: a speed-only key there),
    and the summary and its line say how many sequences waited."""
    args = ("data.limit=1", "search.n_thoughts=24", "task.value=sampled")  # ~120 kB of KV a row: 24 rows are ~3 MB
    free = solve(tiny, tmp_path / "free", *args)
    bounded = solve(tiny, tmp_path / "bounded", *args, "model.kv_memory_mb=1")
    assert free.returncode == 0 and bounded.returncode == 0, bounded.stderr[-3000:]
    assert "sequences waited for KV memory (model.kv_memory)" in bounded.stdout
    assert "KV memory" not in free.stdout
    assert json.loads((tmp_path / "bounded" / "summary.json").read_text())["kv_waits"] > 0

    def answers(run_dir: Path) -> list[dict]:
        return [
            {k: r.get(k) for k in ("id", "answer", "steps")}
            for r in read_results(run_dir / "results.jsonl").latest.values()
        ]

    assert answers(tmp_path / "bounded") == answers(tmp_path / "free")
