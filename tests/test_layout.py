"""The architecture as a test: the project's import graph, read from the source with `ast` (the
plug-in tables' `importlib` edges included), has no cycle between modules, `decoding` imports neither
`tot` nor `tasks`, every folder imports only the folders below it, and adding a decoder touches one
table (no if-chain over decoder names)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("decoding", "tot", "tasks", "tuning", "conf")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.Module, type_only: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import the module runs (function-level ones too); `if TYPE_CHECKING:` blocks, which only
    name types, with `type_only`."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if not type_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped]


def table_modules(tree: ast.Module) -> list[str]:
    """The modules loaded through `importlib`, edges the import statements do not show: a plug-in
    table's (`MODULES = ("pkg.mod", "pkg.mod:NAME", ...)`) and a deferred builder's
    (`Deferred("pkg.mod:function")`, imported on its first call)."""
    tables = [
        elt.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "MODULES" for t in node.targets)
        and isinstance(node.value, ast.Tuple)
        for elt in node.value.elts
        if isinstance(elt, ast.Constant) and isinstance(elt.value, str)
    ]
    deferred = [
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "Deferred"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ]
    return [entry.partition(":")[0] for entry in (*tables, *deferred)]


def import_graph(type_only: bool = False) -> nx.DiGraph:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        graph.add_edges_from((name, m) for m in table_modules(tree) if m in files)
        for node in runtime_imports(tree, type_only):
            targets = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [f"{node.module}.{a.name}" for a in node.names]
                if node.level == 0 and node.module
                else []
            )
            for target in targets:
                # `from pkg import mod` imports the module; `from mod import name` the module itself.
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target)
    return graph


def test_graph_sees_the_project():
    graph = import_graph()
    assert {"decoding.api.engine", "decoding.speculation.verify", "tot.runs.run", "tasks.gsm8k"} <= set(graph)
    assert graph.has_edge("decoding.api.engine", "decoding.api.decoders")
    # the drafter table's entries and a declaration's deferred builder
    assert graph.has_edge("decoding.api.kinds", "decoding.drafters.builtin")
    assert graph.has_edge("decoding.drafters.builtin", "decoding.drafters.stand")


def test_no_import_cycles():
    """No circle between modules, type-only imports included."""
    cycles = list(nx.simple_cycles(import_graph(type_only=True)))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles[:5])


def test_decoding_imports_neither_tot_nor_tasks():
    bad = [
        (a, b) for a, b in import_graph().edges if a.split(".")[0] == "decoding" and b.split(".")[0] in ("tot", "tasks")
    ]
    assert not bad, f"decoding imports the application: {bad}"


# Every folder of the project, bottom to top: a module imports modules of its own folder or of folders
# below it. decoding's layers (base, the model runtime, speculation's meaning, the trees, EDD, the
# drafters, the schedules, the engine's API), then decoding's public face and commands (decoding/*.py);
# tasks; tot's search library, its run folders, its commands (tot/*.py); the tuning tools; conf.
FOLDERS = (
    "decoding.base",
    "decoding.runtime",
    "decoding.speculation",
    "decoding.trees",
    "decoding.edd",
    "decoding.drafters",
    "decoding.schedules",
    "decoding.api",
    "decoding",
    "tasks",
    "tot.search",
    "tot.runs",
    "tot",
    "tuning",
    "conf",
)


def folder_of(module: str) -> str:
    """The innermost folder of FOLDERS that holds the module (a package's __init__ is in its own)."""
    return max((f for f in FOLDERS if module == f or module.startswith(f + ".")), key=len)


def test_every_module_is_in_a_folder_of_the_table():
    graph = import_graph()
    packages = {module_name(p.parent / "__init__.py") for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert all(any(m == f or m.startswith(f + ".") for f in FOLDERS) for m in graph)
    # a new folder of decoding or tot is a new entry; a subfolder of one (runtime/architectures, a task's
    # own folder under tasks/) belongs to it
    unlisted = [p for p in packages if p not in FOLDERS and p.count(".") == 1 and p.startswith(("decoding", "tot"))]
    assert not unlisted, f"folders missing from FOLDERS (say where they sit): {unlisted}"


def test_folders_point_one_way():
    """Every import goes to the importer's folder or one below it (type-only imports included:
    `runtime_imports` skips none of those, the graph reads them all)."""
    level = {f: i for i, f in enumerate(FOLDERS)}
    bad = [(a, b) for a, b in import_graph(type_only=True).edges if level[folder_of(b)] > level[folder_of(a)]]
    assert not bad, f"imports that run up a folder: {bad}"


def test_no_library_imports_a_command():
    """The commands (the modules beside a public face: decoding/*.py, tot/*.py) sit on top: neither the
    face nor any library module imports one; commands may use each other."""
    commands = {m for m in import_graph() if folder_of(m) in ("decoding", "tot") and m not in ("decoding", "tot")}
    bad = [(a, b) for a, b in import_graph().edges if b in commands and a not in commands and folder_of(a) != "tuning"]
    assert not bad, f"library modules that import a command: {bad}"


def test_each_folder_says_what_it_holds_and_may_import():
    for folder in FOLDERS:
        doc = ast.get_docstring(ast.parse((ROOT / folder.replace(".", "/") / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{folder}/__init__.py: say what is in it and what it may import"


def test_make_decoder_has_no_chain_over_names():
    source = (ROOT / "decoding" / "api" / "decoders.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "make_decoder")
    compares = [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Compare) and "name" in ast.unparse(n)]
    assert not compares, f"make_decoder compares names ({compares}): add the decoder to DECODERS instead"


def test_every_decoder_has_a_yaml_and_every_yaml_a_decoder():
    from decoding.api.config import choices
    from decoding.api.decoders import SCHEDULES
    from decoding.api.kinds import DECODERS, DRAFTERS

    yamls = {p.stem for p in (ROOT / "conf" / "decoder").glob("*.yaml")}
    assert yamls == set(choices()) == {*DECODERS, "server"}
    for name, kind in DECODERS.items():
        assert kind.schedule in SCHEDULES and kind.drafter in DRAFTERS, name


# What `tot/` and `tasks/` may import of decoding: the public face, and the command framework every
# command shares. The tuning tools (tuning/), which tune the backend's internals, may import further.
PUBLIC = ("decoding", "decoding.base.cli")


def test_tot_uses_decodings_public_face():
    bad = [
        (a, b)
        for a, b in import_graph().edges
        if folder_of(a).startswith(("tot", "tasks")) and b.startswith("decoding") and b not in PUBLIC
    ]
    assert not bad, f"tot imports decoding's internals (export what it needs in decoding/__init__.py): {bad}"


def test_notebooks_use_decodings_public_face():
    """A notebook is a user's code: what it imports of decoding is what users are promised."""
    import json

    bad = []
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        tree = ast.parse("\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!"))))
        for node in runtime_imports(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            bad += [(path.name, n) for n in names if n.startswith("decoding") and n not in PUBLIC]
    assert not bad, f"notebooks import decoding's internals (export what they need in decoding/__init__.py): {bad}"


def test_the_public_face_loads_each_name_where_its_type_checking_imports_say():
    """decoding/__init__.py imports a name on first use (`EXPORTS`, so a command reading a run folder
    loads no torch); its TYPE_CHECKING imports, what type checkers read, name the same modules."""
    import importlib

    import decoding

    tree = ast.parse((ROOT / "decoding" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    declared = {(node.module, a.name) for node in block.body for a in node.names}
    assert declared == {(m, n) for m, names in decoding.EXPORTS.items() for n in names}
    assert set(decoding.__all__) == {n for _, n in declared}
    for module, name in declared:
        assert getattr(decoding, name) is getattr(importlib.import_module(module), name)


def test_a_commands_options_are_checked_without_torch():
    """The option dataclasses (model, verify, tree, rounds, run, every drafter's section), the decoder
    table and the commands that check them load neither torch nor transformers (seconds of imports):
    a bad value stops in about a second."""
    code = (
        "import sys\n"
        "import decoding.api.config, decoding.generate, tot.bench, tot.runs.config, tot.solve\n"
        "from decoding.api.kinds import DECODERS, SECTIONS\n"
        "assert len(DECODERS) >= 10 and decoding.api.config.DecoderConfig('seed_stand').section('stand')\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# The modules a decode step runs through after drafting: verification, acceptance, log-probabilities,
# the commit and the planner. Each row's sampling settings reach them as the step's `RowSampling`
# (copied from the request once, at admission: decoding/speculation/row_sampling.py).
STEP_PATH = (
    "decoding/schedules/step.py",
    "decoding/schedules/scheduler.py",
    "decoding/schedules/rounds.py",
    "decoding/schedules/planner.py",
    "decoding/speculation/verify.py",
    "decoding/speculation/acceptance.py",
    "decoding/speculation/device_walk.py",
    "decoding/speculation/gumbel.py",
    "decoding/speculation/logprobs.py",
)


def params_reads(source: str) -> list[str]:
    """Each `X.params` read in the source but `sampling.params` (the step's arrays): a request's
    sampling record read row by row."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "params":
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name != "sampling":
                found.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]


def test_params_reads_finds_a_requests_settings_read_per_row():
    assert params_reads("t = [s.params.temperature for s in seqs]\ng = seqs[b].params.greedy") == [
        "line 1: s.params",
        "line 2: seqs[b].params",
    ]
    assert params_reads("p = sampling.params[b]\nq = record.sampling.params") == []


def test_no_module_on_the_steps_path_reads_a_requests_sampling_settings():
    """Verification, acceptance and log-probabilities read the step's `RowSampling` arrays, never
    `seq.params` row by row (the table copies them at admission)."""
    found = {path: params_reads((ROOT / path).read_text()) for path in STEP_PATH}
    assert {path: reads for path, reads in found.items() if reads} == {}


def protocol_members(protocol: type) -> list[str]:
    """The members a protocol declares itself: its annotated fields and its methods."""
    own = vars(protocol)
    methods = [k for k, v in own.items() if callable(v) and not k.startswith("_")]
    return sorted([*own.get("__annotations__", {}), *methods])


def task_reads(source: str) -> list[str]:
    """Each member read off `task` or `self.task` in the source, as `name (line)`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        is_task = (isinstance(owner, ast.Name) and owner.id == "task") or (
            isinstance(owner, ast.Attribute) and owner.attr == "task" and isinstance(owner.value, ast.Name)
        )
        if is_task:
            found.append(f"{node.attr} (line {node.lineno})")
    return found


def test_task_reads_finds_the_members_read_off_a_task():
    assert task_reads("a = self.task.value\nb = task.answer(p, s)\nc = self.values.mode") == [
        "value (line 1)",
        "answer (line 2)",
    ]


def test_the_task_contract_is_what_searches_call():
    """A search reads nothing off its task but `Task`'s members (how states are valued reaches it as
    `Values`), and the docs' counts are the protocols' own."""
    from tasks.base import FullTask, Scoring, StatePrompts, Task

    contract = set(protocol_members(Task))
    searches = sorted((ROOT / "tot" / "search").glob("*.py"))
    outside = {p.name: [r for r in task_reads(p.read_text()) if r.split()[0] not in contract] for p in searches}
    assert {name: reads for name, reads in outside.items() if reads} == {}
    counts = {p: len(protocol_members(p)) for p in (Task, StatePrompts, Scoring)}
    assert counts == {Task: 7, StatePrompts: 5, Scoring: 7}
    assert len(protocol_members(FullTask)) == 5  # the value options a run's Values is read from
    doc = " ".join((ROOT / "docs" / "decoding.md").read_text().split())
    for protocol, n in counts.items():
        assert re.search(rf"`{protocol.__name__}`, [^(]*\({n}\b", doc), protocol.__name__
    template = " ".join((ROOT / "tasks" / "template.py").read_text().split())
    assert all(f"`{p.__name__}`: {n}" in template for p, n in counts.items())
