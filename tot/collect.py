"""`python -m tot.collect SWEEP_DIR`: one table from the summary.json of every run under a folder.

For Hydra sweeps (`python -m tot.solve -m ...`, one run per subfolder) and for sharded runs spread
over machines (`data.shard=i data.num_shards=k`, their folders copied under one root): prints a
markdown table, one row per run, and writes it to SWEEP_DIR/collected.md and collected.json.
Shards of one configuration are also summed into one row per (task, decoder, model).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from decoding.core.errors import OutputError
from tot.output import write_atomic
from tot.results import summarize, unique_records
from tot.saved import read_records

COLUMNS = (
    "run",
    "task",
    "search",
    "decoder",
    "n_problems",
    "accuracy",
    "generated_tokens",
    "wall_s",
    "tokens_per_s",
    "acceptance_length",
    "forwards_per_token",
)


def collect(root: Path, report: Callable[[str], None] = print) -> list[dict]:
    rows = []
    for path in sorted(root.rglob("summary.json")):
        s = json.loads(path.read_text())
        run = str(path.parent.relative_to(root)) or "."
        dropped = drop_duplicates(path.parent, s)
        if dropped:
            report(
                f"{run}: {len(dropped)} problem(s) written twice by two runs at once ({', '.join(dropped[:5])}"
                f"{', ...' if len(dropped) > 5 else ''}): counted once"
            )
        rows.append(
            {
                "run": run,
                **{k: s.get(k) for k in COLUMNS[1:]},
                "n_correct": s.get("n_correct", 0),
                "model": s.get("model"),
            }
        )
    return rows


def drop_duplicates(run_dir: Path, summary: dict) -> list[str]:
    """A folder two runs wrote at once (before runs locked their folders) holds some problems twice:
    `summary` is recomputed in place from the first record of each, and the duplicated ids returned."""
    records = read_records(run_dir)
    kept, dropped = unique_records(records)
    if dropped:
        summary.update(summarize(kept, summary))
    return dropped


def combine(rows: list[dict]) -> list[dict]:
    """Runs of one (task, search, decoder, model), such as the shards of one job, summed into one row."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r["task"], r["search"], r["decoder"], r["model"])
        g = groups.setdefault(
            key,
            {
                "task": r["task"],
                "search": r["search"],
                "decoder": r["decoder"],
                "model": r["model"],
                "runs": 0,
                "n_problems": 0,
                "n_correct": 0,
                "generated_tokens": 0,
                "wall_s": 0.0,
                "verify_steps": 0.0,
                "target_forwards": 0.0,
            },
        )
        g["runs"] += 1
        for k in ("n_problems", "n_correct", "generated_tokens", "wall_s"):
            g[k] += r[k] or 0
        tau = r.get("acceptance_length") or 0
        g["verify_steps"] += (r["generated_tokens"] or 0) / tau if tau else 0
        g["target_forwards"] += (r.get("forwards_per_token") or 0) * (r["generated_tokens"] or 0)
    out = []
    for g in groups.values():
        tokens = g["generated_tokens"]
        out.append(
            {
                "run": f"{g['runs']} run(s)",
                "task": g["task"],
                "search": g["search"],
                "decoder": g["decoder"],
                "n_problems": g["n_problems"],
                "accuracy": g["n_correct"] / g["n_problems"] if g["n_problems"] else 0.0,
                "generated_tokens": tokens,
                "wall_s": g["wall_s"],
                "tokens_per_s": tokens / g["wall_s"] if g["wall_s"] else 0.0,
                "acceptance_length": tokens / g["verify_steps"] if g["verify_steps"] else 0.0,
                "forwards_per_token": g["target_forwards"] / tokens if tokens else 0.0,
            }
        )
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a sweep folder (multirun/<date>) or any folder of runs")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"error: {args.root} is not a folder; give a sweep folder such as multirun/<date>", file=sys.stderr)
        return 2
    rows = collect(args.root)
    if not rows:
        print(f"error: no summary.json under {args.root}; give the folder of finished tot.solve runs", file=sys.stderr)
        return 2
    combined = combine(rows)
    text = markdown(rows) + "\n\nCombined by task, search, decoder and model:\n\n" + markdown(combined)
    print(text)
    try:
        write_atomic(args.root / "collected.md", text + "\n")
        write_atomic(args.root / "collected.json", json.dumps({"runs": rows, "combined": combined}, indent=2) + "\n")
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
