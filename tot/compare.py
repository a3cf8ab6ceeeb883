"""`python -m tot.compare RUN_A RUN_B`: are two runs' reasoning trees identical?

Two decoders given the same problems, seed and temperature 0 must build the same trees (the
lossless invariant); this names each problem where they differ and the first differing node.
Exit status 0 when every common problem's tree is identical, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tot.runs.results import ResultsError
from tot.runs.saved import ShowError, problems, read_tree
from tot.search.tree import ReasoningTree

COMPARED = ("text", "value", "depth", "chosen", "answer")


def first_difference(a: ReasoningTree, b: ReasoningTree) -> str | None:
    """Where two trees differ (node and field), or None when they are the same tree."""
    if sorted(a.graph.edges) != sorted(b.graph.edges):
        return "different tree shapes (other states were kept and expanded)"
    for node in sorted(a.graph.nodes):
        for key in COMPARED:
            va, vb = getattr(a[node], key), getattr(b[node], key)
            if va != vb:
                return f"node {node} {key}: {str(va)[:60]!r} vs {str(vb)[:60]!r}"
    return None


def compare_runs(run_a: Path, run_b: Path) -> tuple[int, list[str]]:
    """(number of problems compared, descriptions of the differing ones). Problems are matched by
    id, not by file name: a folder written before tree files had their names of now still matches."""
    trees_a = {p.id: p.tree_path for p in problems(run_a)}
    trees_b = {p.id: p.tree_path for p in problems(run_b)}
    common = sorted(trees_a.keys() & trees_b.keys())
    diffs = []
    for pid in common:
        where = first_difference(read_tree(trees_a[pid]), read_tree(trees_b[pid]))
        if where:
            diffs.append(f"{pid}: {where}")
    return len(common), diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    args = parser.parse_args(argv)
    for run in (args.run_a, args.run_b):
        if not (run / "trees").is_dir():
            print(f"error: {run} has no trees/ folder; give a run directory of python -m tot.solve", file=sys.stderr)
            return 2
    try:
        n, diffs = compare_runs(args.run_a, args.run_b)
    except (ShowError, ResultsError) as e:  # a tree or a results.jsonl that cannot be read
        print(f"error: {e}", file=sys.stderr)
        return 2
    if n == 0:
        print("error: the two runs have no problem in common", file=sys.stderr)
        return 2
    for d in diffs:
        print(f"DIFFERENT {d}")
    print(f"{n - len(diffs)}/{n} trees identical")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
