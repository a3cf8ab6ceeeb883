"""`python -m tot.show RUN_DIR [--id ID] [--html | --memory]`: a run's reasoning trees as indented text and
as PNG images, or as one interactive page (--html, tot/show_html.py), or its memory over the run
(--memory, tot/memory_curve.py).

From a notebook: `load_tree(run_dir, id)`, then `render_text(tree)` for the text and `draw(tree)` for
the figure (matplotlib, the `plots` extra); `layout(tree)` gives the node positions `draw` uses.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from decoding import OutputError
from tot.runs.results import ResultsError
from tot.runs.saved import SavedTree, ShowError, find_problem, problems, read_tree
from tot.runs.saved import load_tree as load_tree  # notebooks read a tree with it
from tot.search.tree import ReasoningTree

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LEGEND = "legend: [n] node, v= the evaluator's value (- none), * kept by the search, => on the final answer's path"
MATPLOTLIB_HINT = "pip install matplotlib (or the project's plots extra: pip install -e '.[plots]')"
CHOSEN, ANSWER = "*", "=>"
LABEL_CHARS, LABEL_LINE = 30, 16  # the thought's start shown in an image's node box, wrapped to 2 lines
ANSWER_EDGE = "tab:blue"


# ----------------------------------------------------------------------------- text


def _children(tree: ReasoningTree) -> dict[int, list[int]]:
    return {n: sorted(tree.graph.successors(n)) for n in tree.graph.nodes}


def _roots(tree: ReasoningTree) -> list[int]:
    # Node 0 in every saved tree; any other parentless node is drawn too rather than silently lost.
    return sorted(n for n in tree.graph.nodes if tree.graph.in_degree(n) == 0)


def _walk(tree: ReasoningTree) -> Iterator[tuple[int, str]]:
    """(node, the box-drawing prefix of its line) in depth-first order."""
    children = _children(tree)
    stack = [(r, "", "") for r in reversed(_roots(tree))]
    while stack:  # explicit stack: no recursion limit however deep a search went
        node, own, below = stack.pop()
        yield node, own
        kids = children[node]
        for i, kid in reversed(list(enumerate(kids))):
            last = i == len(kids) - 1
            stack.append((kid, below + ("└─ " if last else "├─ "), below + ("   " if last else "│  ")))


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    return f"{float(value):.1f}" if _is_number(value) else str(value)


def clip(text: str, width: int) -> str:
    """The text on one line (whitespace runs collapsed), at most width characters, '...' where cut."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= width else flat[: max(width - 3, 0)] + "..."


