"""A run's memory over its problems (`python -m tot.show RUN_DIR --memory`): the stored prefixes
against their cap, the KV pool, and resident memory, as each problem finished (each result record
carries where memory stood then: decoding/runtime/memory.py), as a table and a PNG.

A run whose store has reached its cap should show flat curves from there on: that is what
issue 28's soak run checks (docs/performance.md, "Memory over a long run").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tot.runs.saved import ShowError, read_records

COLUMNS = ("prefix_store_mb", "prefix_store_cap_mb", "prefix_evictions", "kv_pool_mb", "rss_mb", "peak_rss_mb")


def memory_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Per finished problem, in the order they finished: its index, id, and the memory figures."""
    records = [r for r in read_records(run_dir) if isinstance(r.get("memory"), dict)]
    if not records:
        raise ShowError(
            f"{run_dir}/results.jsonl has no records with memory figures; give a run of python -m tot.solve "
            "made with the in-process engine (runs before memory was recorded, and server runs, have none)"
        )
    return [{"problem": i, "id": r["id"], **{k: r["memory"].get(k) for k in COLUMNS}} for i, r in enumerate(records, 1)]


def memory_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| problem | id | stored prefixes (MB) | cap (MB) | evictions | KV pool (MB) | resident (MB) "
        "| peak resident (MB) |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        figures = " | ".join("-" if r[k] is None else f"{r[k]:.0f}" for k in COLUMNS)
        lines.append(f"| {r['problem']} | {r['id']} | {figures} |")
    return "\n".join(lines)


def draw_memory(rows: list[dict[str, Any]], out: Path, plt: Any) -> Path:
    """The curves as a PNG at `out`, drawn with matplotlib's pyplot `plt`."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = [r["problem"] for r in rows]
    for key, label in (("prefix_store_mb", "stored prefixes"), ("kv_pool_mb", "KV pool"), ("rss_mb", "resident")):
        ax.plot(x, [r[key] or 0 for r in rows], marker=".", label=label)
    ax.plot(x, [r["prefix_store_cap_mb"] or 0 for r in rows], linestyle="--", color="gray", label="store cap")
    ax.set_xlabel("problems finished")
    ax.set_ylabel("MB")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
