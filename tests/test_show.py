"""tot.show on a hand-built tree saved as a fake run directory: text, layout, image, the CLI's errors."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tot.runs.results import ResultStore, tree_file
from tot.runs.saved import save_tree
from tot.search.tree import ReasoningTree
from tot.show import ANSWER, CHOSEN, clip, layout, load_tree, main, render_text

REPO = Path(__file__).resolve().parents[1]
PROBLEM_ID = "gsm8k/7 b"  # '/' and ' ' are %-encoded in the tree's file name
LONG = "Sub-question 1: how many eggs are left?\nAnswer 1: 16 - 3 - 4 = 9 eggs are left over " + "x" * 60
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def build_tree() -> tuple[ReasoningTree, set[int]]:
    """Root, 3 thoughts, 2 of node 1's children, 1 grandchild; the answer is node 6 (0 -> 1 -> 4 -> 6)."""
    tree = ReasoningTree("Janet's ducks lay 16 eggs per day.\nHow much does she make?")
    a = tree.add(0, LONG)
    b = tree.add(0, "Sub-question 1: what is the price?")
    tree.add(0, "an unevaluated thought")
    d = tree.add(a, "Sub-question 2: how many are sold?", evaluation="8", subtree=1)
    e = tree.add(a, "Sub-question 2: what does she earn?")
    f = tree.add(e, "The answer is 18", terminal=True)
    for node, value in ((a, 8.0), (b, 3.0), (d, 2.0), (e, 9.0), (f, 10.0)):
        tree[node].value = value
    for node in (a, e, f):
        tree[node].chosen = True
    tree.mark_answer(f)
    return tree, {0, a, e, f}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    tree, _ = build_tree()
    store = ResultStore(tmp_path / "run")
    save_tree(tree, store.tree_path(PROBLEM_ID))
    store.append({"id": PROBLEM_ID, "answer": "18", "correct": True, "wall_s": 1.0, "phases": {}})
    return tmp_path / "run"


def node_lines(text: str) -> dict[int, str]:
    """Each node's line of render_text, by node number."""
    lines = {}
    for line in text.splitlines()[1:]:  # after the legend
        number = line[line.index("[") + 1 : line.index("]")]
        lines[int(number)] = line
    return lines


def test_tree_file_matches_result_store(tmp_path: Path):
    assert tree_file(tmp_path, PROBLEM_ID) == ResultStore(tmp_path).tree_path(PROBLEM_ID)


def test_render_text_lines_values_and_markers():
    tree, answer_path = build_tree()
    text = render_text(tree, width=40)
    lines = node_lines(text)
    assert sorted(lines) == sorted(tree.graph.nodes)
    for node, line in lines.items():
        shown = clip(tree[node].text, 40)
        assert line.endswith(shown)
        assert len(shown) <= 40
        value = tree[node].value
        assert f"v={value:.1f}" in line if value is not None else "v=-" in line
        assert (f" {ANSWER} " in line) == (node in answer_path)
        assert (f" {CHOSEN} " in line) == bool(tree[node].chosen)
    cut = "Sub-question 1: how many eggs are lef"
    assert len(cut) == 37 and lines[1].endswith(cut + "...")  # 40 characters in all, the cut marked
    assert "left? Answer 1: 16 - 3" in render_text(tree, width=200)  # the newline collapsed, nothing cut
    assert "x" * 60 in render_text(tree, width=200)
    assert lines[5].endswith("Sub-question 2: what does she earn?")  # short text kept whole
    assert text.splitlines()[0].startswith("legend:")
    assert lines[4].startswith("│  ├─ ") and lines[6].startswith("│     └─ ") and lines[3].startswith("└─ ")


def test_layout_children_below_parents_and_distinct_x():
    tree, _ = build_tree()
    pos = layout(tree)
    assert set(pos) == set(tree.graph.nodes)
    for parent, child in tree.graph.edges:
        assert pos[child][1] < pos[parent][1]
    by_depth: dict[float, list[float]] = {}
    for x, y in pos.values():
        by_depth.setdefault(y, []).append(x)
    assert all(len(xs) == len(set(xs)) for xs in by_depth.values())
    assert len(by_depth) == 4  # depths 0..3, one y each


def test_load_tree_round_trip(run_dir: Path):
    tree = load_tree(run_dir, PROBLEM_ID)
    assert render_text(tree) == render_text(build_tree()[0])


def show(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, "-m", "tot.show", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        cwd=REPO,
        env=env,
        timeout=120,
    )


def test_cli_prints_tree_and_writes_png(run_dir: Path):
    result = show(str(run_dir), "--width", "30")
    assert result.returncode == 0, result.stderr
    assert f"problem {PROBLEM_ID}: answer=18 correct=True nodes=7" in result.stdout
    assert "[6] v=10.0 * => The answer is 18" in result.stdout
    assert "[3] v=-" in result.stdout
    png = run_dir / "trees" / "gsm8k%2F7%20b.png"
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"image: {png}" in result.stdout
    else:
        assert "pip install matplotlib" in result.stdout


def test_cli_one_id_to_out_path_and_no_image(run_dir: Path, tmp_path: Path):
    out = tmp_path / "one.png"
    result = show(str(run_dir), "--id", PROBLEM_ID, "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.exists() == HAS_MATPLOTLIB
    result = show(str(run_dir), "--no-image")
    assert result.returncode == 0 and "image" not in result.stdout
    assert not (run_dir / "trees" / "gsm8k%2F7%20b.png").exists()


def test_without_matplotlib_text_and_one_line(run_dir: Path, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import matplotlib` raise ImportError
    assert main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "[6] v=10.0 * => The answer is 18" in out
    assert [line for line in out.splitlines() if "pip install matplotlib" in line] == [out.splitlines()[0]]
    assert not list((run_dir / "trees").glob("*.png"))


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--id", "nope"], "'nope'"),
        (["--id", "nope", "--no-image"], PROBLEM_ID),  # the available ids are listed
    ],
)
def test_cli_unknown_id(run_dir: Path, args: list[str], named: str):
    result = show(str(run_dir), *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and named in result.stderr
    assert result.stdout == ""


def test_cli_missing_dir_and_dir_without_trees(tmp_path: Path):
    for bad in (tmp_path / "missing", tmp_path):
        result = show(str(bad))
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1 and str(bad) in result.stderr


def test_memory_curve_of_a_run(loaded, tmp_path: Path, capsys):
    """`--memory`: the store, the pool and resident memory as each problem finished, as a table and
    a PNG; a run without memory figures (a server's, or an old one) is one line, exit 2."""
    from test_run import make_config

    from decoding.api.engine import Engine
    from tot.runs.run import run

    out = tmp_path / "run"
    cfg = make_config("data.limit=3", "task.depth=2", "gen.max_thought_tokens=5", "gen.max_eval_tokens=3")
    run(cfg, out, engine=Engine(loaded, "ar"), progress=False)
    assert main([str(out), "--memory", "--out", str(tmp_path / "memory.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| problem | id | stored prefixes (MB)") and len(lines) == 2 + 3 + 1
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.jsonl").write_text('{"id": "a", "correct": false, "wall_s": 0, "phases": {}}\n')
    assert main([str(tmp_path / "old"), "--memory"]) == 2
    assert "no records with memory figures" in capsys.readouterr().err
