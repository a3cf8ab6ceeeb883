"""Run outputs: results.jsonl appended per finished problem, summary.json, trees/<id>.json.

A problem counts as done once its line is in results.jsonl; a line cut short by a kill is dropped
on the next start, so a rerun in the same directory neither loses nor repeats a problem. A folder
that two runs wrote at once (before runs locked their folders, tot/lock.py) holds some problems
twice: the first record of each is kept, and the others are reported and dropped.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from decoding.core.values import DecodeStats
from tasks.base import Problem, Task
from tot.output import append_line, write_atomic

log = logging.getLogger(__name__)


class ResultStore:
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.path = out_dir / "results.jsonl"
        self.records: list[dict] = []
        self.duplicates: list[str] = []  # problem ids found more than once (and dropped)
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        raw = self.path.read_text(encoding="utf-8")
        good = []
        for line in raw.splitlines(keepends=True):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a record cut short by a kill: that problem is simply run again
            if line.endswith("\n") and isinstance(rec, dict) and "id" in rec:
                good.append(line)
                self.records.append(rec)
        self.records, self.duplicates = unique_records(self.records)
        if self.duplicates:
            log.warning(
                "%s holds %d problem(s) twice (%s), written by two runs at once: the first record of each is kept",
                self.path,
                len(self.duplicates),
                ", ".join(self.duplicates[:5]) + (", ..." if len(self.duplicates) > 5 else ""),
            )
            good = [json.dumps(r) + "\n" for r in self.records]
        if "".join(good) != raw:
            write_atomic(self.path, "".join(good))

    @property
    def done(self) -> set[str]:
        return {r["id"] for r in self.records}

    def append(self, record: dict) -> None:
        append_line(self.path, json.dumps(record))
        self.records.append(record)

    def tree_path(self, problem_id: str) -> Path:
        return self.out_dir / "trees" / (re.sub(r"[^\w.-]", "_", problem_id) + ".json")


def answer_fields(task: Task, problem: Problem, steps: list[str]) -> dict:
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


def summarize(records: list[dict], header: dict) -> dict:
    """Totals over finished problems: accuracy, tokens, throughput, tau, per-phase cost."""
    total = DecodeStats()
    phases: dict[str, dict] = {}
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
        "acceptance_length": total.acceptance_length,
        "drafted_tokens": total.drafted_tokens,
        "accepted_tokens": total.accepted_tokens,
        "mean_sequence_acceptance_length": total.mean_sequence_acceptance_length,
        # Scheduler view (SEED): how busy the target was, how long drafts waited for it.
        "target_busy_fraction": total.target_busy_fraction,
        "mean_queue_wait_s": total.mean_queue_wait_s,
        "drafts_per_round": total.drafts_per_round,
        # Sequences that waited for the KV pool's memory (model.kv_memory) before they could decode.
        "kv_waits": total.kv_waits,
        "tokens_per_s": total.generated_tokens / wall if wall else 0.0,
        "wall_s": wall,
        "phases": phases,
    }


def _accuracy_by(records: list[dict]) -> dict[str, float]:
    hits: dict[str, list[bool]] = {}
    for r in records:
        for rule, ok in r.get("correct_by", {}).items():
            hits.setdefault(rule, []).append(bool(ok))
    return {rule: sum(v) / len(v) for rule, v in hits.items()}


def unique_records(records: list[dict]) -> tuple[list[dict], list[str]]:
    """The first record of each problem id, and the ids that had more than one."""
    seen: set[str] = set()
    kept, dropped = [], []
    for r in records:
        if r["id"] in seen:
            dropped.append(r["id"])
        else:
            seen.add(r["id"])
            kept.append(r)
    return kept, sorted(set(dropped))
