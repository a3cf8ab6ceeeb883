"""python -m tasks.blocksworld validate PATH [--plans FILE] | generate OUT [--n N --blocks B --steps S --seed K]

validate exits 0 when every plan is valid, 1 when some is not, 2 on a missing or malformed file (one line on
stderr); generate exits 2 when the request cannot be met.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tasks.base import DataError
from tasks.blocksworld.planner import generate_problems
from tasks.blocksworld.validate import load_plans, load_problems, validate


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tasks.blocksworld", description="Blocksworld data tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("validate", help="check gold plans (or --plans) against a data file")
    check.add_argument("path", type=Path, help="blocksworld JSONL, e.g. ../shared/data/blocksworld/step_6.jsonl")
    check.add_argument(
        "--plans", type=Path, help='JSONL of {"id", "plan" | "answer"} records (e.g. a results.jsonl) to check'
    )
    gen = commands.add_parser("generate", help="write problems with a given optimal plan length")
    gen.add_argument("out", type=Path, help="JSONL file to write")
    gen.add_argument("--n", type=int, default=20, help="number of problems (default 20)")
    gen.add_argument("--blocks", type=int, default=4, help="blocks per problem, 1-10 (default 4)")
    gen.add_argument("--steps", type=int, default=6, help="optimal plan length, even (default 6)")
    gen.add_argument("--seed", type=int, default=0)
    return parser


def _validate(args: argparse.Namespace) -> int:
    problems = load_problems(args.path, need_gold=args.plans is None)
    plans = load_plans(args.plans) if args.plans is not None else None
    report = validate(problems, plans)
    print("\n".join(report.lines()))
    return 0 if report.all_valid else 1


def _generate(args: argparse.Namespace) -> int:
    records = generate_problems(args.n, args.blocks, args.steps, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    print(f"wrote {len(records)} problems to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _validate(args) if args.command == "validate" else _generate(args)
    except (DataError, ValueError, OSError) as e:
        # DataError and generate's ValueError carry the file, line and fix; an OSError names the path.
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
