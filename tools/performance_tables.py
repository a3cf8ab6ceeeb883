"""One topic's table in docs/performance.md, remade from its command's JSON output.

    python tools/performance_tables.py --list
    python tools/performance_tables.py TOPIC [--from FILE.json] [--doc PATH]

Each topic's table lies between `<!-- table: TOPIC -->` and `<!-- /table -->`; what is between them
(a machine line and the table) is replaced, nothing else in the file. Without `--from` the topic's
command runs first (in a scratch folder, from the repository root), so the figures and the machine
line describe this machine today. `--from` reads a result saved by that command instead (bench.json,
scaling.json, profile.json, or a list of `decoding.generate` summaries); the machine line is then this
machine's with the file's date, so pass results measured here. Bad input is one `error: ...` line,
exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
FLAGS = ("avx2", "avx512f", "avx512_vnni")
# The tables' setup: SEED's sub-question thoughts (docs/performance.md says so above them).
GSM8K = "data.path=../shared/data/gsm8k/test.jsonl task.thoughts=subquestions"
BENCH = f"python -m tot.bench task=gsm8k {GSM8K} data.limit=4 search.n_thoughts=8 hydra.run.dir={{out}}"
MM = "verify.rule: match_multinomial"


class TableError(Exception):
    """A problem with the input or the document, reported as one line."""


Row = dict[str, object]
Column = tuple[str, Callable[[str, Row], str]]


def _num(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(base: str, spec: str) -> Callable[[str, Row], str]:
    key = f"speedup_vs_{base}"  # absent where no entry of that decoder ran under the same rule
    return lambda _, r: "-" if r.get(key) is None else f"{r[key]:{spec}}x"


def _plan_time(_: str, r: Row) -> str:
    if r.get("plan_predicted_s") is None:
        return "-"
    return f"{r['plan_predicted_s']:.1f} / {r['plan_measured_s']:.1f}"


ENTRY: Column = ("entry", lambda name, _: f"`{name}`")
RULE: Column = ("rule", lambda _, r: str(r.get("rule", "-")))
AT_ONCE: Column = ("problems at once", lambda _, r: str(r.get("concurrency", 1)))
TOKENS: Column = ("tokens", lambda _, r: str(r["tokens"]))
SPEED: Column = ("tokens/s", lambda _, r: f"{r['tokens_per_s']:.1f}")
VS_HF: Column = ("vs `hf`", _ratio("hf", ".2f"))
VS_AR: Column = ("vs `ar`", _ratio("ar", ".3f"))
TAU: Column = ("acceptance length", lambda _, r: _num(r.get("acceptance_length"), ".2f"))
SUFFIX: Column = ("suffix share", lambda _, r: _num(r.get("suffix_share"), ".0%"))
NODES: Column = ("nodes / row", lambda _, r: _num(r.get("plan_nodes_per_row"), ".2f"))
PLAN_NODES: Column = ("plan: draft nodes / row", NODES[1])
PLAN_TIME: Column = ("plan: step s predicted / measured", _plan_time)


def markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def bench_table(columns: list[Column]) -> Callable[[object], str]:
    """A table of `tot.bench`'s bench.json: one row per entry, in the run's order."""

    def render(result: object) -> str:
        if not isinstance(result, dict) or not isinstance(result.get("decoders"), dict):
            raise TableError("not a tot.bench result: bench.json has a 'decoders' mapping")
        entries = result["decoders"].items()
        return markdown([c[0] for c in columns], [[c[1](name, row) for c in columns] for name, row in entries])

    return render


def generate_table(summaries: object) -> str:
    """`decoding.generate` summaries (<out>.summary.json), one row each, in the order they ran."""
    rows = summaries if isinstance(summaries, list) else [summaries]
    found = [s for s in rows if isinstance(s, dict) and "tokens_per_s" in s]
    if len(found) != len(rows):
        raise TableError("not decoding.generate summaries: each has 'decoder' and 'tokens_per_s'")
    cells = [[f"`{s['decoder']}`", f"{s['tokens_per_s']:.1f}", _num(s.get("acceptance_length"), ".2f")] for s in found]
    return markdown(["decoder", "tokens/s", "acceptance length"], cells)


def forward_table(profile: object) -> str:
    """`decoding.profile_forward out=...`: ms of one verification forward, rows by tokens per row."""
    if not isinstance(profile, dict) or not isinstance(profile.get("rows"), list):
        raise TableError("not a decoding.profile_forward result: profile.json has a 'rows' list")
    ms = {(r["batch"], r["tree_tokens"]): r["ms"] for r in profile["rows"]}
    sizes = sorted({t for _, t in ms})
    cells = [[str(b)] + [_num(ms.get((b, t)), ".1f") for t in sizes] for b in sorted({b for b, _ in ms})]
    return markdown(["rows \\ tokens per row", *map(str, sizes)], cells)


def scaling_table(rows: object) -> str:
    from tot.scaling import scaling_table as table  # the bench's own format; imported only when needed

    if not isinstance(rows, list):
        raise TableError("not a scaling result: scaling.json is a list of cells")
    return table(rows)


@dataclass(frozen=True)
class Topic:
    commands: tuple[str, ...]  # run in order from the repository root; {out} is a scratch folder
    results: tuple[str, ...]  # files under {out} the table is made from (several: read as a list)
    render: Callable[[object], str]
    prompts: bool = False  # writes {out}/p1.jsonl: the first GSM8K test question, as docs/performance.md says


def _one_sequence() -> tuple[str, ...]:
    run = "python -m decoding.generate prompts={out}/p1.jsonl out={out}/%s.jsonl gen.max_new_tokens=256 decoder=%s"
    return tuple(run % (f"{d}{i}", d) + f" hydra.run.dir={{out}}/{d}{i}" for i in (1, 2) for d in ("ar", "seed_stand"))


_V = ", ".join(
    [
        "suffix: {decoder: suffix}",
        "seed_stand_suffix: {decoder: seed_stand, stand.suffix: true}",
        "seed_stand_fixed: {decoder: seed_stand, verify.plan: fixed}",
        *(
            f"{d}_mm: {{decoder: {d}, {MM}}}"
            for d in ("hf", "ar", "pld", "recycling", "stand", "seed_stand", "aded", "suffix")
        ),
        f"seed_stand_suffix_mm: {{decoder: seed_stand, stand.suffix: true, {MM}}}",
        f"seed_stand_fixed_mm: {{decoder: seed_stand, verify.plan: fixed, {MM}}}",
    ]
)
_C = ", ".join(
    [f"{d}_c1: {{decoder: {d}, run.concurrency: 1}}" for d in ("ar", "seed_stand", "stand", "pld", "recycling", "aded")]
    + [f"{d}_c8: {{decoder: {d}, run.concurrency: 8}}" for d in ("ar", "seed_stand")]
)
_T = ", ".join(f"{d}_chain3: {{decoder: {d}, stand.tree: chain3}}" for d in ("seed_stand", "stand", "recycling"))

TOPICS: dict[str, Topic] = {
    "cpu-decoders": Topic(
        (f"{BENCH} gen.temperature=0.6 'bench.variants={{{_V}}}'",),
        ("bench.json",),
        bench_table([ENTRY, RULE, TOKENS, SPEED, VS_HF, VS_AR, TAU, SUFFIX, NODES]),
    ),
    "cpu-concurrency": Topic(
        (f"{BENCH} gen.temperature=0.6 'bench.decoders=[ar,seed_stand]' 'bench.variants={{{_C}}}'",),
        ("bench.json",),
        bench_table([ENTRY, AT_ONCE, SPEED, VS_AR, TAU, PLAN_NODES, PLAN_TIME]),
    ),
    "cpu-trees": Topic(
        (
            f"{BENCH} gen.temperature=0.6 run.concurrency=1 'bench.decoders=[ar,seed_stand,stand,recycling]' "
            f"'bench.variants={{{_T}}}'",
        ),
        ("bench.json",),
        bench_table([ENTRY, SPEED, VS_AR, TAU, PLAN_NODES]),
    ),
    "cpu-one-sequence": Topic(
        _one_sequence(),
        tuple(f"{d}{i}.jsonl.summary.json" for i in (1, 2) for d in ("ar", "seed_stand")),
        generate_table,
        prompts=True,
    ),
    "cpu-forward": Topic(
        (
            "python -m decoding.profile_forward 'tree_sizes=[1,2,4,8]' 'batch_sizes=[1,4,16]' context=256 "
            "split=false out={out}/profile.json hydra.run.dir={out}/profile",
        ),
        ("profile.json",),
        forward_table,
    ),
    "scaling": Topic(
        (
            f"python -m tot.bench bench.scaling=true task=gsm8k {GSM8K} data.limit=4 hydra.run.dir={{out}} "
            "'bench.scaling_decoders=[ar,seed_stand]' 'bench.searches={bfs: null, best_of_n: {max_tokens: 256}}' "
            "'bench.budgets=[1,4,8,16]' 'bench.temperatures=[0.6]'",
        ),
        ("scaling.json",),
        scaling_table,
    ),
}


def machine_line(day: datetime.date) -> str:
    """The CPU, its vector extensions that decide the kernels, torch's version and the date."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.MULTILINE)
    listed = re.search(r"^flags\s*:\s*(.+)$", info, re.MULTILINE)
    flags = set(listed[1].split()) if listed else set()
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    shown = " ".join(f for f in FLAGS if f in flags) or "none of " + "/".join(FLAGS)
    name = model[1].strip() if model else "unknown CPU"
    return f"Machine: {name} ({os.cpu_count()} cores; {shown}), torch {torch}; measured {day.isoformat()}."


