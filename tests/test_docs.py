"""The README and docs/ stay true to the code: the configuration reference is the yaml's, links resolve."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from conf import reference

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = ROOT / "conf" / "decoding" / "options.yaml"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 220
PERFORMANCE_MAX_LINES = 600  # current figures per topic; history lives in git, design in decoding.md


def _flat_keys(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    """Every key of a composed yaml mapping, dotted, with the line it is on (PyYAML, independent of
    conf.reference's own line parsing)."""
    keys: dict[str, int] = {}
    for key_node, value_node in node.value:
        dotted = f"{prefix}{key_node.value}"
        keys[dotted] = key_node.start_mark.line
        if isinstance(value_node, yaml.MappingNode):
            keys.update(_flat_keys(value_node, f"{dotted}."))
    return keys


def _rows(markdown: str) -> dict[str, tuple[str, str]]:
    """key -> (default, meaning) of the reference's rows; the first row of a key wins (the sections
    come in a fixed order, options.yaml's before any command's)."""
    rows: dict[str, tuple[str, str]] = {}
    for line in markdown.splitlines():
        cells = re.split(r"(?<!\\)\|", line)
        if len(cells) == 5 and cells[1].strip().startswith("`"):
            key, default, meaning = (_unescape(c.strip()) for c in cells[1:4])
            rows.setdefault(key.strip("`"), (default.strip("`"), meaning))
    return rows


def _unescape(markdown: str) -> str:
    return markdown.replace("\\|", "|").replace("&lt;", "<")


def _lookup(values: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        values = values[part]
    return values


def _trailing_comment(line: str) -> str:
    return line.split(" #", 1)[1].strip() if " #" in line else ""


def test_configuration_reference_is_generated() -> None:
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == reference.render(), (
        "docs/configuration.md differs from the yaml comments: run `python -m conf.reference --write`"
    )


def test_every_decoder_option_is_in_the_reference_with_its_comment() -> None:
    text = OPTIONS.read_text()
    lines = text.splitlines()
    rows = _rows(reference.render())
    values = yaml.safe_load(text)
    for key, line_no in _flat_keys(yaml.compose(text)).items():
        value = _lookup(values, key)
        if isinstance(value, dict) and not _trailing_comment(lines[line_no]):
            continue  # a section without a comment of its own: its keys carry the full path
        assert key in rows, f"{key} (conf/decoding/options.yaml) is missing from the reference"
        default, meaning = rows[key]
        assert _trailing_comment(lines[line_no]) in meaning, f"{key}: the yaml's comment is not in the reference"
        if not isinstance(value, dict):
            assert yaml.safe_load(default) == value, f"{key}: reference default {default!r}, yaml {value!r}"


def test_continuation_comments_are_in_the_reference() -> None:
    rendered = _unescape(reference.render())
    for line in OPTIONS.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and line.startswith(" "):
            assert stripped.lstrip("#").strip() in rendered, f"comment line not in the reference: {stripped}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def _broken(page: Path, target: str) -> bool:
    path, _, anchor = target.partition("#")
    if re.match(r"^[a-z]+:", path):
        return False  # a web address: not checked offline
    linked = page.parent / path if path else page
    return not linked.exists() or (bool(anchor) and linked.suffix == ".md" and anchor not in _anchors(linked))


def test_relative_links_resolve() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [f"{p.relative_to(ROOT)}: {t}" for p in pages for t in LINK.findall(p.read_text()) if _broken(p, t)]
    assert not broken, "links to missing files or headings: " + ", ".join(broken)


def test_readme_links_every_doc() -> None:
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.split("#", 1)[0]).resolve() for t in LINK.findall(readme.read_text())}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs not linked from README.md: {missing}"


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_performance_page_holds_current_figures_only() -> None:
    lines = (ROOT / "docs" / "performance.md").read_text().splitlines()
    assert len(lines) <= PERFORMANCE_MAX_LINES, (
        f"docs/performance.md has {len(lines)} lines; keep a topic's current figures, move design to docs/decoding.md"
    )


def _layout() -> dict[str, str]:
    """docs/decoding.md's layout block: each entry's path (`decoding/runtime/`, `tot/*.py`) -> its text."""
    text = (ROOT / "docs" / "decoding.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    path = ""
    for line in block.splitlines():
        if line and not line.startswith(" "):
            path, _, rest = line.partition(" ")
            entries[path] = rest
        elif path:
            entries[path] += " " + line.strip()
    return entries


def test_the_layout_lists_every_module() -> None:
    """Every module of every folder the layout names is in its entry; a `*.py` entry's commands are
    those with an entry point (`python -m NAME`), and no module without one is called a command."""
    entries = _layout()
    assert entries, "docs/decoding.md has no layout block"
    for path, text in entries.items():
        folder = ROOT / path.replace("*.py", "")
        modules = sorted(p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__"))
        words = set(re.findall(r"[a-z_0-9]+", text))
        missing = [m for m in modules if m not in words]
        assert not missing, f"docs/decoding.md's layout entry {path} does not name {missing}"
    commands = entries["tot/*.py"].split("commands:", 1)[1].split("(python -m")[0]
    for name in re.findall(r"[a-z_]+", commands):
        assert "__main__" in (ROOT / "tot" / f"{name}.py").read_text(), f"tot.{name} is listed as a command"
