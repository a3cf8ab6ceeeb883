"""Creative Writing: sentence splitting of the real inputs, the ending-constraint check, the score parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks import make_task
from tasks.base import DataError, DataSpec
from tasks.creative_writing import (
    endings_met,
    meets_constraint,
    normalize,
    paragraphs,
    parse_score,
    passage_of,
    split_sentences,
)

DATA = Path(__file__).resolve().parents[2] / "shared/data/creative_writing/data_100_random_text.txt"
SENTENCES = ["The cat slept.", 'He said "no" twice.', "It rained all day!", "Why not?"]
GOOD = (
    "A warm sun fell on the sofa. The cat slept.\n\n"
    "Tom was asked to help. He said “no” twice.\n\n"
    "Nobody went out.   It rained all day!\n\n"
    "We could stay in forever. Why not?"
)


def test_split_sentences_plain_and_glued_fragments():
    assert split_sentences(" ".join(SENTENCES)) == SENTENCES
    # A fragment without final punctuation glued to the next sentence, as in some real inputs.
    glued = "Instead of a bachelorette party You realize it is late. She laughed. The end came."
    assert split_sentences(glued) == [
        "Instead of a bachelorette party",
        "You realize it is late.",
        "She laughed.",
        "The end came.",
    ]
    # Already four sentences: names inside a sentence are not split off.
    assert len(split_sentences("I met Grandpa Joe. She laughed. The end came. Bye now.")) == 4


@pytest.mark.skipif(not DATA.is_file(), reason=f"{DATA} absent (../shared is not beside the repo)")
def test_every_real_input_has_four_sentences():
    task = make_task("creative_writing", 2)
    problems = task.load(DataSpec(path=str(DATA)))
    assert len(problems) == 100
    assert all(len(p.meta["sentences"]) == 4 for p in problems)
    # Splitting loses no text: the sentences put back together are the line.
    assert all(normalize(" ".join(p.meta["sentences"])) == normalize(p.question) for p in problems)


def test_constraint_met_with_curly_quotes_and_extra_spaces():
    assert paragraphs(GOOD) == [p.strip() for p in GOOD.split("\n\n")]
    assert endings_met(GOOD, SENTENCES) == [True] * 4
    assert meets_constraint(GOOD, SENTENCES)


def test_constraint_failures():
    swapped = GOOD.replace("The cat slept.", "X.").replace("We could stay in forever. Why not?", "The cat slept.")
    assert endings_met(swapped, SENTENCES) == [False, True, True, False]
    assert not meets_constraint(swapped, SENTENCES)
    three = "\n\n".join(GOOD.split("\n\n")[:3])
    assert endings_met(three, SENTENCES) == [True, True, True, False]
    assert not meets_constraint(three, SENTENCES)
    five = GOOD + "\n\nAn extra paragraph. Why not?"
    assert not meets_constraint(five, SENTENCES)
    # The sentence in the middle of the paragraph, not at its end, does not count.
    middle = GOOD.replace("The cat slept.", "The cat slept. Then it woke.")
    assert endings_met(middle, SENTENCES)[0] is False


def test_parse_score():
    assert parse_score("Fine.\nThus the coherency score is 7") == 7.0
    assert parse_score('Thus the coherency score is "8".') == 8.0
    assert parse_score("coherency score is 3 ... so thus the coherency score is 9.") == 9.0  # the last one
    assert parse_score("Thus the coherency score is 11") == 0.0  # out of range
    assert parse_score("I would give it 7 out of 10") == 0.0  # no conclusion: the worst value
    assert parse_score("") == 0.0


def test_task_scores_and_prompts():
    task = make_task("creative_writing", 2)
    problem = task.load(DataSpec(limit=1))[0]
    sentences = problem.meta["sentences"]
    passage = "\n\n".join(f"Some words. {s}" for s in sentences)
    assert task.is_correct(problem, passage)
    assert task.metrics(problem, passage) == {"endings_met": 1.0, "paragraphs": 4.0}
    assert task.metrics(problem, "nothing")["endings_met"] == 0.0
    plan = task.generator_prompt(problem, [])
    write = task.generator_prompt(problem, ["1. a\n2. b"])
    assert plan.prefix.startswith("Plan") and write.prefix.startswith("Passage") and "1. a\n2. b" in write.text
    assert all(s in plan.text for s in sentences)
    judge = task.judge_prompt(problem, passage)
    assert judge is not None and "coherency score is" in judge.text and passage in judge.text
    assert "plan" in task.evaluator_prompt(problem, ["a plan"]).text
    assert task.answer(problem, ["a plan", passage]) == passage


def test_task_option_errors():
    with pytest.raises(DataError, match=r"task\.depth=3"):
        make_task("creative_writing", 3)
    with pytest.raises(DataError, match=r"task\.n_evaluate=0"):
        make_task("creative_writing", 2, {"n_evaluate": 0})
    with pytest.raises(DataError, match=r"task\.colour is not an option"):
        make_task("creative_writing", 2, {"colour": 1})


def test_bad_line_named(tmp_path):
    path = tmp_path / "cw.txt"
    path.write_text("One. Two. Three. Four.\nonly one sentence here\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"cw\.txt:2: found 1 sentences"):
        make_task("creative_writing", 2).load(DataSpec(path=str(path)))


# Passages SmolLM2-135M-Instruct wrote as the final step of ToT-BFS runs on data_100_random_text.txt
# (problems 1 and 2; cut where marked): commentary after the passage, numbered paragraphs.
REAL_WITH_COMMENTARY = (
    "\nIn a world where ideas are just a way to measure our success, it is crucial to focus on what truly "
    "matters. It is the little actions that can be made every day that can make a huge difference.\n\n"
    "Explanation:\n\nIn this passage, we have the main idea of achieving something. The plan is to take a "
    "small action every day and make a positive impact.\n\nWrite the passage: Another sentence to note: 4 "
    "paragraphs separated by blank lines, each ending with its sentence exactly as given."
)
REAL_NUMBERED = (
    "1. The moment I was born is a lesson that has been repeated many times before its use. [...] I will share "
    "with you a personal story that makes Christmas more than just a holiday with decorations.\n\n"
    "2. When I was 14 years old, I went to a church with my brother. [...] But when I was born 4 years after, "
    "I realized something.\n\n"
    "3. When I was born 4 years after, I realized that I am a special person that I have never seen before. "
    "[...] I have never heard of your name before.\n\n"
    "4. When I was born 4 years after, I realized that I am a special person that I never believed could be "
    "anything but special. I never believed that you could be"
)


def test_passage_of_real_replies():
    assert passage_of(REAL_WITH_COMMENTARY) == (
        "In a world where ideas are just a way to measure our success, it is crucial to focus on what truly "
        "matters. It is the little actions that can be made every day that can make a huge difference."
    )
    numbered = paragraphs(passage_of(REAL_NUMBERED))
    assert len(numbered) == 4 and numbered[1].startswith("When I was 14 years old")
    assert numbered[3].endswith("I never believed that you could be")  # cut by the token limit: kept as it is


NUMBERED = "\n\n".join(f"{i}. {para}" for i, para in enumerate(GOOD.split("\n\n"), 1))


def test_passage_text_that_looks_like_a_label_or_commentary_is_kept():
    story = (
        "I hope she never finds out, I thought.\n\nThis passage of time was hard.\n\n"
        "1984. The year it rained.\n\n2.5 million people watched. Note, the dog: it slept."
    )
    assert passage_of(story) == story
    assert passage_of("# Notes on a Scandal\n\n" + story) == story
    assert passage_of("Story: it began at dawn.\n\n" + story) == "it began at dawn.\n\n" + story


@pytest.mark.parametrize(
    "reply, met_as_written",
    [
        (NUMBERED, True),  # numbering starts a paragraph: its ending still counts
        ("**Paragraph 1:** " + GOOD + "\n\nIn this passage, every paragraph ends with its sentence.", False),
        ("Passage:\n\n" + GOOD + "\n\nExplanation: the endings are kept.", False),
        ("**Title: A Rainy Day**\n\n" + GOOD + "\n\nNote: written in four paragraphs.", False),
    ],
)
def test_labelled_or_commented_passages_meet_the_constraint(reply, met_as_written):
    task = make_task("creative_writing", 2, {})
    problem = task.load(DataSpec())[0]
    problem.meta["sentences"] = SENTENCES
    assert meets_constraint(reply, SENTENCES) == met_as_written
    assert task.answer(problem, ["a plan", reply]) == GOOD
    assert task.is_correct(problem, task.answer(problem, ["a plan", reply]))


def test_a_whole_passage_in_one_reply():
    task = make_task("creative_writing", 2)
    problem = task.load(DataSpec(limit=1))[0]
    passage = "\n\n".join(f"Some words. {s}" for s in problem.meta["sentences"])
    prompt = task.solution_prompt(problem)
    assert prompt.prefix.startswith("Passage") and "plan" not in prompt.text.lower()
    steps = task.solution_steps(problem, f"\n{passage}\n")
    assert steps == [passage] and task.is_correct(problem, task.answer(problem, steps))
    judged = task.solution_evaluator_prompt(problem, steps, follow_up=False)
    assert passage in judged.text and "coherency score is" in judged.text
    assert task.solution_evaluator_prompt(problem, steps, follow_up=True).text.startswith("Analyze your passage")