def render_text(tree: ReasoningTree, width: int = 100, legend: bool = True) -> str:
    """The tree indented with box-drawing lines, one line per node: number, value, markers, thought."""
    lines = [LEGEND] if legend else []
    for node, prefix in _walk(tree):
        thought = tree[node]
        marks = f"{CHOSEN if thought.chosen else ' '} {ANSWER if thought.answer else '  '}"
        value = format_value(thought.value).ljust(4)  # markers in one column for values up to 99.9
        lines.append(f"{prefix}[{node}] v={value} {marks} {clip(thought.text, width)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- image


def layout(tree: ReasoningTree) -> dict[int, tuple[float, float]]:
    """Top-down positions: leaves at x = 0, 1, 2, ... left to right, each parent centred over its
    children, y = -depth. Subtrees own disjoint x ranges, so nodes of one depth never share an x."""
    children = _children(tree)
    pos: dict[int, tuple[float, float]] = {}
    next_leaf = 0
    stack = [(r, 0, False) for r in reversed(_roots(tree))]
    while stack:
        node, depth, placed_children = stack.pop()
        kids = children[node]
        if not kids:
            pos[node] = (float(next_leaf), float(-depth))
            next_leaf += 1
        elif placed_children:
            pos[node] = ((pos[kids[0]][0] + pos[kids[-1]][0]) / 2, float(-depth))
        else:
            stack.append((node, depth, True))
            stack.extend((k, depth + 1, False) for k in reversed(kids))
    return pos


def _label(tree: ReasoningTree, node: int) -> str:
    snippet = clip(tree[node].text, LABEL_CHARS)
    wrapped = textwrap.wrap(snippet, LABEL_LINE, max_lines=2, placeholder="...") or [""]
    return "\n".join([f"{node}  v={format_value(tree[node].value)}", *wrapped])


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(f"drawing a tree needs matplotlib: {MATPLOTLIB_HINT}") from e
    return plt


def figure_size(pos: dict[int, tuple[float, float]]) -> tuple[float, float]:
    # About an inch per leaf and per level keeps a 2-line label box clear of its neighbours.
    leaves = max(x for x, _ in pos.values()) + 1
    levels = -min(y for _, y in pos.values()) + 1
    return min(max(1.2 * leaves + 1.5, 6.0), 120.0), max(1.2 * levels + 1.0, 3.0)


def draw(tree: ReasoningTree, ax: Axes | None = None, title: str | None = None) -> Figure:
    """The tree as boxes coloured by value (colorbar), kept nodes outlined, the answer's path in bold
    blue; into ax when given, else a new figure sized to the tree. Returns the figure."""
    plt = _pyplot()
    from matplotlib.colors import Normalize
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    pos = layout(tree)
    if ax is None:
        _, ax = plt.subplots(figsize=figure_size(pos))
    fig = ax.get_figure(root=True)
    assert fig is not None, "an axes drawn on belongs to a figure"
    for u, v in tree.graph.edges:
        on_path = bool(tree[u].answer and tree[v].answer)
        (x0, y0), (x1, y1) = pos[u], pos[v]
        ax.plot(
            [x0, x1],
            [y0, y1],
            color=ANSWER_EDGE if on_path else "0.7",
            linewidth=3.0 if on_path else 1.0,
            zorder=2 if on_path else 1,
        )

    values = [float(t.value) for t in tree.thoughts.values() if _is_number(t.value)]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    norm = Normalize(lo - 0.5, hi + 0.5) if lo == hi else Normalize(lo, hi)
    cmap = plt.get_cmap("RdYlGn")
    for node, (x, y) in pos.items():
        value = tree[node].value
        face = cmap(norm(float(value))) if _is_number(value) else (0.92, 0.92, 0.92, 1.0)
        chosen = bool(tree[node].chosen)
        # The colormap's dark ends (the best and worst values) would hide black text.
        dark = 0.299 * face[0] + 0.587 * face[1] + 0.114 * face[2] < 0.45
        ax.text(
            x,
            y,
            _label(tree, node),
            ha="center",
            va="center",
            fontsize=7,
            color="white" if dark else "black",
            zorder=3,
            bbox={
                "boxstyle": "round,pad=0.3",
                "facecolor": face,
                "edgecolor": "black" if chosen else "0.6",
                "linewidth": 2.0 if chosen else 0.6,
            },
        )

    xs = [x for x, _ in pos.values()]
    ys = [y for _, y in pos.values()]
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_ylim(min(ys) - 0.6, max(ys) + 0.6)
    ax.axis("off")
    if values:
        width = fig.get_size_inches()[0]
        sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
        # A fixed share of a 100-leaf figure would be a metre wide: keep the bar about 0.25 inch.
        fig.colorbar(sm, ax=ax, fraction=min(0.05, 0.25 / width), pad=0.01, label="value")
    handles = [
        Line2D([], [], color=ANSWER_EDGE, linewidth=3.0, label="answer path"),
        Patch(facecolor="white", edgecolor="black", linewidth=2.0, label="kept by the search"),
        Patch(facecolor="0.92", edgecolor="0.6", label="no value"),
    ]
    # Below the tree, where no node can be: the root of a one-path tree sits at the upper left.
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    return fig


# ----------------------------------------------------------------------------- command line


def image_paths(shown: list[SavedTree], out: Path | None) -> list[Path]:
    """Where each tree's PNG goes: beside its JSON, or --out (a .png file for one tree, else a folder)."""
    if out is None:
        return [p.tree_path.with_suffix(".png") for p in shown]
    if out.suffix.lower() == ".png":
        if len(shown) != 1:
            raise ShowError(f"--out {out} is one image but {len(shown)} trees are shown; add --id ID or give a folder")
        return [out]
    return [out / p.tree_path.with_suffix(".png").name for p in shown]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="output directory of python -m tot.solve")
    parser.add_argument("--id", help="show only this problem (default: every problem of the run)")
    parser.add_argument("--width", type=int, default=100, help="characters of each thought shown (default 100)")
    parser.add_argument("--no-image", action="store_true", help="print the text only, write no PNG")
    parser.add_argument("--out", type=Path, help="PNG path for one tree, or a folder (default RUN_DIR/trees/)")
    parser.add_argument(
        "--html",
        action="store_true",
        help="write one page with every tree instead (--out: its path; default RUN_DIR/trees.html)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="print the run's memory as each problem finished and plot it (--out: PNG; default RUN_DIR/memory.png)",
    )
    args = parser.parse_args(argv)
    if args.width < 4:
        parser.error(f"--width {args.width} is too small; give at least 4")
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="replace")  # a terminal without UTF-8 gets '?' for the tree lines
    try:  # ResultsError: a results.jsonl damaged in the middle
        if args.memory:
            return _memory(args.run_dir, args.out, not args.no_image)
        shown = [find_problem(args.run_dir, args.id)] if args.id is not None else problems(args.run_dir)
        if args.html:
            return _html(args.run_dir, shown, args.out)
        images = [] if args.no_image else image_paths(shown, args.out)
    except (ShowError, ResultsError, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    try:
        unreadable = print_trees(shown, images, args.width)
    except BrokenPipeError:
        # The reader left (`| head`): stop quietly, and keep Python's exit flush from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return name_unreadable(unreadable)


def name_unreadable(unreadable: list[str]) -> int:
    """One line for each tree that could not be read; exit status 2 where there was one."""
    for line in unreadable:
        print(f"error: {line}", file=sys.stderr)
    return 2 if unreadable else 0


def _memory(run_dir: Path, out: Path | None, image: bool) -> int:
    from tot.memory_curve import draw_memory, memory_rows, memory_table

    rows = memory_rows(run_dir)
    print(memory_table(rows))
    if image:
        try:
            plt = _pyplot()
        except ImportError:
            print(f"plot skipped: matplotlib is not installed; {MATPLOTLIB_HINT} enables it")
            return 0
        print(f"plot: {draw_memory(rows, out or run_dir / 'memory.png', plt)}")
    return 0


def _html(run_dir: Path, shown: list[SavedTree], out: Path | None) -> int:
    from tot.show_html import write_page

    if out is not None and out.suffix.lower() != ".html":
        raise ShowError(f"--out {out} is not an .html file; give e.g. --out trees.html")
    page, unreadable = write_page(run_dir, shown, out or run_dir / "trees.html")
    print(f"page: {page} ({len(shown) - len(unreadable)} trees; open it in a browser, it needs no network)")
    return name_unreadable(unreadable)


def print_trees(shown: list[SavedTree], images: list[Path], width: int) -> list[str]:
    """Print each problem's header and tree; write images[i] for shown[i] when images are asked for.
    Returns why each tree that could not be read was skipped."""
    plt = None
    if images:
        try:
            import matplotlib

            matplotlib.use("Agg")  # files only: no display needed, none opened
            plt = _pyplot()
        except ImportError:
            print(f"images skipped: matplotlib is not installed; {MATPLOTLIB_HINT} enables them")
    print(LEGEND)
    unreadable = []
    for i, saved in enumerate(shown):
        try:
            tree = read_tree(saved.tree_path)
        except ShowError as e:
            unreadable.append(str(e))
            continue
        print()
        print(saved.header(tree))
        print(render_text(tree, width, legend=False))
        if plt is not None:
            images[i].parent.mkdir(parents=True, exist_ok=True)
            fig = draw(tree, title=saved.header(tree))
            fig.savefig(images[i], dpi=110, bbox_inches="tight")
            plt.close(fig)  # one figure per problem: without closing, a long run's figures pile up
            print(f"image: {images[i]}")
    return unreadable


if __name__ == "__main__":
    sys.exit(main())
