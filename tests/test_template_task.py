"""tasks/template.py: a task written as a few members and templates, prompted, valued and searched as
the built-in tasks are, and run from the command line as a plug-in module of a dozen lines."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass

import pytest
from helpers import AwaitableFake, reply
from test_cli import REPO, subprocess_env

from decoding.base.values import DecodeStats, GenRequest, GenResult
from tasks.base import DataError, DataSpec, Problem
from tasks.template import TemplateTask
from tot.search.base import GenSettings, run_sync
from tot.search.bfs import BFS, BFSSettings

PROBLEM = Problem("r1", "What has keys but opens no locks?", "a piano")


@dataclass
class Riddles(TemplateTask):
    name: str = "riddles"
    depth: int = 3


def test_prompts_come_from_the_templates():
    task = Riddles()
    first = task.generator_prompt(PROBLEM, [])
    assert first.text.startswith(PROBLEM.question) and "Write step 1" in first.text
    assert first.prefix == "Step 1:" and first.stop == ("\n\n", "\nStep")
    later = task.generator_prompt(PROBLEM, ["It has keys.", "It makes music."])
    assert "1. It has keys.\n2. It makes music.\n\nWrite step 3" in later.text and later.prefix == "Step 3:"
    asked = task.evaluator_prompt(PROBLEM, ["It has keys."])
    assert "1. It has keys.\n" in asked.text and asked.prefix == "Answer:"
    assert task.value_answers() == {" Yes": 1.0, " No": 0.0}
    scored = Riddles(value="expected")
    assert scored.evaluator_prompt(PROBLEM, ["x"]).prefix == "Score:" and len(scored.value_answers()) == 10
    assert scored.parse_value(" 7, it is close") == 7.0 and Riddles(value="sampled").parse_value("no idea") == 0.0
    assert task.parse_thought(PROBLEM, [], " It has\n keys. ") == "It has keys."


def test_what_a_problem_is_by_default(tmp_path):
    task = Riddles()
    steps = ["It has keys.", "So the answer is A Piano."]
    assert task.is_terminal(PROBLEM, steps) and not task.is_terminal(PROBLEM, steps[:1])
    assert task.answer(PROBLEM, steps) == "A Piano" and task.is_correct(PROBLEM, task.answer(PROBLEM, steps))
    assert not task.is_correct(PROBLEM, "a keyboard")
    data = tmp_path / "riddles.jsonl"
    data.write_text("\n".join(json.dumps({"question": q, "answer": a}) for q, a in [("Q1", "A1"), ("Q2", "A2")]))
    problems = task.load(DataSpec(path=str(data), limit=1))
    assert [(p.id, p.question, p.gold) for p in problems] == [("0", "Q1", "A1")]
    with pytest.raises(DataError, match=r"has no built-in problems; give data\.path"):
        task.load(DataSpec())


def test_a_bare_yes_from_a_yaml_file_is_named():
    with pytest.raises(DataError, match=r'a bare yes in a yaml file reads as true; write value: "yes"$'):
        Riddles(value=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["generator_template", "evaluator_template", "solution_template"])
@pytest.mark.parametrize("template", ["{question} {answer}", "{question.upper.x}", "{steps[7]}", "{n:q}", "{", 3])
def test_a_template_that_does_not_render_is_refused_at_load(key, template):
    """Rendered on a sample problem and path as a search renders it: an unknown field, an attribute or
    index the value has not, a bad format spec, a lone brace, or no text at all: one line naming it."""
    with pytest.raises(
        DataError, match=rf"^task\.{key}=.* is not (a template of \{{question\}}, \{{steps\}} and \{{n\}}|text)"
    ):
        Riddles(**{key: template})


@pytest.mark.parametrize("prefix", ["Step {question}:", "Step {n.real.x}:", "{"])
def test_the_generator_prefix_is_rendered_at_load_too(prefix):
    with pytest.raises(DataError, match=r"^task\.generator_prefix=.* is not a template of \{n\} "):
        Riddles(generator_prefix=prefix)


def test_an_empty_answer_phrase_is_refused():
    with pytest.raises(DataError, match=r"task\.answer_phrase='' is empty"):
        Riddles(answer_phrase="")


class ChoiceEngine(AwaitableFake):
    """Thought k is "clue k", or at depth 2 "the answer is a piano" for even k; an evaluation (a choice
    over " Yes" and " No") gives P(Yes) = 0.9 to a path that names the piano, else 0.3."""

    def __init__(self) -> None:
        self.requests: list[GenRequest] = []
        self.thoughts = 0
        self.last_stats = DecodeStats()

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        out = []
        for r in requests:
            self.requests.append(r)
            if r.choices:
                yes = 0.9 if "piano" in r.prompt else 0.3
                result = reply("", [])
                out.append(GenResult("", [], "stop", result.stats, choice_logprobs=[math.log(yes), math.log(1 - yes)]))
            else:
                k, self.thoughts = self.thoughts, self.thoughts + 1
                final = r.prefix == "Step 2:" and k % 2 == 0
                out.append(reply(" the answer is a piano." if final else f" clue {k}", [5, 6]))
        self.last_stats = DecodeStats(generated_tokens=2 * len(requests))
        return out


def test_bfs_searches_a_template_task_valued_by_p_yes():
    engine = ChoiceEngine()
    gen = GenSettings(temperature=0.7, max_thought_tokens=20, max_eval_tokens=4)
    solution = run_sync(BFS.over(Riddles(), BFSSettings(n_thoughts=2, breadth=1), gen, 0).solve(PROBLEM, engine))
    evaluations = [r for r in engine.requests if r.choices]
    assert evaluations and all(r.choices == (" Yes", " No") and r.prefix == "Answer:" for r in evaluations)
    assert solution.answer == "a piano" and Riddles().is_correct(PROBLEM, solution.answer)
    values = sorted({round(t.value, 6) for t in solution.tree.thoughts.values() if t.value is not None})
    assert values == [0.3, 0.9]  # P(Yes) read from the choice, one forward a state


PLUGIN = '''
"""Riddles: a task in a few lines."""

from dataclasses import dataclass

from tasks import TaskPlugin
from tasks.template import TemplateTask


@dataclass
class Riddles(TemplateTask):
    name: str = "riddles"
    depth: int = 2


PLUGIN = TaskPlugin(name="riddles", build=Riddles, options=Riddles)
'''


def test_a_template_task_runs_from_the_command_line(gsm8k_tiny, tmp_path):
    (tmp_path / "toy_riddles.py").write_text(PLUGIN)
    (tmp_path / "conf" / "task").mkdir(parents=True)
    (tmp_path / "conf" / "task" / "riddles.yaml").write_text("# Riddles.\nname: riddles\ndepth: 2\nvalue: 'yes'\n")
    data = tmp_path / "riddles.jsonl"
    data.write_text(json.dumps({"question": PROBLEM.question, "answer": PROBLEM.gold}) + "\n")
    env = subprocess_env()
    env.update(TOT_SPEC_PLUGINS="toy_riddles", PYTHONPATH=f"{tmp_path}:{env.get('PYTHONPATH', '')}")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tot.solve", "task=riddles", f"data.path={data}", f"model.path={gsm8k_tiny}"]
    cmd += ["decoder=ar", "gen.max_thought_tokens=6", f"hydra.run.dir={out}"]
    cmd += [f"hydra.searchpath=[file://{tmp_path / 'conf'}]"]
    bad = subprocess.run(
        [*cmd, "+task.generator_prefix='{question.x}'"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "task.generator_prefix='{question.x}' is not a template of {n}" in bad.stderr
    assert "loaded" not in bad.stderr  # stopped before the model loads
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["task"], summary["n_problems"]) == ("riddles", 1), summary
    tree = json.loads(next((out / "trees").iterdir()).read_text())
    assert any(node.get("distribution") for node in tree["nodes"]), "states valued from P(Yes), kept in the tree"
