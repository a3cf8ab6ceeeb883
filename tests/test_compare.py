"""tot.compare: identical trees pass, any differing node is named, bad input exits 2."""

from __future__ import annotations

from pathlib import Path

from tot.compare import main
from tot.runs.saved import save_tree
from tot.search.tree import ReasoningTree


def _tree(texts: list[str], chosen: int = 1) -> ReasoningTree:
    tree = ReasoningTree("q")
    for t in texts:
        node = tree.add(tree.root, t)
        tree[node].value = 5.0
    tree[chosen].chosen = True
    tree.mark_answer(chosen)
    return tree


def _run(tmp: Path, name: str, trees: dict[str, ReasoningTree]) -> Path:
    run = tmp / name
    for pid, tree in trees.items():
        save_tree(tree, run / "trees" / f"{pid}.json")
    return run


def test_identical_runs_exit_zero(tmp_path: Path, capsys) -> None:
    a = _run(tmp_path, "a", {"p1": _tree(["x", "y"]), "p2": _tree(["z"])})
    b = _run(tmp_path, "b", {"p1": _tree(["x", "y"]), "p2": _tree(["z"])})
    assert main([str(a), str(b)]) == 0
    assert "2/2 trees identical" in capsys.readouterr().out


def test_text_or_choice_difference_is_named(tmp_path: Path, capsys) -> None:
    a = _run(tmp_path, "a", {"p1": _tree(["x", "y"]), "p2": _tree(["z", "w"])})
    b = _run(tmp_path, "b", {"p1": _tree(["x", "Y"]), "p2": _tree(["z", "w"], chosen=2)})
    assert main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT p1: node 2 text" in out
    assert "DIFFERENT p2: node 1 chosen" in out
    assert "0/2 trees identical" in out


def test_not_a_run_directory_exits_two(tmp_path: Path, capsys) -> None:
    a = _run(tmp_path, "a", {"p1": _tree(["x"])})
    assert main([str(a), str(tmp_path / "missing")]) == 2
    assert "has no trees/ folder" in capsys.readouterr().err