def replace_table(doc: str, topic: str, body: str) -> str:
    """The document with the block of `topic` holding `body`; everything outside it unchanged."""
    pattern = re.compile(rf"^(<!-- table: {re.escape(topic)} -->\n)(.*?)^(<!-- /table -->)", re.DOTALL | re.MULTILINE)
    found = pattern.findall(doc)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise TableError(f"{what} '<!-- table: {topic} -->' ... '<!-- /table -->' block in the document")
    return pattern.sub(lambda m: m[1] + body + "\n" + m[3], doc)


def measure(topic: Topic, out: Path) -> object:
    if topic.prompts:
        question = json.loads((ROOT.parent / "shared/data/gsm8k/test.jsonl").read_text().splitlines()[0])
        row = {"id": "q0", "prompt": question["question"] + " Solve it step by step.", "n": 1}
        (out / "p1.jsonl").write_text(json.dumps(row) + "\n")
    for command in topic.commands:
        argv = shlex.split(command.replace("{out}", str(out)))
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        done = subprocess.run(argv, cwd=ROOT, check=False)
        if done.returncode != 0:
            raise TableError(f"`{' '.join(argv[:3])} ...` exited with status {done.returncode}")
    loaded = [json.loads((out / name).read_text()) for name in topic.results]
    return loaded[0] if len(loaded) == 1 else loaded


