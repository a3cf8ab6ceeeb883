"""`python -m tot.show RUN_DIR --html` rendered by a real headless browser (Debian's chromium, which
`make test` installs): the page's script draws every node of every saved tree with its full texts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers import reply
from test_run import FakeEngine, make_config

from decoding.base.values import GenRequest, GenResult
from tasks.gsm8k import FINAL_PREFIX, SCORE_PREFIX
from tot.runs.run import run

REPO = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# Texts a page must not take for markup: the page would break if they were not escaped.
THOUGHT = " How many <apples> & pears? <!-- <script> </script> Sub-answer: 3 + 4 = 7."
EVALUATION = ' 7, it helps "a lot" <b>really</b>.'


class MarkupEngine(FakeEngine):
    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        out = super().generate(requests)
        texts = {SCORE_PREFIX: EVALUATION, FINAL_PREFIX: " 12. Then 5 more."}
        return [reply(texts.get(r.prefix, THOUGHT), o.token_ids) for r, o in zip(requests, out)]


def browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    pytest.fail("no headless browser: install Debian's chromium (`make test` does: apt-get install chromium)")


class Nodes(HTMLParser):
    """Per problem section: the node ids drawn and all text shown."""

    def __init__(self) -> None:
        super().__init__()
        self.problem: str | None = None
        self.nodes: dict[str, list[int]] = {}
        self.text: dict[str, list[str]] = {}
        self.classes: dict[tuple[str, int], str] = {}
        self.rendered = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "body":
            self.rendered = a.get("data-rendered") or ""
        if "data-problem" in a:
            self.problem = a["data-problem"]
            self.nodes[self.problem], self.text[self.problem] = [], []
        if "data-node" in a and self.problem is not None:
            node = int(a["data-node"] or -1)
            self.nodes[self.problem].append(node)
            self.classes[(self.problem, node)] = a.get("class") or ""

    def handle_data(self, data: str) -> None:
        if self.problem is not None:
            self.text[self.problem].append(data)


def test_tree_page_holds_every_node_with_full_texts(tmp_path):
    run(make_config("data.limit=2"), tmp_path, engine=MarkupEngine(), progress=False)
    # A value read from probabilities (task.value=expected / yes) shows its distribution.
    first = tmp_path / "trees" / f"{json.loads((tmp_path / 'results.jsonl').read_text().splitlines()[0])['id']}.json"
    saved = json.loads(first.read_text())
    saved["nodes"][1]["distribution"] = {" No": 0.25, " Yes": 0.75}
    first.write_text(json.dumps(saved))
    show = subprocess.run(
        [sys.executable, "-m", "tot.show", str(tmp_path), "--html"], cwd=REPO, capture_output=True, text=True
    )
    assert show.returncode == 0, show.stderr
    page = tmp_path / "trees.html"
    assert f"page: {page}" in show.stdout
    assert "http" not in page.read_text().lower()  # nothing fetched: it opens offline

    chrome = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    dom = subprocess.run([*chrome, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    seen = Nodes()
    seen.feed(dom.stdout)
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    total = 0
    for rec in records:
        tree = json.loads((tmp_path / "trees" / f"{rec['id']}.json").read_text())
        ids = sorted(n["id"] for n in tree["nodes"])
        assert sorted(seen.nodes[rec["id"]]) == ids  # every node drawn once
        shown = "".join(seen.text[rec["id"]])
        for n in tree["nodes"]:
            assert n["text"] in shown  # full thoughts, markup as text
            if "evaluation" in n:
                assert n["evaluation"] in shown
            if "distribution" in n:
                assert 'read from the answers\' probabilities: " Yes" 0.750, " No" 0.250' in shown
            if n.get("answer") and n["id"]:
                assert "answer" in seen.classes[(rec["id"], n["id"])].split()
            if n.get("chosen"):
                assert "kept" in seen.classes[(rec["id"], n["id"])].split()
        assert f"answer{rec['answer']}" in shown.replace(" ", "") and "answer (strict)" in shown
        total += len(ids)
    assert seen.rendered == str(total)  # the script ran to its end

    shot = tmp_path / "trees.png"
    subprocess.run(
        [*chrome, "--window-size=1280,2000", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_html_out_must_be_an_html_file(tmp_path):
    run(make_config("data.limit=1"), tmp_path, engine=FakeEngine(), progress=False)
    proc = subprocess.run(
        [sys.executable, "-m", "tot.show", str(tmp_path), "--html", "--out", str(tmp_path / "x.png")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "is not an .html file" in proc.stderr
