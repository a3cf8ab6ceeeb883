"""The GSM8K task: number extraction, gold answers, values, data loading and its errors, prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.base import DataError, DataSpec, Problem
from tasks.gsm8k import (
    FINAL_PREFIX,
    GSM8K,
    SCORE_PREFIX,
    extract_number,
    gold_answer,
    parse_value,
    stated_sentence,
    strict_answer,
)

# The benchmark data lies beside the project (../shared), as in CI; the test needs it, not the package.
SHARED_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"

BUNDLED = {
    "bundled-1": "12",
    "bundled-2": "110",
    "bundled-3": "20",
    "bundled-4": "56",
    "bundled-5": "180",
    "bundled-6": "12",
}


# --- extract_number ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 apples and 5 pears", "5"),
        ("The answer is 12 muffins.", "12"),
        ("The answer is 12.", "12"),
        ("She earns 1,234 dollars", "1234"),
        ("1,234,567", "1234567"),
        ("It costs $56.", "56"),
        ("It costs $1,234.50 in all", "1234.5"),
        ("18.00", "18"),
        ("The answer is $18.00.", "18"),
        ("-7", "-7"),
        ("The temperature changes by -3.50 degrees", "-3.5"),
        ("from 4 to -0", "0"),
        ("5 - 3 = 2", "2"),
        ("0.25", "0.25"),
    ],
)
def test_extract_number(text, expected):
    assert extract_number(text) == expected


@pytest.mark.parametrize("text", ["", "no number here", "The answer is twelve.", "$", ", ."])
def test_extract_number_none(text):
    assert extract_number(text) is None


# --- strict and flexible extraction, on real model outputs ------------------------------------

# Final-answer steps SmolLM2-135M-Instruct wrote in ToT-BFS runs on GSM8K (n = 8; the first from the
# bundled problems, the others from test problems 0-4): (text, strict, flexible, the stated sentence).
REAL_FINAL_STEPS = [
    (
        "The answer is 10. To calculate the total number of muffins sold, we multiply the number of days (30) "
        "by the number of muffins sold per day (18).",
        "10",
        "18",
        "The answer is 10.",
    ),
    (
        "The answer is 10 cents. If you want to find the total cost of ten cents per week, you can multiply 10 "
        "cents by 15 (which is 100 cents, since you multiply by 15).",
        "10",
        "15",
        "The answer is 10 cents.",
    ),
    (
        "The answer is 150% of the house's value. The process of calculating the difference, multiplying that "
        "result by the percentage, and then adding 50% is correct.",
        "150",
        "50",
        "The answer is 150% of the house's value.",
    ),
    (
        "The answer is 25. To find out how much the original house sold for 80,000, you multiply 80,000 by "
        "50,000, which gives you 400,000. So, the answer is 400,000.",
        "25",
        "400000",
        "The answer is 25.",
    ),
    (
        "The answer is 1.333. One more step to the final answer is to calculate the total cost of ten cents per week.",
        "1.333",
        "1.333",
        "The answer is 1.333.",
    ),
    ("The answer is 6.34, which is the total distance James runs a week.", "6.34", "6.34", None),
    ("The answer is 0.55.", "0.55", "0.55", None),
    ("The answer is 6.34", "6.34", "6.34", None),
]
# Awkward spellings beside them: currency, separators, signs, the GSM8K answer mark, no number stated.
AWKWARD = [
    ("The answer is $1,250.50. That is what she paid.", "1250.5", "1250.5", "The answer is $1,250.50."),
    ("The answer is -3 degrees, a drop of 3.", "-3", "3", None),
    ("The answer is $-4.", "-4", "-4", None),
    ("The final answer is: 42 apples", "42", "42", None),
    ("So 8 * 9 = 72 in all.\n#### 72", "72", "72", None),
    ("The answer is 3,000 people.", "3000", "3000", None),
    ("The answer is approximately 12.50 dollars.", "12.5", "12.5", None),
    ("The answer is twelve, so 12 - 0 = 12 eggs.", None, "12", None),
    ("She has 5 apples and buys 7 more.", None, "7", None),
    # A calculation after the phrase states no number: its result is the flexible reading.
    ("The answer is 40 - 12 = 28.", None, "28", None),
    ("The answer is 5 * 3 = 15 apples.", None, "15", None),
    ("The answer is **18**.", "18", "18", None),
    ("The answer is \\boxed{18}", "18", "18", None),
    ("The answer is −5 degrees.", "-5", "5", None),
    ("The answer is 10,000.", "10000", "10000", None),
]


@pytest.mark.parametrize("text, strict, flexible, sentence", REAL_FINAL_STEPS + AWKWARD)
def test_strict_and_flexible_extraction(text, strict, flexible, sentence):
    assert strict_answer(text) == strict
    assert extract_number(text) == flexible
    assert stated_sentence(text) == (sentence or text)


def test_answer_prefers_the_stated_number_and_reports_both():
    task = GSM8K(thoughts="subquestions")
    problem = Problem("p", "How many muffins?", "10")
    step = REAL_FINAL_STEPS[0][0]
    assert task.answers(problem, ["a", "b", "c", step]) == {"strict": "10", "flexible": "18"}
    assert task.answer(problem, ["a", "b", "c", step]) == "10"  # the old rule read 18
    no_phrase = "So the total is 18 muffins."
    assert task.answers(problem, [no_phrase]) == {"strict": "", "flexible": "18"}
    assert task.answer(problem, [no_phrase]) == "18"  # the flexible fallback


def test_the_evaluator_values_the_stated_answer_of_a_final_step():
    task = GSM8K(thoughts="subquestions")
    problem = Problem("p", "How many muffins?", "10")
    step = REAL_FINAL_STEPS[0][0]
    assert task.parse_thought(problem, ["s1", "s2", "s3"], step[len(FINAL_PREFIX) :]) == step  # the tree keeps it all
    final = task.evaluator_prompt(problem, ["s1", "s2", "s3", step]).text
    assert "The final answer is:\nThe answer is 10.\n" in final and "(18)" not in final
    # An intermediate step is valued as written.
    middle = task.evaluator_prompt(problem, ["s1", "Sub-question 2: How many? Sub-answer 2: 3. Then 4."]).text
    assert "Sub-answer 2: 3. Then 4." in middle


# --- gold_answer ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("She makes 24 + 18 = 42 muffins.\n#### 12", "12"),
        ("Lots of steps, 3 and 4.\n#### 1,234", "1234"),
        ("#### $56", "56"),
        ("#### 18.00", "18"),
        ("#### -5", "-5"),
        ("a #### 3 then\n#### 7", "7"),
    ],
)
def test_gold_answer(answer, expected):
    assert gold_answer(answer) == expected


def test_gold_answer_errors():
    with pytest.raises(ValueError, match="####"):
        gold_answer("The answer is 12")
    with pytest.raises(ValueError, match="not a number"):
        gold_answer("#### twelve")


# --- parse_value ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Score: 7 because the step is right.", 7.0),
        ("Score: 7.5", 7.5),
        ("Score: 3/10, the calculation is wrong", 3.0),
        # The score keyword wins over an earlier number.
        ("Step 2 looks fine. Score: 9", 9.0),
        ("I would rate it 4 out of 10", 4.0),
        # Out of range: the next in-range number, else 0.
        ("Score: 12. It deserves 6 out of 10", 6.0),
        ("Score: 12", 0.0),
        ("Score: 0", 0.0),
        ("no number at all", 0.0),
        ("", 0.0),
    ],
)
def test_parse_value(text, expected):
    assert parse_value(text) == expected


def test_task_parse_value_adds_prefix():
    task = GSM8K(thoughts="subquestions")
    # The evaluator's reply comes without its prefix "Score:".
    assert task.parse_value(" 8, it is correct.") == 8.0
    assert task.parse_value(" 12") == 0.0


# --- loading ----------------------------------------------------------------------------------


def test_load_bundled():
    problems = GSM8K(thoughts="subquestions").load(DataSpec())
    assert [p.id for p in problems] == list(BUNDLED)
    assert {p.id: p.gold for p in problems} == BUNDLED
    assert problems[0].question.startswith("A baker makes 24 muffins")
    assert all(p.question.endswith("?") for p in problems)


def test_load_bundled_limit_offset():
    problems = GSM8K(thoughts="subquestions").load(DataSpec(limit=2, offset=3))
    assert [p.id for p in problems] == ["bundled-4", "bundled-5"]
    assert [p.gold for p in problems] == ["56", "180"]
    with pytest.raises(
        DataError,
        match=r"data\.offset=10 data\.limit=null selects no problem of data file .*"
        r"gsm8k_examples\.jsonl \(6 problems\); give data\.offset below 6",
    ):
        GSM8K(thoughts="subquestions").load(DataSpec(offset=10))


@pytest.mark.skipif(not SHARED_TEST.is_file(), reason=f"{SHARED_TEST} is absent")
def test_load_shared_test_set():
    lines = SHARED_TEST.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    task = GSM8K(thoughts="subquestions")

    everything = task.load(DataSpec(path=str(SHARED_TEST)))
    assert len(everything) == len(records) == 1319
    assert everything[0].id == "test-0"
    assert everything[0].gold == "18"  # Janet's ducks
    assert everything[-1].id == f"test-{len(records) - 1}"

    some = task.load(DataSpec(path=str(SHARED_TEST), limit=3, offset=5))
    assert [p.id for p in some] == ["test-5", "test-6", "test-7"]
    assert [p.question for p in some] == [r["question"] for r in records[5:8]]
    assert [p.gold for p in some] == [r["answer"].split("####")[-1].strip().replace(",", "") for r in records[5:8]]
    # Ids do not depend on the selection, so a run over a slice can be resumed or merged.
    assert some == everything[5:8]
    assert task.load(DataSpec(path=str(SHARED_TEST), limit=2)) == everything[:2]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _record(q: str = "What is 1 + 1?", a: str = "1 + 1 = 2\n#### 2", **extra) -> str:
    return json.dumps({"question": q, "answer": a, **extra})


def test_load_own_file_ids_and_blank_lines(tmp_path):
    path = _write(tmp_path / "mine.jsonl", [_record(id="q-a"), "", _record(a="#### 1,000"), "   "])
    problems = GSM8K(thoughts="subquestions").load(DataSpec(path=str(path)))
    assert [(p.id, p.gold) for p in problems] == [("q-a", "2"), ("mine-1", "1000")]


def test_invalid_json_names_file_and_line(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [_record(), _record(), '{"question": "x", "answer": '])
    with pytest.raises(DataError) as info:
        GSM8K(thoughts="subquestions").load(DataSpec(path=str(path)))
    message = str(info.value)
    assert f"{path}:3" in message
    assert "JSON" in message
    assert "\n" not in message


def test_record_without_answer_names_line(tmp_path):
    path = _write(tmp_path / "noanswer.jsonl", [_record(), json.dumps({"question": "What?"}), _record()])
    with pytest.raises(DataError) as info:
        GSM8K(thoughts="subquestions").load(DataSpec(path=str(path)))
    message = str(info.value)
    assert f"{path}:2" in message
    assert "answer" in message


def test_record_not_an_object(tmp_path):
    path = _write(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(DataError, match=r"list\.jsonl:1"):
        GSM8K(thoughts="subquestions").load(DataSpec(path=str(path)))


def test_answer_without_hashes_names_line(tmp_path):
    # The blank line makes the record's index (2) differ from its line number (3).
    path = _write(tmp_path / "nohash.jsonl", [_record(), "", _record(a="The answer is 4."), _record()])
    with pytest.raises(DataError) as info:
        GSM8K(thoughts="subquestions").load(DataSpec(path=str(path)))
    message = str(info.value)
    assert f"{path}:3:" in message
    assert "####" in message


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "nowhere" / "missing.jsonl"
    with pytest.raises(DataError) as info:
        GSM8K(thoughts="subquestions").load(DataSpec(path=str(path)))
    assert f"data.path={path}" in str(info.value)
    assert "does not exist" in str(info.value)


def test_empty_file(tmp_path):
    path = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match="no records"):
        GSM8K(thoughts="subquestions").load(DataSpec(path=str(path)))


@pytest.mark.parametrize("kwargs, named", [({"limit": 0}, "data.limit=0"), ({"offset": -1}, "data.offset=-1")])
def test_data_spec_validation(kwargs, named):
    with pytest.raises(DataError, match=named):
        DataSpec(**kwargs)


# --- scoring ----------------------------------------------------------------------------------

PROBLEM = Problem(id="p1", question="A baker makes 24 muffins and sells 12. How many are left?", gold="12")


def test_is_correct():
    task = GSM8K(thoughts="subquestions")
    assert task.is_correct(PROBLEM, "12")
    assert not task.is_correct(PROBLEM, "13")
    assert not task.is_correct(PROBLEM, "")
    assert not task.is_correct(Problem(id="z", question="?", gold=""), "")


def test_answer_from_last_step():
    task = GSM8K(thoughts="subquestions")
    steps = ["Sub-question 1: How many? Sub-answer 1: 24 - 12 = 12.", "The answer is $1,200.00 muffins."]
    assert task.answer(PROBLEM, steps) == "1200"
    assert task.answer(PROBLEM, ["The answer is unclear."]) == ""
    assert task.answer(PROBLEM, []) == ""
    assert task.is_correct(PROBLEM, task.answer(PROBLEM, ["Sub-answer: 3", "The answer is 12 muffins."]))


# --- prompts ----------------------------------------------------------------------------------


def test_generator_prompt_first_step():
    task = GSM8K(thoughts="subquestions", depth=4)
    prompt = task.generator_prompt(PROBLEM, [])
    assert PROBLEM.question in prompt.text
    assert "none yet" in prompt.text
    assert prompt.prefix == "Sub-question 1:"
    assert "Sub-question 2" in prompt.stop


def test_generator_prompt_contains_previous_steps():
    task = GSM8K(thoughts="subquestions", depth=4)
    steps = ["Sub-question 1: How many in all? Sub-answer 1: 24.", "Sub-question 2: Sold? Sub-answer 2: 12."]
    prompt = task.generator_prompt(PROBLEM, steps)
    assert PROBLEM.question in prompt.text
    assert all(s in prompt.text for s in steps)
    assert prompt.text.index(steps[0]) < prompt.text.index(steps[1])
    assert prompt.prefix == "Sub-question 3:"
    assert "Sub-question 4" in prompt.stop
    assert FINAL_PREFIX not in prompt.prefix


@pytest.mark.parametrize("depth", [1, 2, 4, 5])
def test_final_step_uses_final_prefix(depth):
    task = GSM8K(thoughts="subquestions", depth=depth)
    steps = [f"Sub-question {k}: q{k}? Sub-answer {k}: {k}." for k in range(1, depth)]
    prompt = task.generator_prompt(PROBLEM, steps)
    assert prompt.prefix == FINAL_PREFIX
    assert all(s in prompt.text for s in steps)
    assert prompt.stop == ("\n",)
    if depth > 1:
        assert task.generator_prompt(PROBLEM, steps[:-1]).prefix == f"Sub-question {depth - 1}:"


def test_parse_thought_reattaches_prefix():
    task = GSM8K(thoughts="subquestions", depth=4)
    first = task.parse_thought(PROBLEM, [], " How many in all?\nSub-answer 1: 24.  ")
    assert first == "Sub-question 1: How many in all?\nSub-answer 1: 24."
    steps = ["s1", "s2", "s3"]
    final = task.parse_thought(PROBLEM, steps, " 12 muffins.")
    assert final == "The answer is 12 muffins."
    assert task.answer(PROBLEM, [*steps, final]) == "12"


def test_evaluator_prompt():
    task = GSM8K(thoughts="subquestions", depth=4)
    steps = ["Sub-question 1: How many in all? Sub-answer 1: 24.", "Sub-question 2: Sold? Sub-answer 2: 12."]
    prompt = task.evaluator_prompt(PROBLEM, steps)
    assert PROBLEM.question in prompt.text
    assert all(s in prompt.text for s in steps)
    assert "latest step" in prompt.text
    assert prompt.prefix == SCORE_PREFIX
    final = task.evaluator_prompt(PROBLEM, [*steps, "s3", "The answer is 12."])
    assert "final answer" in final.text
    assert "The answer is 12." in final.text


def test_whole_solution_prompt_steps_and_evaluator():
    task = GSM8K(thoughts="subquestions")
    problem = Problem(id="x", question="Tom has 3 apples and buys 4 more. How many now?", gold="7")
    prompt = task.solution_prompt(problem)
    assert prompt.text.startswith(problem.question) and "step by step" in prompt.text
    assert "The answer is <number>." in prompt.text and prompt.stop == ()  # a chat model's paragraphs stay whole
    steps = task.solution_steps(problem, " Tom has 3 + 4 = 7 apples. The answer is 7.\n")
    assert steps == ["Tom has 3 + 4 = 7 apples. The answer is 7."]
    assert task.answer(problem, steps) == "7" and task.is_correct(problem, "7")
    judged = task.solution_evaluator_prompt(problem, steps, follow_up=False)
    assert steps[0] in judged.text and problem.question in judged.text and judged.prefix == SCORE_PREFIX
    assert "final answer" in task.solution_evaluator_prompt(problem, steps, follow_up=True).text


def test_a_boxed_answer_is_a_stated_one():
    """Chat models trained on math box their answer: the strict extraction reads the last boxed
    number where no answer phrase states one."""
    assert strict_answer("So 5 x 2 = 10.\n\nTherefore, the answer is:\n\\[ \\boxed{10} \\]") == "10"
    assert strict_answer("first \\boxed{3}, then \\(\\boxed{1,250}\\)") == "1250"
    assert strict_answer("it costs \\boxed{\\$18.50}") == "18.5"
    assert strict_answer("The answer is 7. Not \\boxed{8}") == "7"  # the phrase first
    assert strict_answer("\\boxed{x + 1}") is None


# --- thoughts as paragraphs of the model's own solution (the default) -------------------------


def test_a_paragraph_thought_continues_the_models_own_solution():
    task = GSM8K()
    problem = Problem("p", "Janet has 3 apples and buys 2. How many now?", "5")
    assert (task.thoughts, task.depth) == ("paragraphs", 10)
    first = task.generator_prompt(problem, [])
    assert first.text == task.solution_prompt(problem).text and first.prefix == "" and first.stop == ("\n\n",)
    steps = ["Janet starts with 3 apples.", "She buys 2, so 3 + 2 = 5."]
    later = task.generator_prompt(problem, steps)
    assert later.text == first.text  # one conversation: the reply so far is the prefix
    assert later.prefix == "Janet starts with 3 apples.\n\nShe buys 2, so 3 + 2 = 5.\n\n"
    assert task.parse_thought(problem, steps, "  The answer is 5.\n") == "The answer is 5."


def test_a_path_of_paragraphs_ends_where_one_states_the_answer():
    task = GSM8K()
    problem = Problem("p", "q", "5")
    assert not task.is_terminal(problem, ["3 + 2 = 5 apples in all."])
    assert task.is_terminal(problem, ["3 + 2 = 5.", "The answer is 5."])
    assert task.is_terminal(problem, ["So she has \\boxed{5} apples."])
    assert task.answer(problem, ["3 + 2 = 5.", "The answer is 5."]) == "5"
    assert not GSM8K(thoughts="subquestions").is_terminal(problem, ["The answer is 5."])  # the depth ends those


def test_a_paragraph_is_valued_after_the_solution_so_far():
    task = GSM8K()
    problem = Problem("p", "How many apples?", "5")
    first = task.evaluator_prompt(problem, ["Janet starts with 3 apples."]).text
    assert "A solution so far:\n(nothing yet)\n\nIts next part:\nJanet starts with 3 apples.\n" in first
    later = task.evaluator_prompt(problem, ["Janet starts with 3.", "She buys 2: 5."]).text
    assert "A solution so far:\nJanet starts with 3.\n\nIts next part:\nShe buys 2: 5.\n" in later


def test_thoughts_and_depth_are_checked():
    assert GSM8K(thoughts="subquestions").depth == 4
    assert GSM8K(depth=6).depth == 6
    with pytest.raises(DataError, match=r"task.thoughts=.lines. is not one of paragraphs, code, subquestions"):
        GSM8K(thoughts="lines")