def read_result(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise TableError(f"cannot read {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise TableError(f"{path} is not JSON: {e.msg} at line {e.lineno}") from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("topic", nargs="?", help="the table to remake (--list shows them)")
    parser.add_argument("--list", action="store_true", help="print the topics and the commands that measure them")
    parser.add_argument("--from", dest="source", type=Path, help="a saved result instead of running the command")
    parser.add_argument("--doc", type=Path, default=DOC, help="the document to rewrite (default docs/performance.md)")
    args = parser.parse_args(argv)
    try:
        if args.list:
            for name, topic in TOPICS.items():
                print(f"{name}:\n" + "\n".join(f"  {c}" for c in topic.commands))
            return 0
        if args.topic not in TOPICS:
            raise TableError(f"unknown topic {args.topic!r}; topics: {', '.join(TOPICS)}")
        topic = TOPICS[args.topic]
        doc = args.doc.read_text()
        replace_table(doc, args.topic, "")  # a missing block fails before anything is measured
        if args.source is not None:
            result = read_result(args.source)
            day = datetime.date.fromtimestamp(args.source.stat().st_mtime)
        else:
            with tempfile.TemporaryDirectory(prefix="perf-") as out:
                result = measure(topic, Path(out))
            day = datetime.datetime.now(datetime.timezone.utc).date()
        body = f"{machine_line(day)}\n\n{topic.render(result)}"
        args.doc.write_text(replace_table(doc, args.topic, body))
    except (TableError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.doc}: table {args.topic!r} replaced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
