"""Run outputs: results.jsonl appended per finished problem, summary.json, trees/<id>.json (the id
encoded: tree_name).

A problem counts as done once its line is in results.jsonl and its tree can be read. Reading the
file never rewrites it: a last line cut short by a kill is ignored (with a warning) and cut off only
when the next record is appended, so the whole lines before a run stay a prefix of the file after it;
a line in the middle that is not a whole record is refused, naming the file and line. A problem that
is solved again (its tree was unreadable) appends a new record, and the latest record of a problem
is the one that counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from decoding import DecodeStats
from tasks.base import FullTask, Problem
from tot.runs.output import append_line, output_error

# What summarize and the tools read of every record; a line without them is not a record of tot.solve.
REQUIRED: dict[str, type | tuple[type, ...]] = {"id": str, "correct": bool, "wall_s": (int, float), "phases": dict}
FIX = "remove or repair that line (the other records are kept), then rerun"
MAX_NAME = 200  # characters of a tree file's name before .json: ASCII, within the usual 255-byte limit


class ResultsError(ValueError):
    """A results.jsonl that cannot be read as it stands: one line naming the file, the line and the fix."""


@dataclass
class Results:
    """What results.jsonl holds: every whole line's record in file order, and where a torn last line starts."""

    path: Path
    entries: list[dict[str, Any]] = field(default_factory=list)
    whole_bytes: int = 0  # the length of the whole lines: a torn last line starts here
    torn_line: int | None = None  # the number of a last line cut short, if there is one

    @property
    def latest(self) -> dict[str, dict[str, Any]]:
        """The latest record of each problem, in the order the problems first finished."""
        out: dict[str, dict[str, Any]] = {}
        for rec in self.entries:
            out[rec["id"]] = rec
        return out

    @property
    def redone(self) -> list[str]:
        """The problems with more than one record."""
        seen: set[str] = set()
        again: set[str] = set()
        for rec in self.entries:
            (again if rec["id"] in seen else seen).add(rec["id"])
        return sorted(again)


def read_results(path: Path, fingerprint: str | None = None) -> Results:
    """Read results.jsonl without changing it; ResultsError for a line in the middle that is not a
    whole record (of the configuration `fingerprint`, where given)."""
    results = Results(path)
    if not path.exists() and not path.is_symlink():
        return results
    if path.is_dir():
        raise ResultsError(
            f"{path} is a folder, not the run's results file; move it out of the way (or give this run "
            "another folder with hydra.run.dir=...)"
        )
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ResultsError(f"{path} cannot be read ({e.strerror or e}); make it readable, then rerun") from None
    lines = raw.split(b"\n")
    # The part after the last newline: empty, or a record cut short by a kill.
    if lines[-1]:
        results.torn_line = len(lines)
    results.whole_bytes = len(raw) - len(lines[-1])
    for number, line in enumerate(lines[:-1], 1):
        if line.strip():  # a blank line holds nothing to lose
            results.entries.append(parse_record(path, number, line, fingerprint))
    return results


def parse_record(path: Path, number: int, line: bytes, fingerprint: str | None) -> dict[str, Any]:
    where = f"{path}:{number}"
    try:
        rec = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8 text"
        raise ResultsError(f"{where}: not a JSON record ({reason}); {FIX}") from None
    if not isinstance(rec, dict):
        raise ResultsError(f"{where}: not a JSON object; {FIX}")
    wrong = [k for k, kind in REQUIRED.items() if not isinstance(rec.get(k), kind)]
    if wrong:
        raise ResultsError(f"{where}: not a whole record of tot.solve (no valid {', '.join(wrong)}); {FIX}")
    made = rec.get("configuration")
    if fingerprint is not None and made is not None and made != fingerprint:
        raise ResultsError(
            f"{where}: a record of configuration {made}, not this folder's {fingerprint} (configuration.json); {FIX}"
        )
    return rec


