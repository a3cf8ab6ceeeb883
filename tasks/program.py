"""Running a model's program for its answer: the function's source checked, then called in a child
Python with limits, its returned value read as a number.

A small model's arithmetic errs where its code does not, and the other way round (Qwen2.5-Coder-0.5B
on GSM8K's first 100 test problems, greedy: 23 right as a `solution()` function run here at 106 tokens,
22 as a written solution at 272, 10 of them both), so a task may take its answer from a program, or
vote over both. The program is the model's text: before it runs, its syntax tree is checked against
what arithmetic needs (a few pure modules imported, no file, process or introspection call, no `_`
attribute), and it runs in an isolated child interpreter (`python -I -S`, an empty environment, a fresh
temporary folder, no stdin) under limits on time, memory and written files. A program refused or
failing has no answer; that is a wrong ballot, not an error of the run.
"""

from __future__ import annotations

import ast
import math
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

# What a GSM8K program may import: pure computation, nothing that reaches files, processes or the net.
MODULES = frozenset({"math", "fractions", "decimal", "datetime", "statistics", "itertools", "functools", "collections"})
# Builtins a computation has no use for and an escape would.
REFUSED_NAMES = frozenset(
    {
        "open",
        "exec",
        "eval",
        "compile",
        "__import__",
        "input",
        "globals",
        "locals",
        "vars",
        "getattr",
        "setattr",
        "delattr",
        "breakpoint",
        "exit",
        "quit",
        "help",
        "memoryview",
    }
)
# The child: reads the source on stdin, defines it, calls the function, prints its value's repr.
_CHILD = (
    "import sys\n"
    "src, name = sys.stdin.read().split('\\0')\n"
    "scope = {'__name__': 'program'}\n"
    "exec(compile(src, 'program', 'exec'), scope)\n"
    "print(repr(scope[name]()))\n"
)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def function_source(name: str, body: str) -> str:
    """`def name():` over a body as the model wrote it, cut where the function ends: the first line
    after it that is not indented (a model goes on to test calls, prints and prose)."""
    kept = []
    for line in body.splitlines():
        if line.strip() and not line[0].isspace():
            break
        kept.append(line)
    return f"def {name}():\n" + "\n".join(kept).rstrip() + "\n"


def refusal(source: str) -> str:
    """Why a program is not run ("" where it may be): a syntax error, an import beyond `MODULES`, a
    refused builtin, an attribute whose name starts with `_`."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as e:
        return f"syntax: {e.args[0] if e.args else e}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
        else:
            names = []
        if any(n not in MODULES for n in names):
            return f"imports {', '.join(names)}"
        if isinstance(node, ast.Name) and node.id in REFUSED_NAMES:
            return f"calls {node.id}"
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            return f"reads .{node.attr}"
    return ""


def number(value: str) -> str:
    """A returned value's repr as GSM8K's answers are written: an integral float as an integer, no
    thousands separators, a string's first number; "" where there is none."""
    text = value.strip().strip("'\"")
    found = _NUMBER.search(text)
    if not found:
        return ""
    try:
        v = float(found.group(0).replace(",", ""))
    except ValueError:
        return ""
    if not math.isfinite(v):
        return ""
    if abs(v - round(v)) < 1e-6:
        return str(round(v))
    return f"{v:.6f}".rstrip("0").rstrip(".")


def _limits(seconds: float, memory_mb: int) -> None:
    # In the child before it runs: CPU time, address space and files it may write (none).
    import resource

    cpu = max(1, math.ceil(seconds))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


@dataclass
class Runner:
    """Runs programs, each source once (a search asks a finished state's answer many times)."""

    seconds: float = 2.0
    memory_mb: int = 512
    _done: dict[tuple[str, str], str] = field(default_factory=dict, repr=False, compare=False)

    def value(self, source: str, name: str = "solution") -> str:
        """What `name()` returns, as a number (`number`), or "" where the program is refused, fails,
        prints past its limits or returns no number."""
        key = (source, name)
        if key not in self._done:
            self._done[key] = "" if refusal(source) else number(self._run(source, name))
        return self._done[key]

    def _run(self, source: str, name: str) -> str:
        posix = sys.platform != "win32"
        with tempfile.TemporaryDirectory(prefix="tot-program-") as cwd:
            try:
                done = subprocess.run(
                    [sys.executable, "-I", "-S", "-c", _CHILD],
                    input=f"{source}\0{name}",
                    capture_output=True,
                    text=True,
                    timeout=self.seconds + 1.0,
                    cwd=cwd,
                    env={},
                    preexec_fn=(lambda: _limits(self.seconds, self.memory_mb)) if posix else None,
                )
            except subprocess.TimeoutExpired:
                return ""
        if done.returncode != 0:
            return ""
        lines = done.stdout.strip().splitlines()
        return lines[-1] if lines else ""
