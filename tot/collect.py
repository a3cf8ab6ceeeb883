"""`python -m tot.collect SWEEP_DIR`: one table from every run under a folder.

For Hydra sweeps (`python -m tot.solve -m ...`, one run per subfolder) and for sharded runs spread
over machines (`data.shard=i data.num_shards=k`, their folders copied under one root): prints a
markdown table, one row per run, and writes it to SWEEP_DIR/collected.md and collected.json. The
runs of one configuration (the fingerprint in their configuration.json), such as the shards of one
job, are combined into one row, each problem counted once (a problem found in two of them is
reported); runs of different configurations stay in different rows. Rows are computed from each
run's results.jsonl, read and never rewritten; a collection with fewer problems of a configuration
than the collected.json it would replace is refused.

Each row gives its accuracy's 95% (Wilson) interval and its tokens and wall time per problem; with
`--baseline RUN` (a run folder, such as one greedy chain of thought) also, over the problems both
solved or failed, how many only the row solves, how many only the baseline, and the exact two-sided
p-value of that split (McNemar's test): whether the difference is beyond chance on the same problems.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decoding import OutputError
from tot.runs.folder import SELECTION, read_record
from tot.runs.output import write_atomic
from tot.runs.results import ResultsError, summarize
from tot.runs.saved import ShowError, read_json, read_records

COLUMNS = (
    "run",
    "configuration",
    "task",
    "search",
    "decoder",
    "n_problems",
    "accuracy",
    "accuracy_95",
    "tokens_per_problem",
    "wall_s_per_problem",
    "generated_tokens",
    "wall_s",
    "tokens_per_s",
    "acceptance_length",
    "forwards_per_token",
)
PAIRED = ("paired_problems", "only_this", "only_baseline", "paired_p")
HEADER = ("task", "search", "decoder", "model")


class CollectError(ValueError):
    """A folder that cannot be collected as it stands: one line naming it and the fix."""


@dataclass(frozen=True)
class Run:
    name: str  # its folder, relative to the root
    configuration: str  # the fingerprint of its configuration
    header: dict[str, Any]  # task, search, decoder, model
    records: list[dict[str, Any]]  # the latest record of each of its problems


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


def fingerprint(folder: Path, summary: dict[str, Any]) -> str:
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


@dataclass(frozen=True)
class Baseline:
    """A run each row is paired with (--baseline): its folder, task and latest records."""

    folder: Path
    task: str | None
    records: list[dict[str, Any]]


def read_baseline(folder: Path) -> Baseline:
    if not (folder / "results.jsonl").is_file():
        raise CollectError(f"--baseline {folder} holds no results.jsonl; give a tot.solve run folder")
    summary = folder / "summary.json"
    recorded = read_record(folder)
    if summary.is_file():
        task = read_json(summary).get("task")
    else:
        task = recorded.settings.get("task.name") if recorded is not None else None
    return Baseline(folder, task, read_records(folder))


def collect(
    root: Path, report: Callable[[str], None] = print, baseline: Baseline | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One row per run, and one per configuration (its runs' problems, each counted once); each against
    the baseline's records where given (a run of the same task: pairing another task's problems by id
    would compare unrelated problems)."""
    runs = find_runs(root)
    if baseline is not None:
        for r in runs:
            if baseline.task and r.header.get("task") and r.header["task"] != baseline.task:
                raise CollectError(
                    f"run {r.name} is task={r.header['task']}, the baseline {baseline.folder} task={baseline.task}: "
                    "give a baseline of the runs' task, or collect the runs of each task apart"
                )
    rows = [row(r.name, r, r.records, baseline) for r in runs]
    if baseline is not None:
        for made in rows:
            if not made["paired_problems"]:
                report(
                    f"run {made['run']} shares no problem with the baseline {baseline.folder}: no paired comparison "
                    "(give a baseline run over the same problems: its task, data.path and selection)"
                )
    combined = []
    for config in dict.fromkeys(r.configuration for r in runs):
        members = [r for r in runs if r.configuration == config]
        kept: dict[str, dict[str, Any]] = {}
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
        combined.append(row(f"{len(members)} run(s)", members[0], list(kept.values()), baseline))
    return rows, combined


def row(name: str, run: Run, records: list[dict[str, Any]], baseline: Baseline | None = None) -> dict[str, Any]:
    s = summarize(records, run.header)
    n = s["n_problems"]
    low, high = wilson(s["n_correct"], n)
    s |= {
        "accuracy_95": f"[{low:.3f}, {high:.3f}]",
        "tokens_per_problem": s["generated_tokens"] / n if n else 0.0,
        "wall_s_per_problem": s["wall_s"] / n if n else 0.0,
    }
    out = {
        "run": name,
        "configuration": run.configuration,
        **{k: s.get(k) for k in COLUMNS[2:]},
        "n_correct": s["n_correct"],
        "model": s.get("model"),
    }
    return out | (paired(records, baseline.records) if baseline is not None else {})


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of k successes in n."""
    if n == 0:
        return 0.0, 0.0
    p = k / n
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


def paired(records: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    """The row against the baseline on the problems both have: how many only each solves, and the exact
    two-sided McNemar p-value (the discordant problems split as a fair coin would split them)."""
    base = {r["id"]: bool(r["correct"]) for r in baseline}
    both = [(bool(r["correct"]), base[r["id"]]) for r in records if r["id"] in base]
    this = sum(a and not b for a, b in both)
    other = sum(b and not a for a, b in both)
    k, m = min(this, other), this + other
    p = min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2**m) if m else 1.0
    # No p-value over no pairs: nothing was compared.
    return {"paired_problems": len(both), "only_this": this, "only_baseline": other, "paired_p": p if both else None}


def check_not_fewer(root: Path, combined: list[dict[str, Any]]) -> None:
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


def markdown(rows: list[dict[str, Any]]) -> str:
    columns = COLUMNS + (PAIRED if rows and PAIRED[0] in rows[0] else ())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) else "n/a" if r[c] is None else str(r[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a sweep folder (multirun/<date>) or any folder of runs")
    parser.add_argument(
        "--baseline", type=Path, help="a run folder each row is compared with problem by problem (e.g. one chain)"
    )
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"error: {args.root} is not a folder; give a sweep folder such as multirun/<date>", file=sys.stderr)
        return 2
    try:
        baseline = read_baseline(args.baseline) if args.baseline is not None else None
        rows, combined = collect(args.root, baseline=baseline)
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
