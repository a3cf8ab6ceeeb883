"""`python -m tot.collect SWEEP_DIR`: one table from every run under a folder.

For Hydra sweeps (`python -m tot.solve -m ...`, one run per subfolder) and for sharded runs spread
over machines (`data.shard=i data.num_shards=k`, their folders copied under one root): prints a
markdown table, one row per run, and writes it to SWEEP_DIR/collected.md and collected.json. The
runs of one configuration (the fingerprint in their configuration.json), such as the shards of one
job, are combined into one row, each problem counted once (a problem found in two of them is
reported); runs of different configurations stay in different rows. Rows are computed from each
run's results.jsonl, read and never rewritten; a collection with fewer problems of a configuration
than the collected.json it would replace is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from decoding import OutputError
from tot.folder import SELECTION, read_record
from tot.output import write_atomic
from tot.results import ResultsError, summarize
from tot.saved import ShowError, read_json, read_records

COLUMNS = (
    "run",
    "configuration",
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
HEADER = ("task", "search", "decoder", "model")


class CollectError(ValueError):
    """A folder that cannot be collected as it stands: one line naming it and the fix."""


@dataclass(frozen=True)
class Run:
    name: str  # its folder, relative to the root
    configuration: str  # the fingerprint of its configuration
    header: dict  # task, search, decoder, model
    records: list[dict]  # the latest record of each of its problems


def find_runs(root: Path) -> list[Run]:
    runs = []
    for path in sorted(root.rglob("summary.json")):
        folder = path.parent
        name = str(folder.relative_to(root)) or "."
        summary = read_json(path)
        if not (folder / "results.jsonl").is_file():
            raise CollectError(
                f"{folder} has a summary.json but no results.jsonl to count its problems from; restore it, or "
                f"move that run out of {root}"
            )
        runs.append(Run(name, fingerprint(folder, summary), {k: summary.get(k) for k in HEADER}, read_records(folder)))
    return runs


def fingerprint(folder: Path, summary: dict) -> str:
    """The run's configuration: its configuration.json, else (a run made before there was one) a
    fingerprint of the settings its summary.json records, the selection left out."""
    recorded = read_record(folder)
    if recorded is not None:
        return recorded.fingerprint
    config = dict(summary.get("config") or {})
    config.pop("concurrency", None)
    data = {k: v for k, v in (config.pop("data", None) or {}).items() if f"data.{k}" not in SELECTION}
    text = json.dumps({**config, "data": data}, sort_keys=True, default=str)
    return "legacy-" + hashlib.sha256(text.encode()).hexdigest()[:9]


def collect(root: Path, report: Callable[[str], None] = print) -> tuple[list[dict], list[dict]]:
    """One row per run, and one per configuration (its runs' problems, each counted once)."""
    runs = find_runs(root)
    rows = [row(r.name, r, r.records) for r in runs]
    combined = []
    for config in dict.fromkeys(r.configuration for r in runs):
        members = [r for r in runs if r.configuration == config]
        kept: dict[str, dict] = {}
        where: dict[str, list[str]] = {}
        for r in members:
            for rec in r.records:
                kept.setdefault(rec["id"], rec)
                where.setdefault(rec["id"], []).append(r.name)
        twice = sorted(pid for pid, names in where.items() if len(names) > 1)
        if twice:
            runs_named = sorted({n for pid in twice for n in where[pid]})
            report(
                f"configuration {config}: {len(twice)} problem(s) in more than one run ({', '.join(twice[:5])}"
                f"{', ...' if len(twice) > 5 else ''}; in {', '.join(runs_named[:5])}): each counted once"
            )
        combined.append(row(f"{len(members)} run(s)", members[0], list(kept.values())))
    return rows, combined


def row(name: str, run: Run, records: list[dict]) -> dict:
    s = summarize(records, run.header)
    return {
        "run": name,
        "configuration": run.configuration,
        **{k: s.get(k) for k in COLUMNS[2:]},
        "n_correct": s["n_correct"],
        "model": s.get("model"),
    }


def check_not_fewer(root: Path, combined: list[dict]) -> None:
    """Refuse to replace a collection with one that counts fewer problems of a configuration."""
    path = root / "collected.json"
    if not path.is_file():
        return
    before = {r.get("configuration", "?"): r.get("n_problems") or 0 for r in read_json(path).get("combined", [])}
    now = {r["configuration"]: r["n_problems"] for r in combined}
    for config, n in before.items():
        if now.get(config, 0) < n:
            raise CollectError(
                f"{path} counts {n} problems of configuration {config}, the runs under {root} now "
                f"{now.get(config, 0)}; restore the missing runs, or delete {path} to collect what is there"
            )


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
    try:
        rows, combined = collect(args.root)
        if not rows:
            raise CollectError(f"no summary.json under {args.root}; give the folder of finished tot.solve runs")
        check_not_fewer(args.root, combined)
        text = markdown(rows) + "\n\nCombined by configuration, each problem once:\n\n" + markdown(combined)
        print(text)
        write_atomic(args.root / "collected.md", text + "\n")
        write_atomic(args.root / "collected.json", json.dumps({"runs": rows, "combined": combined}, indent=2) + "\n")
    except (CollectError, ResultsError, ShowError, OutputError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
