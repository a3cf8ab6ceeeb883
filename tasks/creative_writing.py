"""Creative Writing as ToT sets it up and SEED uses it (Appendix D): depth 2, a plan then a passage of
4 short paragraphs whose paragraphs end with the 4 given sentences in order. The evaluator (and the
judge of the final passages) writes a short analysis that ends "Thus the coherency score is <s>",
s from 1 to 10; a state's value is the mean over `n_evaluate` samples. Whether a passage meets the
ending constraint is checked by code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tasks.base import (
    DataError,
    DataSpec,
    Problem,
    Prompt,
    TaskDefaults,
    TaskPlugin,
    check_evaluator,
    check_positive,
    check_value,
    score_answers,
    text_lines,
)

N_SENTENCES = 4
PLAN_PREFIX = "Plan:\n"
PASSAGE_PREFIX = "Passage:\n"
ANALYSIS_PREFIX = "Analysis:"
SCORE_PREFIX = "Coherency score:"  # task.value=expected: the score read at once
# A sentence ends at . ! or ? (with closing quotes or brackets) before whitespace or the end.
_SENTENCE = re.compile(r".+?[.!?][\"”’')]*(?=\s+|$)")
# Some inputs glue a fragment without final punctuation to the next sentence ("... party You realize").
_RUN_ON = re.compile(r"^(.*?[a-z]) ([A-Z].*)$")
_SCORE = re.compile(r"coherency score is\W{0,3}(\d+(?:\.\d+)?)", re.IGNORECASE)
_QUOTES = str.maketrans({"“": '"', "”": '"', "„": '"', "‘": "'", "’": "'", "`": "'"})


def split_sentences(text: str) -> list[str]:
    """The input's sentences: split after sentence punctuation, then fragments glued to a sentence
    are split at a lowercase-to-capital word boundary until there are N_SENTENCES."""
    sentences = [s.strip() for s in _SENTENCE.findall(text.strip())]
    tail = text.strip()[sum(len(s) for s in _SENTENCE.findall(text.strip())) :].strip()
    if tail:
        sentences.append(tail)
    while len(sentences) < N_SENTENCES:
        for i, s in enumerate(sentences):
            m = _RUN_ON.match(s)
            if m:
                sentences[i : i + 1] = [m.group(1), m.group(2)]
                break
        else:
            break
    return sentences


def normalize(text: str) -> str:
    """Compare sentences ignoring quote style (curly or straight, present or not) and whitespace."""
    text = text.translate(_QUOTES).replace('"', "").replace("'", "")
    return " ".join(text.split())


def paragraphs(passage: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", passage.strip()) if p.strip()]


# Where the passage ends and talk about it begins, in replies of small chat models ("Explanation:",
# "In this passage, ...", the instruction echoed back): looked for only after a paragraph of passage.
_COMMENTARY = re.compile(
    r"^[*#\s]*(?:(?:explanation|note|notes|analysis)\s*:|in this passage\b|the passage above\b|write the passage\b)",
    re.IGNORECASE,
)
# Before the passage: a title line ("**Title: ...**", "# ...") or a label ("Passage:", "Story:").
_TITLE = re.compile(r"^(?:[*\s]*title\s*:|#+\s)[^\n]*$", re.IGNORECASE)
_LABEL = re.compile(r"^[*\s]*(?:passage|story)\s*:[*\s]*", re.IGNORECASE)
# A paragraph's number ("1.", "2)", "Paragraph 3:"), not a number that starts its text ("1984.", "2.5").
_PARAGRAPH_LABEL = re.compile(r"^[*\s]*(?:paragraph\s*\d+\s*[:.]?|\d{1,2}[.)](?!\d))[*]*\s+", re.IGNORECASE)


def passage_of(reply: str) -> str:
    """The passage a reply writes: its paragraphs without their numbers, a title or label before
    them and any commentary after them dropped."""
    kept: list[str] = []
    for para in paragraphs(reply):
        if kept and _COMMENTARY.match(para):
            break
        if not kept and _TITLE.match(para):
            continue
        if not kept:
            para = _LABEL.sub("", para, count=1).strip()
            if not para:
                continue
        kept.append(_PARAGRAPH_LABEL.sub("", para, count=1))
    return "\n\n".join(kept)


def endings_met(passage: str, sentences: list[str]) -> list[bool]:
    """Per required sentence: does paragraph i end with sentence i? (Missing paragraphs do not.)"""
    paras = paragraphs(passage)
    return [i < len(paras) and normalize(paras[i]).endswith(normalize(s)) for i, s in enumerate(sentences)]


def meets_constraint(passage: str, sentences: list[str]) -> bool:
    """Exactly len(sentences) paragraphs, each ending with its sentence, in order."""
    return len(paragraphs(passage)) == len(sentences) and all(endings_met(passage, sentences))


def parse_score(text: str) -> float:
    """The s of the last "coherency score is s" with 1 <= s <= 10; 0 when there is none (an
    evaluation that gives no score counts as the worst)."""
    for found in reversed(_SCORE.findall(text)):
        v = float(found)
        if 1 <= v <= 10:
            return v
    return 0.0


@dataclass
class CreativeWriting(TaskDefaults):
    depth: int = 2
    n_evaluate: int = 3
    evaluator: str = "separate"
    value: str = "sampled"
    name: str = "creative_writing"
    judge_metric: str = "coherency"

    def __post_init__(self) -> None:
        check_positive(self.name, depth=self.depth, n_evaluate=self.n_evaluate)
        check_evaluator(self.name, self.evaluator)
        check_value(self.name, self.value, ("sampled", "expected", "confidence"))
        if self.depth > 2:
            raise DataError(
                f"task.depth={self.depth}: creative writing has 2 steps (a plan, then the passage); use 1 or 2"
            )

    def load(self, data: DataSpec) -> list[Problem]:
        if data.path:
            path = Path(data.path).expanduser()
            if not path.is_file():
                raise DataError(f"data.path={path} does not exist; give a text file with 4 sentences per line")
        else:
            path = Path(str(resources.files("tasks.data") / "creative_writing_examples.txt"))
        problems = []
        lines = text_lines(path)
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            sentences = split_sentences(line)
            if len(sentences) != N_SENTENCES:
                raise DataError(
                    f"{path}:{lineno}: found {len(sentences)} sentences, need {N_SENTENCES}; "
                    "each line holds the 4 sentences that end the paragraphs"
                )
            pid = f"{path.stem}-{lineno - 1}"
            problems.append(Problem(pid, line.strip(), "", meta={"sentences": sentences}, line=lineno))
        if not problems:
            raise DataError(f"data.path={path} holds no lines")
        return data.select(problems, f"data file {path}")

    def _instruction(self, problem: Problem) -> str:
        endings = "\n".join(f"{i}. {s}" for i, s in enumerate(problem.meta["sentences"], 1))
        return (
            "Write a coherent passage of 4 short paragraphs. The end sentence of each paragraph must be, "
            f"in this order:\n{endings}"
        )

    # --- thought generator -------------------------------------------------------------------
    def generator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        if not steps and self.depth > 1:
            return Prompt(
                self._instruction(problem) + "\n\nFirst make a plan: one short line per paragraph saying "
                "what it is about and how it leads to its end sentence. Write only the plan.",
                prefix=PLAN_PREFIX,
                stop=("Passage:",),
            )
        return self._passage_prompt(problem, f"\n\nFollow this plan:\n{steps[-1]}" if steps else "")

    def _passage_prompt(self, problem: Problem, plan: str) -> Prompt:
        return Prompt(
            self._instruction(problem) + plan + "\n\nWrite the passage: 4 paragraphs separated by blank lines, "
            "each ending with its sentence exactly as given.",
            prefix=PASSAGE_PREFIX,
        )

    def parse_thought(self, problem: Problem, steps: list[str], text: str) -> str:
        return text.strip()

    # --- state evaluator ---------------------------------------------------------------------
    def evaluator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        what = "passage" if len(steps) >= self.depth else "plan for a passage"
        return self._score_prompt(problem, what, steps[-1])

    def follow_up_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        return self._follow_up("passage" if len(steps) >= self.depth else "plan")

    def value_answers(self) -> dict[str, float]:
        return score_answers(1, 10)

    def _follow_up(self, what: str) -> Prompt:
        if self.value == "expected":  # the score at once, read in one forward
            return Prompt(
                f"Is your {what} coherent, and does it lead to each end sentence in order? Reply "
                '"Coherency score: <s>", where s is an integer from 1 to 10.',
                prefix=SCORE_PREFIX,
            )
        return Prompt(
            f"Analyze your {what} in two or three sentences: is it coherent, and does it lead to each end sentence "
            'in order? Then conclude on the last line "Thus the coherency score is <s>", where s is an integer from '
            "1 to 10.",
            prefix=ANALYSIS_PREFIX,
        )

    def _score_prompt(self, problem: Problem, what: str, text: str) -> Prompt:
        if self.value == "expected":
            return Prompt(
                f"{self._instruction(problem)}\n\nHere is a {what}:\n{text}\n\nIs the {what} coherent, and does "
                'it lead to each end sentence in order? Reply "Coherency score: <s>", where s is an integer from 1 '
                "to 10.",
                prefix=SCORE_PREFIX,
            )
        return Prompt(
            f"{self._instruction(problem)}\n\nHere is a {what}:\n{text}\n\n"
            f"Analyze the {what} in two or three sentences: is it coherent, and does it lead to each end "
            'sentence in order? Then conclude on the last line "Thus the coherency score is <s>", where s '
            "is an integer from 1 to 10.",
            prefix=ANALYSIS_PREFIX,
        )

    def parse_value(self, text: str) -> float:
        return parse_score(text)

    # --- whole solutions (best-of-N) ---------------------------------------------------------
    def solution_prompt(self, problem: Problem, i: int = 0) -> Prompt:
        return self._passage_prompt(problem, "")

    def solution_steps(self, problem: Problem, reply: str, i: int = 0) -> list[str]:
        return [reply.strip()]

    def solution_evaluator_prompt(self, problem: Problem, steps: list[str], follow_up: bool) -> Prompt:
        return self._follow_up("passage") if follow_up else self._score_prompt(problem, "passage", steps[-1])

    # --- scoring -----------------------------------------------------------------------------
    def answer(self, problem: Problem, steps: list[str]) -> str:
        """The passage the final step writes (labels, headings and commentary dropped)."""
        return passage_of(steps[-1]) if steps else ""

    def is_correct(self, problem: Problem, answer: str) -> bool:
        return meets_constraint(answer, problem.meta["sentences"])

    def metrics(self, problem: Problem, answer: str) -> dict[str, float]:
        met = endings_met(answer, problem.meta["sentences"])
        return {"endings_met": sum(met) / len(met), "paragraphs": float(len(paragraphs(answer)))}

    def judge_prompt(self, problem: Problem, answer: str) -> Prompt | None:
        return self._score_prompt(problem, "passage", answer)


PLUGIN = TaskPlugin(name="creative_writing", build=CreativeWriting, options=CreativeWriting)
