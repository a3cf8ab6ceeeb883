"""tools/performance_tables.py: a topic's table is remade from a saved result and nothing else in the
document moves; an unknown topic or a missing block is one error line and exit status 2."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "performance_tables.py"
DOC = """# Figures

Text before.

<!-- table: cpu-concurrency -->
Machine: an old line.

| old | table |
<!-- /table -->

Text between.

<!-- table: cpu-trees -->
untouched
<!-- /table -->
Text after.
"""


def bench_result(entries: dict[str, tuple[str, int, int, float]]) -> dict:
    """A bench.json shaped as tot.bench writes it, for entries name -> (decoder, concurrency, tokens,
    seconds): tokens/s and the ratio to the `ar` entry of the same concurrency computed as the bench
    computes them; a speculative entry carries a plan, `ar` none."""
    rows = {}
    for name, (decoder, at_once, tokens, seconds) in entries.items():
        planned = decoder != "ar"
        rows[name] = {
            "decoder": name,
            "concurrency": at_once,
            "tokens": tokens,
            "time_s": seconds,
            "tokens_per_s": tokens / seconds,
            "rule": "match_gumbel",
            "acceptance_length": 1.5 if planned else 1.0,
            "suffix_share": None,
            "plan_nodes_per_row": 0.5 if planned else None,
            "plan_predicted_s": seconds * 0.9 if planned else None,
            "plan_measured_s": seconds * 0.9 if planned else None,
        }
    baselines = {r["concurrency"]: r for n, r in rows.items() if entries[n][0] == "ar"}
    for row in rows.values():
        row["speedup_vs_ar"] = row["tokens_per_s"] / baselines[row["concurrency"]]["tokens_per_s"]
    return {"task": "gsm8k", "problems": ["p0", "p1"], "temperature": 0.6, "mismatches": [], "decoders": rows}


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, cwd=tmp_path)


def saved(tmp_path: Path, name: str, result: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return path


def test_a_saved_bench_result_replaces_its_block_only(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text(DOC)
    result = bench_result({"ar": ("ar", 4, 600, 5.0), "seed_stand": ("seed_stand", 4, 600, 4.0)})
    done = run(tmp_path, "cpu-concurrency", "--from", str(saved(tmp_path, "bench.json", result)), "--doc", str(doc))
    assert done.returncode == 0, done.stderr
    text = doc.read_text()
    block = re.search(r"<!-- table: cpu-concurrency -->\n(.*?)<!-- /table -->", text, re.DOTALL)
    assert block is not None
    lines = block[1].splitlines()
    assert lines[0].startswith("Machine: ") and "cores;" in lines[0] and lines[0].endswith(".")
    assert lines[2].startswith("| entry | problems at once | tokens/s | vs `ar` |")
    assert lines[4] == "| `ar` | 4 | 120.0 | 1.000x | 1.00 | - | - |"
    assert lines[5] == "| `seed_stand` | 4 | 150.0 | 1.250x | 1.50 | 0.50 | 3.6 / 3.6 |"
    assert "| old | table |" not in text
    outside = re.sub(r"<!-- table: cpu-concurrency -->\n.*?<!-- /table -->", "", text, flags=re.DOTALL)
    assert outside == re.sub(r"<!-- table: cpu-concurrency -->\n.*?<!-- /table -->", "", DOC, flags=re.DOTALL)


def test_generate_summaries_make_one_row_each(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text("<!-- table: cpu-one-sequence -->\n<!-- /table -->\n")
    summaries = [
        {"decoder": "ar", "generated_tokens": 256, "wall_s": 3.2, "tokens_per_s": 256 / 3.2, "acceptance_length": 1.0},
        {
            "decoder": "seed_stand",
            "generated_tokens": 256,
            "wall_s": 2.0,
            "tokens_per_s": 128.0,
            "acceptance_length": 2.0,
        },
    ]
    done = run(tmp_path, "cpu-one-sequence", "--from", str(saved(tmp_path, "s.json", summaries)), "--doc", str(doc))
    assert done.returncode == 0, done.stderr
    assert "| `ar` | 80.0 | 1.00 |\n| `seed_stand` | 128.0 | 2.00 |\n<!-- /table -->" in doc.read_text()


def test_an_unknown_topic_is_one_error_line(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text(DOC)
    done = run(tmp_path, "no-such-topic", "--doc", str(doc))
    assert done.returncode == 2
    assert done.stderr.startswith("error: unknown topic 'no-such-topic'; topics: cpu-decoders")
    assert len(done.stderr.strip().splitlines()) == 1
    assert doc.read_text() == DOC


def test_a_missing_block_is_one_error_line_and_nothing_is_written(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text(DOC)
    result = saved(tmp_path, "bench.json", bench_result({"ar": ("ar", 4, 10, 1.0)}))
    done = run(tmp_path, "cpu-decoders", "--from", str(result), "--doc", str(doc))
    assert done.returncode == 2
    assert done.stderr.strip() == "error: no '<!-- table: cpu-decoders -->' ... '<!-- /table -->' block in the document"
    assert doc.read_text() == DOC


def test_every_topic_has_one_block_in_the_performance_page() -> None:
    spec = importlib.util.spec_from_file_location("performance_tables", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    page = (ROOT / "docs" / "performance.md").read_text()
    blocks = re.findall(r"^<!-- table: ([\w-]+) -->$", page, re.MULTILINE)
    assert sorted(blocks) == sorted(module.TOPICS), "docs/performance.md's table blocks and the tool's topics differ"