class ResultStore:
    """results.jsonl of a run folder: read once (never rewritten), appended to as problems finish."""

    def __init__(self, out_dir: Path, fingerprint: str | None = None) -> None:
        self.out_dir = out_dir
        self.path = out_dir / "results.jsonl"
        self.results = read_results(self.path, fingerprint)
        self._latest = self.results.latest

    @property
    def records(self) -> list[dict[str, Any]]:
        """The latest record of each problem."""
        return list(self._latest.values())

    def append(self, record: dict[str, Any]) -> None:
        if self.results.torn_line is not None:
            # The cut line goes before the first new one, or the new record would be glued to it.
            try:
                os.truncate(self.path, self.results.whole_bytes)
            except OSError as e:
                raise output_error(self.path, e) from None
            self.results.torn_line = None
        append_line(self.path, json.dumps(record))
        self._latest.pop(record["id"], None)  # the latest record of a problem comes last
        self._latest[record["id"]] = record

    def tree_path(self, problem_id: str) -> Path:
        return tree_file(self.out_dir, problem_id)


def tree_file(run_dir: Path, problem_id: str) -> Path:
    """Where a run writes a problem's tree."""
    return run_dir / "trees" / f"{tree_name(problem_id)}.json"


def tree_name(problem_id: str) -> str:
    """A tree's file name (without .json), one per id: letters, digits, '-', '_' and '.' as they are,
    every other character as the %XX of its UTF-8 bytes ('%' and '/' too), so 'a/1' and 'a_1' differ.
    A name too long for a file system (255 bytes) keeps its start and ends in '~' and a digest of
    the id: '~' is encoded everywhere else, so such a name is never another id's."""
    name = quote(problem_id, safe="").replace("~", "%7E")
    if len(name) <= MAX_NAME:
        return name
    return f"{name[: MAX_NAME - 65]}~{hashlib.sha256(problem_id.encode()).hexdigest()}"


def problem_of(name: str) -> str:
    """The id a tree file's name (without .json) stands for, where no record names it: tree_name
    undone (a name of before, or one cut for length, reads as itself)."""
    return unquote(name) if "~" not in name else name


def legacy_tree_file(run_dir: Path, problem_id: str) -> Path:
    """Where runs before tree_name wrote a tree: every character but [\\w.-] became '_', so that
    'a/1' and 'a_1' shared a file."""
    return run_dir / "trees" / (re.sub(r"[^\w.-]", "_", problem_id) + ".json")


@dataclass(frozen=True)
class TreeFiles:
    """Where a run folder's trees are: each id's own name (tree_name), else, in a folder written
    before those names, the name it had then, unless another of the folder's ids had it too (that
    file holds the tree of whichever was written last)."""

    run_dir: Path
    shared: frozenset[Path]  # old names that more than one of the folder's ids had

    @classmethod
    def of(cls, run_dir: Path, ids: Iterable[str]) -> TreeFiles:
        names = Counter(legacy_tree_file(run_dir, i) for i in set(ids))
        return cls(run_dir, frozenset(path for path, n in names.items() if n > 1))

    def find(self, problem_id: str) -> Path | None:
        """The problem's tree file, or None where it has none (or only a shared one)."""
        own = tree_file(self.run_dir, problem_id)
        if own.exists():
            return own
        before = legacy_tree_file(self.run_dir, problem_id)
        return before if before.exists() and before not in self.shared else None


def answer_fields(task: FullTask, problem: Problem, steps: list[str]) -> dict[str, Any]:
    """What a record says of the answer a path of thoughts gives: the answer and whether it is
    correct, and the same for each of the task's extraction rules (`answers`, `correct_by`)."""
    answer = task.answer(problem, steps)
    answers = task.answers(problem, steps)
    return {
        "answer": answer,
        "correct": task.is_correct(problem, answer),
        "answers": answers,
        "correct_by": {k: task.is_correct(problem, v) for k, v in answers.items()},
    }


