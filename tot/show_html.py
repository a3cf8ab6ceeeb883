"""`python -m tot.show RUN_DIR --html`: one self-contained page with every problem's reasoning tree.

The page (the template tot/tree_page.html) carries the run's data as JSON and the script that draws
it: each problem's question, answer (and each extraction rule's), score and decode statistics, then
its tree as nested expandable nodes: the full thought, the model's reply where the thought was parsed
from it, the evaluator's outputs and the value; nodes the search kept and the answer's path are
marked, and the answer's path is open. No network: it opens from disk.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from tot.runs.output import write_atomic
from tot.runs.saved import SavedTree, ShowError, read_json, read_tree

# Record fields shown beside each tree (the rest of a record is the decode statistics per phase).
RECORD_KEYS = ("id", "question", "answer", "answers", "gold", "correct", "correct_by", "metrics", "tokens", "wall_s")
PHASE_KEYS = ("tokens", "engine_s", "calls", "decode_acceptance_length", "decode_rows_per_forward")
SUMMARY_KEYS: tuple[str, ...] = ("task", "search", "decoder", "model", "n_problems", "accuracy", "accuracy_by")
SUMMARY_KEYS += ("metrics", "generated_tokens", "wall_s", "tokens_per_s", "acceptance_length", "rows_per_forward")


def page_data(run_dir: Path, shown: list[SavedTree], unreadable: list[str]) -> dict[str, Any]:
    """The page's data: every tree that can be read; why each other one cannot goes to `unreadable`."""
    summary_path = run_dir / "summary.json"
    summary = read_json(summary_path) if summary_path.is_file() else {}
    problems = []
    for saved in shown:
        rec = saved.record or {"id": saved.id}
        try:
            tree = read_tree(saved.tree_path).to_dict()
        except ShowError as e:
            unreadable.append(str(e))
            continue
        problems.append(
            {
                **{k: rec[k] for k in RECORD_KEYS if k in rec},
                "phases": {p: {k: v[k] for k in PHASE_KEYS if k in v} for p, v in rec.get("phases", {}).items()},
                "tree": tree,
            }
        )
    return {"run": str(run_dir), "summary": {k: summary[k] for k in SUMMARY_KEYS if k in summary}, "problems": problems}


def render_page(data: dict[str, Any]) -> str:
    # No markup character may reach the script element ("</script>" ends it, "<!--" changes how it
    # ends): JSON's own escapes stand for them.
    payload = (
        json.dumps(data, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    )
    title = f"ToT trees: {data['summary'].get('task', '')} {data['summary'].get('decoder', '')} ({data['run']})"
    template = resources.files("tot").joinpath("tree_page.html").read_text(encoding="utf-8")
    return template.replace("__TITLE__", _escape(title)).replace("__DATA__", payload)


def write_page(run_dir: Path, shown: list[SavedTree], out: Path) -> tuple[Path, list[str]]:
    """The page written to `out`, and why each tree left out of it could not be read."""
    if out.is_dir():
        raise ShowError(f"--out {out} is a folder; give the page's file name, e.g. --out {out / 'trees.html'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    unreadable: list[str] = []
    write_atomic(out, render_page(page_data(run_dir, shown, unreadable)))
    return out, unreadable


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
