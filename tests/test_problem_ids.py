"""Problem ids and selections (issue 60; docs/tools.md): ids unique as the strings runs store, one tree
file per id, folders of the old tree names still read, an empty selection refused (an empty shard
said), and a summary of every problem the folder holds.

Each case goes through the command line on a tiny random checkpoint and asserts one line, the exit
status, no traceback, and what the folder holds after it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_faults import one_error_line
from test_run_folder import command, copy_of, snapshot, solve

from tasks import DataSpec, make_task
from tasks.base import DataError
from tot.runs.results import TreeFiles, legacy_tree_file, problem_of, tree_file, tree_name

# Ids that the old names ('_' for every character but [\w.-]) gave one file: a/1 and a_1.
IDS = ["a/1", "a_1", "b c"]


def data_file(folder: Path, ids: list[object], name: str = "data.jsonl") -> Path:
    """A GSM8K file of one problem per id (a question of its own each), written as JSON gives them."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    lines = [
        json.dumps({"id": pid, "question": f"How many apples are {i} + 1 apples?", "answer": f"#### {i + 1}"})
        for i, pid in enumerate(ids)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(gsm8k_tiny: Path) -> Path:
    return gsm8k_tiny


@pytest.fixture(scope="module")
def three(tiny, tmp_path_factory) -> Path:
    """A folder tot.solve finished: the three problems of IDS."""
    root = tmp_path_factory.mktemp("three")
    run_dir = root / "run"
    proc = solve(tiny, run_dir, f"data.path={data_file(root, IDS)}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def nothing_written(run_dir: Path) -> bool:
    """A refused run's folder: not there, or empty (the folder made before Hydra, and nothing in it)."""
    return not run_dir.exists() or not any(run_dir.rglob("*"))


# ----------------------------------------------------------------------------- ids refused


@pytest.mark.parametrize(
    "ids, named",
    [
        (["a", "b", "a"], "data file {path}: line 1 and line 3 have the same id 'a'; ids must be unique"),
        ([1, "x", "1"], "data file {path}: line 1 and line 3 have the same id '1'; ids must be unique"),  # one string
        (["a", "", "c"], "data file {path}: line 2 has the id ''; give each problem a non-empty id on one line"),
        (["a", None], "{path}:2: the id is null; give each problem a string (or integer) id"),  # not "None"
    ],
)
def test_a_repeated_empty_or_null_id_is_refused_before_anything_is_written(tiny, tmp_path, ids, named):
    path = data_file(tmp_path, ids)
    run_dir = tmp_path / "run"
    line = one_error_line(solve(tiny, run_dir, f"data.path={path}", "data.limit=1"))
    assert line.startswith(f"error: {named.format(path=path)}")
    assert nothing_written(run_dir)


@pytest.mark.parametrize(
    "value, named",
    [
        ("   ", "data file {path}: line 2 has the id '   '; give each problem a non-empty id on one line"),
        ("b\nc", "data file {path}: line 2 has the id 'b\\nc'; give each problem a non-empty id on one line"),
        (1.0, "{path}:2: the id is 1.0; give each problem a string (or integer) id"),  # str() would store "1.0"
        ([1], "{path}:2: the id is [1]; give each problem a string (or integer) id"),
        (True, "{path}:2: the id is true; give each problem a string (or integer) id"),
    ],
)
def test_every_other_id_that_is_no_string_of_one_line_is_refused(tmp_path, value, named):
    path = data_file(tmp_path, ["a", value])
    with pytest.raises(DataError) as info:
        make_task("gsm8k", 1).load(DataSpec(path=str(path), limit=1))
    assert str(info.value) == named.format(path=path)


def test_blocksworld_files_name_both_lines_and_refuse_an_empty_id(tmp_path):
    task = make_task("blocksworld", 7)
    rec = {"objects": ["a"], "init": ["handempty", "ontable a", "clear a"], "goal": ["ontable a"]}
    path = tmp_path / "bw.jsonl"
    path.write_text("".join(json.dumps({"id": pid, **rec}) + "\n" for pid in ("p", "q", "p")))
    with pytest.raises(DataError, match=rf"data file {path}: line 1 and line 3 have the same id 'p'"):
        task.load(DataSpec(path=str(path)))
    path.write_text(json.dumps({"id": " ", **rec}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: id must be a non-empty string on one line, got \" \""):
        task.load(DataSpec(path=str(path)))


# ----------------------------------------------------------------------------- one tree file per id


def test_tree_names_are_one_per_id():
    ids = ["a/1", "a_1", "a%2F1", "a 1", "é", "a~b", "x" * 300, "x" * 299 + "y", ".", "bundled-1"]
    names = [tree_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    assert names[:3] == ["a%2F1", "a_1", "a%252F1"] and names[-1] == "bundled-1"
    assert all(len(n) <= 200 and "/" not in n for n in names)
    assert [problem_of(n) for n in names[:6]] == ids[:6]


def test_ids_that_shared_a_file_each_get_their_own(three):
    """a/1 and a_1 (one file under the old names) each have their tree, with their own question,
    and the summary counts all three."""
    recs = records(three)
    assert [r["id"] for r in recs] == IDS
    for r in recs:
        tree = json.loads(tree_file(three, r["id"]).read_text())
        assert tree["nodes"][0]["text"] == r["question"]  # the root: this problem, not another's
    assert sorted(p.name for p in (three / "trees").glob("*.json")) == ["a%2F1.json", "a_1.json", "b%20c.json"]
    assert json.loads((three / "summary.json").read_text())["n_problems"] == 3
    shown = command("tot.show", str(three), "--no-image")
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert all(f"problem {pid}: answer=" in shown.stdout for pid in IDS)


# ----------------------------------------------------------------------------- folders of the old names


def old_named(three: Path, tmp_path: Path) -> Path:
    """The folder as runs before tree_name left it: 'b c' at b_c.json, and a/1's tree lost under
    a_1.json (the one file a/1 and a_1 shared; a_1, written last, kept it)."""
    run_dir = copy_of(three, tmp_path)
    (run_dir / "trees" / "b%20c.json").rename(legacy_tree_file(run_dir, "b c"))
    (run_dir / "trees" / "a%2F1.json").unlink()
    return run_dir


def test_old_names_are_read_but_a_shared_one_is_no_ones_but_its_own(three, tmp_path):
    run_dir = old_named(three, tmp_path)
    files = TreeFiles.of(run_dir, IDS)
    assert files.find("b c") == run_dir / "trees" / "b_c.json"
    assert files.find("a_1") == run_dir / "trees" / "a_1.json"
    assert files.find("a/1") is None  # a_1.json is a_1's, not a/1's


def test_show_rescore_and_compare_read_a_folder_of_the_old_names(three, tmp_path):
    run_dir = old_named(three, tmp_path)
    shown = command("tot.show", str(run_dir), "--no-image")
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "problem b c: answer=" in shown.stdout and "problem a_1: answer=" in shown.stdout
    assert "problem a/1" not in shown.stdout  # its tree is gone: a_1's is not shown as its

    compared = command("tot.compare", str(three), str(run_dir))
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert compared.stdout.splitlines()[-1] == "2/2 trees identical"  # matched by id, not by file name

    before = snapshot(run_dir)
    rescored = command("tot.rescore", str(run_dir))
    assert rescored.returncode == 0, rescored.stderr[-3000:]
    assert "0 of 3 problems changed" in rescored.stdout
    assert sorted(p.name for p in (run_dir / "trees").glob("*.json")) == ["a_1.json", "b_c.json"]
    assert json.loads((run_dir / "summary.json").read_text())["n_problems"] == 3
    after = snapshot(run_dir)
    assert after["trees/b_c.json"] == before["trees/b_c.json"]  # read and written back where it was


def test_a_rerun_in_a_folder_of_the_old_names_solves_only_the_lost_tree(tiny, three, tmp_path):
    run_dir = old_named(three, tmp_path)
    results = (run_dir / "results.jsonl").read_bytes()
    proc = solve(tiny, run_dir, f"data.path={three.parent / 'data.jsonl'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = [line for line in (proc.stdout + proc.stderr).splitlines() if "is solved again" in line]
    assert len(again) == 1 and "problem a/1 is solved again" in again[0]
    assert (run_dir / "results.jsonl").read_bytes().startswith(results)
    assert [r["id"] for r in records(run_dir)] == [*IDS, "a/1"]
    assert (run_dir / "trees" / "a%2F1.json").is_file() and not (run_dir / "trees" / "b%20c.json").exists()


# ----------------------------------------------------------------------------- selections


def test_an_offset_past_the_end_is_refused(tiny, tmp_path):
    path = data_file(tmp_path, IDS)
    run_dir = tmp_path / "run"
    line = one_error_line(solve(tiny, run_dir, f"data.path={path}", "data.offset=3", "data.limit=2"))
    assert line == (
        f"error: data.offset=3 data.limit=2 selects no problem of data file {path} (3 problems); "
        "give data.offset below 3"
    )
    assert nothing_written(run_dir)


def test_a_shard_left_empty_by_its_sweep_says_so_and_writes_an_empty_summary(tiny, tmp_path):
    path = data_file(tmp_path, IDS[:2])
    run_dir = tmp_path / "runs" / "shard3"
    proc = solve(tiny, run_dir, f"data.path={path}", "data.shard=3", "data.num_shards=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "gets no problem" in line]
    assert len(said) == 1 and "data.shard=3 of data.num_shards=4 gets no problem" in said[0]
    assert json.loads((run_dir / "summary.json").read_text())["n_problems"] == 0
    assert (run_dir / "results.jsonl").read_text() == "" and not list(run_dir.glob("trees/*"))
    collected = command("tot.collect", str(tmp_path / "runs"))  # the sweep's other shards collect beside it
    assert collected.returncode == 0, collected.stderr[-3000:]


def test_a_rerun_with_a_smaller_selection_keeps_the_folders_summary(tiny, three, tmp_path):
    run_dir = copy_of(three, tmp_path)
    results = (run_dir / "results.jsonl").read_bytes()
    summary = json.loads((run_dir / "summary.json").read_text())
    proc = solve(tiny, run_dir, f"data.path={three.parent / 'data.jsonl'}", "data.limit=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "results.jsonl").read_bytes() == results  # nothing solved
    after = json.loads((run_dir / "summary.json").read_text())
    assert after["n_problems"] == 3 and after["accuracy"] == summary["accuracy"]
    assert after["generated_tokens"] == summary["generated_tokens"]
