"""The blocksworld domain layer: rendering and parsing, the simulator, the planner and generator, the validator
and its CLI. No model involved; everything runs in a few seconds."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tasks.blocksworld.domain import (
    COLOURS,
    Action,
    InvalidAction,
    apply,
    canonical_facts,
    check_plan,
    first_goal_prefix,
    goal_reached,
    parse_action,
    parse_plan,
    precondition_failure,
    render_action,
    render_fact,
    render_facts,
)
from tasks.blocksworld.planner import (
    distance_to_goal,
    generate_problems,
    is_optimal_step,
    optimal_plan,
    random_state,
    successors,
)
from tasks.blocksworld.validate import load_problems, validate

REPO = Path(__file__).resolve().parents[1]
# The benchmark data lies beside the project (../shared); the tests that need it skip without it.
STEP_6 = Path(__file__).resolve().parents[2] / "shared" / "data" / "blocksworld" / "step_6.jsonl"

OBJECTS = tuple("abcdefghij")
ALL_ACTIONS = [Action(name, (x,)) for name in ("pick-up", "put-down") for x in OBJECTS] + [
    Action(name, (x, y)) for name in ("stack", "unstack") for x in OBJECTS for y in OBJECTS
]


def facts(*items: str) -> frozenset[str]:
    return frozenset(items)


# A tower c on d on b, and a alone on the table; the hand is empty. Objects a-d.
TOWER = facts("handempty", "ontable a", "ontable b", "on c d", "on d b", "clear a", "clear c")


# --- actions, rendering and parsing -----------------------------------------------------------------


def test_action_constructor_validates_name_and_arity():
    assert Action("unstack", ("c", "d")).pddl() == "unstack c d"
    assert Action("pick-up", ("a",)).pddl() == "pick-up a"
    for name, args in [("pickup", ("a",)), ("move", ("a", "b")), ("stack", ("a",)), ("pick-up", ("a", "b"))]:
        with pytest.raises(ValueError):
            Action(name, args)
    with pytest.raises(ValueError):
        Action("stack", ("a", "two words"))


@pytest.mark.parametrize("action", ALL_ACTIONS, ids=lambda a: a.pddl())
def test_round_trip_every_action(action: Action):
    natural, pddl = render_action(action), action.pddl()
    for text in (natural, pddl, f"({pddl})"):
        assert parse_action(text) == action
        for marker in ("1. ", "12) ", "- ", "* ", "Step 3: ", "step 3. "):
            assert parse_action(f"  {marker}{text}.  ") == action
        assert parse_action(text.upper()) == action
        assert parse_action(text.title()) == action


@pytest.mark.parametrize(
    "text, expected",
    [
        ("pick up the red block", "pick-up a"),
        ("pick up the red block from the table", "pick-up a"),
        ("Pick up a red block.", "pick-up a"),
        ("pick the red block up", "pick-up a"),
        ("pick-up a", "pick-up a"),
        ("pickup a", "pick-up a"),
        ("(pick-up a)", "pick-up a"),
        ("put down the blue block", "put-down b"),
        ("put the blue block down", "put-down b"),
        ("put down the blue block on the table", "put-down b"),
        ("put the blue block on the table", "put-down b"),
        ("put-down b", "put-down b"),
        ("putdown b", "put-down b"),
        ("stack the red block on top of the blue block", "stack a b"),
        ("stack the red block on the blue block", "stack a b"),
        ("stack the red block onto the blue block", "stack a b"),
        ("put the red block on top of the blue block", "stack a b"),
        ("(stack a b)", "stack a b"),
        ("stack a b", "stack a b"),
        ("unstack the orange block from on top of the yellow block", "unstack c d"),
        ("unstack the orange block from the yellow block", "unstack c d"),
        ("unstack c d", "unstack c d"),
        ("(unstack c d)", "unstack c d"),
        ("Step 2: (unstack c d)", "unstack c d"),
        ("3. Unstack the violet block from on top of the green block.", "unstack j i"),
        ("  - stack c a  ", "stack c a"),
    ],
)
def test_parse_accepted_forms(text: str, expected: str):
    action = parse_action(text)
    assert action is not None and action.pddl() == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "hello",
        "pick up",
        "pick up the block",
        "pick up the purple block",
        "pick-up k",
        "stack the red block",
        "stack a b c",
        "unstack c d 7",
        "unstack c d, then put it down",
        "pick up the red block and stack it on the blue block",
        "move the red block to the blue block",
        "put down the red block on the blue block please",
        "[PLAN END]",
        "The plan is:",
    ],
)
def test_parse_rejects(text: str):
    assert parse_action(text) is None


def test_parse_plan_one_entry_per_non_empty_line():
    text = "1. unstack c d\n\n2. put down the orange block\nthink more\n(pick-up a)\n"
    assert parse_plan(text) == [
        Action("unstack", ("c", "d")),
        Action("put-down", ("c",)),
        None,
        Action("pick-up", ("a",)),
    ]


def test_render_fact_and_action():
    assert render_fact("on a b") == "the red block is on top of the blue block"
    assert render_fact("ontable a") == "the red block is on the table"
    assert render_fact("clear a") == "the red block is clear"
    assert render_fact("handempty") == "the hand is empty"
    assert render_fact("holding j") == "the hand is holding the violet block"
    assert render_action(Action("pick-up", ("a",))) == "pick up the red block"
    assert render_action(Action("put-down", ("a",))) == "put down the red block"
    assert render_action(Action("stack", ("a", "b"))) == "stack the red block on top of the blue block"
    assert render_action(Action("unstack", ("a", "b"))) == "unstack the red block from on top of the blue block"
    assert list(COLOURS.values())[:3] == ["red", "blue", "orange"]


def test_render_facts_is_deterministic():
    expected = (
        "the hand is empty, the red block is clear, the orange block is clear, "
        "the orange block is on top of the yellow block, the yellow block is on top of the blue block, "
        "the red block is on the table and the blue block is on the table"
    )
    assert render_facts(TOWER) == expected
    assert render_facts(sorted(TOWER, reverse=True)) == expected
    assert render_facts(["on a d", "on c a"]) == (
        "the red block is on top of the yellow block and the orange block is on top of the red block"
    )
    assert render_facts(["handempty"]) == "the hand is empty"


def test_rendering_more_than_ten_objects_fails():
    with pytest.raises(ValueError):
        render_fact("clear k")
    with pytest.raises(ValueError):
        render_action(Action("stack", ("a", "k")))
    with pytest.raises(ValueError):
        render_fact("on a")


# --- simulator ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state, action, reason",
    [
        (TOWER, "pick-up d", "d is not on the table"),
        (TOWER, "pick-up b", "b is not clear"),
        (facts("holding a", "ontable b", "clear b"), "pick-up b", "the hand is not empty"),
        (TOWER, "unstack c b", "c is not on top of b"),
        (TOWER, "unstack d b", "d is not clear"),
        (facts("holding a", "on c d", "clear c", "ontable d"), "unstack c d", "the hand is not empty"),
        (TOWER, "put-down a", "the hand is not holding a"),
        (facts("holding a", "ontable b", "on c b", "clear c"), "stack a b", "b is not clear"),
        (facts("holding a", "ontable b", "clear b"), "stack c b", "the hand is not holding c"),
    ],
)
def test_preconditions(state: frozenset[str], action: str, reason: str):
    act = parse_action(action)
    assert precondition_failure(state, act) == reason
    with pytest.raises(InvalidAction, match=reason):
        apply(state, act)
    assert issubclass(InvalidAction, ValueError)


def test_effects_of_each_action():
    s1 = apply(TOWER, Action("unstack", ("c", "d")))
    assert s1 == facts("holding c", "ontable a", "ontable b", "on d b", "clear a", "clear d")
    s2 = apply(s1, Action("put-down", ("c",)))
    assert s2 == facts("handempty", "ontable a", "ontable b", "ontable c", "on d b", "clear a", "clear c", "clear d")
    s3 = apply(s2, Action("pick-up", ("a",)))
    assert s3 == facts("holding a", "ontable b", "ontable c", "on d b", "clear c", "clear d")
    s4 = apply(s3, Action("stack", ("a", "d")))
    assert s4 == facts("handempty", "ontable b", "ontable c", "on d b", "on a d", "clear c", "clear a")


def test_goal_test_on_partial_goals():
    assert goal_reached(TOWER, {"on c d"})
    assert goal_reached(TOWER, {"on c d", "on d b"})
    assert goal_reached(TOWER, set())
    assert not goal_reached(TOWER, {"on c d", "on a b"})


def test_check_plan_and_first_goal_prefix():
    goal = {"on a d", "on c a"}
    gold = [parse_action(t) for t in ("unstack c d", "put-down c", "pick-up a", "stack a d", "pick-up c", "stack c a")]
    assert check_plan(TOWER, goal, gold) == check_plan(TOWER, goal, gold)
    ok = check_plan(TOWER, goal, gold)
    assert (ok.valid, ok.reached_goal, ok.n_steps, ok.failed_step, ok.failed_action, ok.reason) == (
        True,
        True,
        6,
        None,
        None,
        None,
    )
    short = check_plan(TOWER, goal, gold[:4])
    assert short.valid and not short.reached_goal
    broken = check_plan(TOWER, goal, [gold[0], gold[2]])
    assert (broken.valid, broken.failed_step, broken.failed_action, broken.reason) == (
        False,
        1,
        "pick-up a",
        "the hand is not empty",
    )
    assert first_goal_prefix(TOWER, goal, gold) == 6
    assert first_goal_prefix(TOWER, {"on a d"}, gold) == 4
    assert first_goal_prefix(TOWER, {"on c d"}, gold) == 0
    assert first_goal_prefix(TOWER, goal, gold[:5]) is None
    assert first_goal_prefix(TOWER, {"on a d"}, [gold[0], gold[2], *gold[2:]]) is None


def test_canonical_facts_follow_the_data_order():
    assert canonical_facts(TOWER, "abcd") == [
        "handempty",
        "ontable a",
        "ontable b",
        "on c d",
        "on d b",
        "clear a",
        "clear c",
    ]


# --- planner ------------------------------------------------------------------------------------


def _brute_force_length(init: frozenset[str], goal: set[str], objects: str, max_depth: int) -> int | None:
    """Iterative deepening over action sequences drawn from every action over objects: no state bookkeeping,
    nothing shared with the planner but the simulator."""
    actions = [a for a in ALL_ACTIONS if all(o in objects for o in a.args)]

    def reachable(state: frozenset[str], depth: int) -> bool:
        if goal_reached(state, goal):
            return True
        if depth == 0:
            return False
        return any(reachable(apply(state, a), depth - 1) for a in actions if precondition_failure(state, a) is None)

    return next((d for d in range(max_depth + 1) if reachable(init, d)), None)


def _random_problem(objects: str, rng: random.Random) -> tuple[frozenset[str], set[str]]:
    init = random_state(objects, rng)
    goal = {f for f in random_state(objects, rng) if f.startswith("on ")}
    return init, goal


def test_planner_is_optimal_against_brute_force():
    rng = random.Random(7)
    max_depth = 8
    compared = 0
    for objects in ("abc",) * 8 + ("abcd",) * 12:
        init, goal = _random_problem(objects, rng)
        plan = optimal_plan(init, goal, objects)
        assert plan is not None
        check = check_plan(init, goal, plan)
        assert check.valid and check.reached_goal
        assert distance_to_goal(init, goal, objects) == len(plan)
        brute = _brute_force_length(init, goal, objects, max_depth)
        if len(plan) <= max_depth:
            assert brute == len(plan)
            compared += 1
        else:
            assert brute is None
    assert compared >= 10


def test_is_optimal_step_matches_brute_force():
    rng = random.Random(3)
    for _ in range(5):
        init, goal = _random_problem("abcd", rng)
        d = distance_to_goal(init, goal, "abcd")
        for action, nxt in successors(init, "abcd"):
            after = _brute_force_length(nxt, goal, "abcd", d + 1)
            assert is_optimal_step(init, action, goal, "abcd") == (after == d - 1)
        assert not is_optimal_step(init, Action("put-down", ("a",)), goal, "abcd")


def test_planner_edge_cases():
    assert optimal_plan(TOWER, {"on c d"}, "abcd") == []
    assert distance_to_goal(TOWER, {"on c d"}, "abcd") == 0
    assert optimal_plan(TOWER, {"on a a"}, "abcd") is None
    assert distance_to_goal(TOWER, {"on a a"}, "abcd") is None
    assert optimal_plan(TOWER, {"on a d", "on c a"}, "abcd") == [
        parse_action(t) for t in ("unstack c d", "put-down c", "pick-up a", "stack a d", "pick-up c", "stack c a")
    ]
    assert [a.pddl() for a, _ in successors(TOWER, "abcd")] == ["pick-up a", "unstack c d"]
    held = apply(TOWER, Action("pick-up", ("a",)))
    assert [a.pddl() for a, _ in successors(held, "abcd")] == ["put-down a", "stack a c"]


def test_random_state_is_a_uniform_arrangement():
    rng = random.Random(0)
    counts: Counter[frozenset[str]] = Counter()
    for _ in range(13_000):
        state = random_state("abc", rng)
        counts[state] += 1
    assert len(counts) == 13  # the arrangements of 3 blocks into towers
    assert all(850 < c < 1150 for c in counts.values()), counts
    for state in counts:
        assert "handempty" in state
        for o in "abc":
            positions = [f for f in state if f.split()[0] in ("on", "ontable") and f.split()[1] == o]
            assert len(positions) == 1
            assert (f"clear {o}" in state) == (not any(f.startswith("on ") and f.endswith(f" {o}") for f in state))


def test_generate_problems_have_the_requested_optimal_length():
    records = generate_problems(6, 4, 4, seed=1)
    assert len(records) == 6
    assert records == generate_problems(6, 4, 4, seed=1)
    assert records != generate_problems(6, 4, 4, seed=2)
    assert len({(tuple(r["init"]), tuple(r["goal"])) for r in records}) == 6
    for i, r in enumerate(records):
        assert list(r) == ["id", "objects", "init", "goal", "gold_plan", "steps"]
        assert r["id"] == f"generated-4b-4s-1-{i}"
        assert r["objects"] == ["a", "b", "c", "d"] and r["steps"] == 4
        assert r["goal"] and all(f.startswith("on ") for f in r["goal"]) and r["goal"] == sorted(r["goal"])
        assert r["init"] == canonical_facts(r["init"], r["objects"]) and "handempty" in r["init"]
        plan = [parse_action(t) for t in r["gold_plan"]]
        assert check_plan(r["init"], r["goal"], plan).reached_goal
        assert len(optimal_plan(r["init"], r["goal"], r["objects"])) == 4
    for r in generate_problems(3, 5, 6, seed=0):
        assert distance_to_goal(r["init"], r["goal"], r["objects"]) == 6


@pytest.mark.parametrize("n_blocks, steps", [(3, 12), (4, 5), (1, 2), (11, 2)])
def test_generate_problems_rejects_impossible_requests(n_blocks: int, steps: int):
    with pytest.raises(ValueError):
        generate_problems(2, n_blocks, steps, seed=0)


# --- validator and CLI --------------------------------------------------------------------------

PROBLEM = {
    "id": "p1",
    "objects": ["a", "b", "c", "d"],
    "init": sorted(TOWER),
    "goal": ["on a d", "on c a"],
    "gold_plan": ["unstack c d", "put-down c", "pick-up a", "stack a d", "pick-up c", "stack c a"],
    "steps": 6,
}


def cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tasks.blocksworld", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_all_gold_plans_of_the_benchmark_are_valid():
    if not STEP_6.is_file():
        pytest.skip(f"benchmark data not found at {STEP_6} (../shared/data beside the project)")
    problems = load_problems(STEP_6)
    assert len(problems) == 152
    report = validate(problems)
    assert report.all_valid and report.lines() == ["152/152 plans valid"]
    for p in problems:
        assert distance_to_goal(p.init, p.goal, p.objects) == p.steps == 6
    proc = cli("validate", str(STEP_6))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "152/152 plans valid"


def test_cli_names_the_first_failing_action(tmp_path: Path):
    broken = {**PROBLEM, "id": "broken", "gold_plan": ["unstack c d", "pick-up a", "stack a d"]}
    garbled = {**PROBLEM, "id": "garbled", "gold_plan": ["unstack c d", "fly away", "pick-up z"]}
    short = {**PROBLEM, "id": "short", "gold_plan": ["unstack c d", "put-down c"]}
    proc = cli("validate", str(write_jsonl(tmp_path / "d.jsonl", [PROBLEM, broken, garbled, short])))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        'broken: step 2 "pick-up a": the hand is not empty',
        'garbled: step 2 "fly away": not a blocksworld action',
        "short: does not reach the goal (missing: on a d, on c a)",
        "1/4 plans valid",
    ]


def test_cli_checks_plans_from_another_file(tmp_path: Path):
    data = write_jsonl(tmp_path / "d.jsonl", [PROBLEM, {**PROBLEM, "id": "p2"}, {**PROBLEM, "id": "p3"}])
    natural = "\n".join(render_action(parse_action(t)) for t in PROBLEM["gold_plan"])
    plans = write_jsonl(
        tmp_path / "results.jsonl",
        [
            {"id": "p1", "plan": PROBLEM["gold_plan"]},
            {"id": "p2", "answer": "".join(f"{i}. {line}\n" for i, line in enumerate(natural.splitlines(), 1))},
            {"id": "p3", "plan": "unstack c d\nstack a d"},
        ],
    )
    proc = cli("validate", str(data), "--plans", str(plans))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == ['p3: step 2 "stack a d": the hand is not holding a', "2/3 plans valid"]

    write_jsonl(plans, [{"id": "p1", "answer": natural}, {"id": "nowhere", "plan": []}])
    proc = cli("validate", str(data), "--plans", str(plans))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == ["nowhere: no problem with this id in the data file", "1/2 plans valid"]

    write_jsonl(plans, [{"id": "p1", "answer": natural}])
    proc = cli("validate", str(data), "--plans", str(plans))
    assert (proc.returncode, proc.stdout.strip()) == (0, "1/1 plans valid")


def test_cli_bad_files_give_one_line_and_exit_2(tmp_path: Path):
    proc = cli("validate", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "missing.jsonl" in proc.stderr

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(PROBLEM) + "\n{not json\n")
    proc = cli("validate", str(bad_json))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and f"{bad_json}:2:" in proc.stderr

    no_goal = write_jsonl(tmp_path / "nogoal.jsonl", [{k: v for k, v in PROBLEM.items() if k != "goal"}])
    proc = cli("validate", str(no_goal))
    assert proc.returncode == 2 and f"{no_goal}:1:" in proc.stderr and "goal" in proc.stderr

    data = write_jsonl(tmp_path / "d.jsonl", [PROBLEM])
    no_plan = write_jsonl(tmp_path / "plans.jsonl", [{"id": "p1"}])
    proc = cli("validate", str(data), "--plans", str(no_plan))
    assert proc.returncode == 2 and f"{no_plan}:1:" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cli_generate(tmp_path: Path):
    out = tmp_path / "sub" / "gen.jsonl"
    proc = cli("generate", str(out), "--n", "5", "--blocks", "4", "--steps", "4", "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    assert "5" in proc.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records == generate_problems(5, 4, 4, seed=0)
    proc = cli("validate", str(out))
    assert (proc.returncode, proc.stdout.strip()) == (0, "5/5 plans valid")
    proc = cli("generate", str(out), "--blocks", "3", "--steps", "12")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_every_action_reads_differently():
    texts = [render_action(a) for a in ALL_ACTIONS]
    assert len(ALL_ACTIONS) == 220 and len(set(texts)) == len(texts)
