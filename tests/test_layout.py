"""The architecture as a test: the project's import graph, read from the source with `ast`, has no
cycle between modules, `decoding` imports neither `tot` nor `tasks`, and adding a decoder touches one
table (no if-chain over decoder names)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("decoding", "tot", "tasks", "conf")


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


def import_graph(type_only: bool = False) -> nx.DiGraph:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        for node in runtime_imports(ast.parse(path.read_text()), type_only):
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
    assert {"decoding.engine", "decoding.speculation.verify", "tot.run", "tasks.gsm8k"} <= set(graph)
    assert graph.has_edge("decoding.engine", "decoding.decoders")


def test_no_import_cycles():
    """No circle between modules, type-only imports included."""
    cycles = list(nx.simple_cycles(import_graph(type_only=True)))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles[:5])


def test_decoding_imports_neither_tot_nor_tasks():
    bad = [
        (a, b) for a, b in import_graph().edges if a.split(".")[0] == "decoding" and b.split(".")[0] in ("tot", "tasks")
    ]
    assert not bad, f"decoding imports the application: {bad}"


# Each folder of decoding and the folders it may import (itself included): the base, the model
# runtime, speculation's meaning, then the trees, EDD and the drafters; the schedules and the engine
# (decoding/*.py) sit on top.
LAYERS = {
    "decoding.base": ("decoding.base",),
    "decoding.runtime": ("decoding.base", "decoding.runtime"),
    "decoding.speculation": ("decoding.base", "decoding.runtime", "decoding.speculation"),
    "decoding.trees": ("decoding.base", "decoding.runtime", "decoding.speculation", "decoding.trees"),
    "decoding.edd": ("decoding.base", "decoding.runtime", "decoding.speculation", "decoding.trees", "decoding.edd"),
}
LAYERS["decoding.drafters"] = (*LAYERS["decoding.edd"], "decoding.drafters")


def test_layers_point_one_way():
    """Every import of a layer's module stays in the layer or below it (type-only imports included:
    `runtime_imports` skips none of those, the graph reads them all)."""
    bad = []
    for a, b in import_graph(type_only=True).edges:
        for layer, allowed in LAYERS.items():
            if a.startswith(layer + ".") and b.startswith("decoding") and not b.startswith(allowed):
                bad.append((a, b))
    assert not bad, f"imports that run up a layer: {bad}"


def test_each_layer_says_what_it_holds_and_may_import():
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((ROOT / layer.replace(".", "/") / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{layer}/__init__.py: say what is in it and what it may import"


def test_make_decoder_has_no_chain_over_names():
    source = (ROOT / "decoding" / "decoders.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "make_decoder")
    compares = [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Compare) and "name" in ast.unparse(n)]
    assert not compares, f"make_decoder compares names ({compares}): add the decoder to DECODERS instead"


def test_every_decoder_has_a_yaml_and_every_yaml_a_decoder():
    from decoding.config import choices
    from decoding.decoders import SCHEDULES
    from decoding.kinds import DECODERS, DRAFTERS

    yamls = {p.stem for p in (ROOT / "conf" / "decoder").glob("*.yaml")}
    assert yamls == set(choices()) == {*DECODERS, "server"}
    for name, kind in DECODERS.items():
        assert kind.schedule in SCHEDULES and kind.drafter in DRAFTERS, name


# The tuning tools run searches to tune the backend's internals (a static tree's calibration, an
# EDD's training corpus): they may import decoding's modules.
INTERNALS_TOOLS = ("tot.calibrate_tree", "tot.train_edd")
# What `tot/` may import of decoding: the public face, and the command framework every command shares.
PUBLIC = ("decoding", "decoding.cli")


def test_tot_uses_decodings_public_face():
    bad = [
        (a, b)
        for a, b in import_graph().edges
        if a.startswith("tot") and b.startswith("decoding") and b not in PUBLIC and a not in INTERNALS_TOOLS
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