def summarize(records: list[dict[str, Any]], header: dict[str, Any]) -> dict[str, Any]:
    """Totals over finished problems: accuracy, tokens, throughput, tau, per-phase cost."""
    total = DecodeStats()
    phases: dict[str, dict[str, Any]] = {}
    phase_stats: dict[str, DecodeStats] = {}
    for r in records:
        for name, p in r["phases"].items():
            stats = DecodeStats.from_dict({k[len("decode_") :]: v for k, v in p.items() if k.startswith("decode_")})
            total += stats
            phase_stats.setdefault(name, DecodeStats()).__iadd__(stats)
            acc = phases.setdefault(name, {"tokens": 0, "engine_s": 0.0, "target_forwards": 0})
            acc["tokens"] += p["tokens"]
            acc["engine_s"] += p.get("engine_s", p.get("wall_s", 0.0))  # runs made before concurrency
            acc["target_forwards"] += p["decode_target_forwards"]
    for name, p in phases.items():
        # Tokens per second of engine time spent on the phase's sequences (their shares of each step).
        p["tokens_per_s"] = p["tokens"] / p["engine_s"] if p["engine_s"] else 0.0
        p["acceptance_length"] = phase_stats[name].acceptance_length
        p["target_busy_fraction"] = phase_stats[name].target_busy_fraction
        # What each phase's prompts asked for and what the target computed of them (the rest reused).
        p["prompt_tokens"] = phase_stats[name].prompt_tokens
        p["prompt_tokens_computed"] = phase_stats[name].prompt_tokens_computed
    # The run's wall time: each problem's share since the previous one finished (problems overlap).
    wall = sum(r.get("wall_share_s", r["wall_s"]) for r in records)
    n = len(records)
    metric_values: dict[str, list[float]] = {}
    for r in records:
        for k, v in r.get("metrics", {}).items():
            metric_values.setdefault(k, []).append(float(v))
    return {
        **header,
        "n_problems": n,
        "n_correct": sum(bool(r["correct"]) for r in records),
        "accuracy": sum(bool(r["correct"]) for r in records) / n if n else 0.0,
        # Each extraction rule's accuracy (GSM8K: strict, flexible), over the records that have it.
        "accuracy_by": _accuracy_by(records),
        # The task's own scores (e.g. the judge's coherency), each a mean over the problems that have it.
        "metrics": {k: sum(v) / len(v) for k, v in metric_values.items()},
        "generated_tokens": total.generated_tokens,
        "target_forwards": total.target_forwards,
        "forwards_per_token": total.forwards_per_token,
        # How full the target's forwards were, and how much prompt work prefix sharing saved.
        "rows_per_forward": total.rows_per_forward,
        "prompt_tokens": total.prompt_tokens,
        "prompt_tokens_computed": total.prompt_tokens_computed,
        # Of the context the verified rows attended, the share read once for siblings sharing a prompt.
        "context_shared_fraction": total.schedule.context_shared_fraction,
        "acceptance_length": total.acceptance_length,
        "drafted_tokens": total.drafted_tokens,
        "accepted_tokens": total.accepted_tokens,
        "mean_sequence_acceptance_length": total.mean_sequence_acceptance_length,
        # Scheduler view (SEED): how busy the target was, how long drafts waited for it.
        "target_busy_fraction": total.target_busy_fraction,
        "mean_queue_wait_s": total.schedule.mean_queue_wait_s,
        "drafts_per_round": total.schedule.drafts_per_round,
        # Sequences that waited for the KV pool's memory (model.kv_memory) before they could decode.
        "kv_waits": total.kv_waits,
        # A decode step's verification forward and the host's work around it, by stage (ms a step).
        **total.schedule.host_summary(),
        "tokens_per_s": total.generated_tokens / wall if wall else 0.0,
        "wall_s": wall,
        "phases": phases,
        **_budget(records),
    }


def _budget(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a budget was spent in waves (search.stop): the samples (best-of-N), levels (BFS) or
    iterations (MCTS) drawn of the budget's, and (samples, iterations: a budget a full run spends) the
    tokens the undrawn ones would have cost at the mean of the drawn ones of their problem (an
    estimate: they were never sampled)."""
    spent = [r for r in records if r.get("budget")]
    if not spent:
        return {}
    unit = next(k for k in spent[0]["budget"] if k != "budget")  # samples (best-of-N), levels, iterations
    drawn = sum(r["budget"][unit] for r in spent)
    budget = sum(r["budget"]["budget"] for r in spent)
    out = {f"{unit}_drawn": drawn, f"{unit}_budget": budget}
    if unit == "levels":  # the depth limit bounds a BFS; its full run ends sooner where every state finished
        return out
    saved = sum(r["tokens"] / max(1, r["budget"][unit]) * (r["budget"]["budget"] - r["budget"][unit]) for r in spent)
    return {**out, "tokens_saved_estimate": round(saved)}


def _accuracy_by(records: list[dict[str, Any]]) -> dict[str, float]:
    hits: dict[str, list[bool]] = {}
    for r in records:
        for rule, ok in r.get("correct_by", {}).items():
            hits.setdefault(rule, []).append(bool(ok))
    return {rule: sum(v) / len(v) for rule, v in hits.items()}
