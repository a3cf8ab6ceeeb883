"""Optimal blocksworld planning by breadth-first search, goal distances for labelling steps, and a generator of
problems with a given optimal plan length.

Every action has an inverse (pick-up/put-down, unstack/stack), so the state graph is undirected: the distance
from a state to the goal equals the distance from the goal states to it, which one multi-source BFS gives for
the whole state space at once. That space has 866 states for 5 blocks, 7057 for 6 and 65990 for 7.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from functools import lru_cache
from itertools import pairwise
from math import comb, factorial
from typing import Any

from tasks.blocksworld.domain import Action, apply, canonical_facts, goal_reached, precondition_failure

# Unsuccessful draws generate_problems allows before it calls a request impossible: feasible requests for up to
# 6 blocks succeed within a few dozen draws, so 2000 failures in a row mean the length is out of reach.
MAX_FAILED_DRAWS = 2000


def successors(state: frozenset[str], objects: Sequence[str]) -> list[tuple[Action, frozenset[str]]]:
    """The applicable actions and their results, ordered by the acting object in objects order, then by the
    target object: a fixed order, so searches break ties the same way every time."""
    held = [obj for obj in objects if f"holding {obj}" in state]
    if held:
        x = held[0]
        actions = [Action("put-down", (x,))]
        actions += [Action("stack", (x, y)) for y in objects if y != x and f"clear {y}" in state]
    else:
        actions = []
        for x in objects:
            if f"clear {x}" not in state:
                continue
            if f"ontable {x}" in state:
                actions.append(Action("pick-up", (x,)))
            actions += [Action("unstack", (x, y)) for y in objects if f"on {x} {y}" in state]
    # The filter only matters for hand-written states that are not arrangements (e.g. no "handempty").
    return [(a, apply(state, a)) for a in actions if precondition_failure(state, a) is None]


def optimal_plan(init: Iterable[str], goal: Iterable[str], objects: Sequence[str]) -> list[Action] | None:
    """A shortest plan from init to a state where the goal holds, or None when no state reachable from init
    satisfies it."""
    return _bfs_plan(frozenset(init), frozenset(goal), objects, max_len=None)


def _bfs_plan(
    start: frozenset[str], goal: frozenset[str], objects: Sequence[str], max_len: int | None
) -> list[Action] | None:
    """A shortest plan of at most max_len actions (any length when None), or None."""
    parent: dict[frozenset[str], tuple[frozenset[str], Action] | None] = {start: None}
    frontier, depth = [start], 0
    # Level by level, so a depth limit stops the search before the first level that would be too long.
    while frontier and (max_len is None or depth <= max_len):
        nxt_frontier = []
        for state in frontier:
            if goal_reached(state, goal):
                plan = []
                while (before := parent[state]) is not None:
                    state, action = before
                    plan.append(action)
                return plan[::-1]
            for action, nxt in successors(state, objects):
                if nxt not in parent:
                    parent[nxt] = (state, action)
                    nxt_frontier.append(nxt)
        frontier, depth = nxt_frontier, depth + 1
    return None


def _must_move(state: frozenset[str], goal: frozenset[str], objects: Sequence[str]) -> set[str]:
    """Blocks that every plan from state (hand empty) has to pick up and place again: those off their goal
    place, those sitting where another block must go, and those above any of these. Twice its size bounds the
    optimal plan length from below, which lets the generator skip most searches."""
    below = {f.split()[1]: f.split()[2] for f in state if f.startswith("on ")}
    wanted_on = {f.split()[2]: f.split()[1] for f in goal if f.startswith("on ")}
    moving = {x for x in objects if any(g.startswith(f"on {x} ") for g in goal - state)}
    moving |= {x for x, z in below.items() if wanted_on.get(z, x) != x}
    changed = True
    while changed:
        above_moving = {x for x, z in below.items() if z in moving} - moving
        moving |= above_moving
        changed = bool(above_moving)
    return moving


@lru_cache(maxsize=64)
def _distance_table(goal: frozenset[str], objects: tuple[str, ...]) -> dict[frozenset[str], int]:
    """Distance to the goal of every state of objects (the whole space is connected, so starting from all blocks
    on the table reaches every arrangement)."""
    start = frozenset({"handempty"} | {f"ontable {o}" for o in objects} | {f"clear {o}" for o in objects})
    space, queue = {start}, deque([start])
    while queue:
        for _, nxt in successors(queue.popleft(), objects):
            if nxt not in space:
                space.add(nxt)
                queue.append(nxt)
    dist = {s: 0 for s in space if goal_reached(s, goal)}
    queue = deque(dist)
    while queue:
        state = queue.popleft()
        for _, nxt in successors(state, objects):
            if nxt not in dist:
                dist[nxt] = dist[state] + 1
                queue.append(nxt)
    return dist


def distance_to_goal(state: Iterable[str], goal: Iterable[str], objects: Sequence[str]) -> int | None:
    """Length of a shortest plan from state to the goal; None when the goal is unreachable or state is not an
    arrangement of exactly these objects. The first call per (goal, objects) maps the whole state space; later
    calls are dictionary lookups."""
    return _distance_table(frozenset(goal), tuple(sorted(objects))).get(frozenset(state))


def is_optimal_step(state: Iterable[str], action: Action, goal: Iterable[str], objects: Sequence[str]) -> bool:
    """Whether action starts some optimal plan from state: applicable and one step closer to the goal."""
    state = frozenset(state)
    here = distance_to_goal(state, goal, objects)
    if here is None or precondition_failure(state, action) is not None:
        return False
    return distance_to_goal(apply(state, action), goal, objects) == here - 1


def random_state(objects: Sequence[str], rng: random.Random) -> frozenset[str]:
    """A uniformly random arrangement of objects into towers, hand empty.

    The arrangements with k towers number L(n, k) = C(n-1, k-1) n!/k! (Lah numbers). Drawing k with weight
    L(n, k), then a random order of the blocks cut at k-1 random places, gives each arrangement with k towers
    k! times (once per order of its towers) among equally likely draws: uniform overall.
    """
    n = len(objects)
    if n == 0:
        return frozenset({"handempty"})
    weights = [comb(n - 1, k - 1) * factorial(n) // factorial(k) for k in range(1, n + 1)]
    draw = rng.randrange(sum(weights))
    k = 1
    while draw >= weights[k - 1]:
        draw -= weights[k - 1]
        k += 1
    order = list(objects)
    rng.shuffle(order)
    cuts = [0, *sorted(rng.sample(range(1, n), k - 1)), n]
    facts = {"handempty"}
    for lo, hi in pairwise(cuts):
        tower = order[lo:hi]  # bottom first
        facts.add(f"ontable {tower[0]}")
        facts.update(f"on {upper} {lower}" for lower, upper in pairwise(tower))
        facts.add(f"clear {tower[-1]}")
    return frozenset(facts)


def generate_problems(n_problems: int, n_blocks: int, steps: int, seed: int) -> list[dict[str, Any]]:
    """Distinct problems over blocks a, b, ... whose optimal plans take exactly `steps` actions, as records
    in the benchmark's JSONL format; the goal is the "on" facts of a random arrangement, as in the data.

    ValueError when the request cannot be met: more than 10 blocks (no colour names), an odd or non-positive
    length (an optimal plan for "on" goals alternates taking and placing a block from an empty hand and ends with
    a stack), or no problem of that optimal length turning up in MAX_FAILED_DRAWS draws in a row.
    """
    if not 1 <= n_blocks <= 10:
        raise ValueError(f"n_blocks must be 1-10 (objects a-j), got {n_blocks}")
    if steps <= 0 or steps % 2:
        raise ValueError(f"steps must be a positive even number (optimal plans for 'on' goals are), got {steps}")
    if n_problems < 0:
        raise ValueError(f"n_problems must be >= 0, got {n_problems}")
    objects = [chr(ord("a") + i) for i in range(n_blocks)]
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    seen: set[tuple[frozenset[str], frozenset[str]]] = set()
    failed = 0
    while len(records) < n_problems:
        if failed >= MAX_FAILED_DRAWS:
            raise ValueError(
                f"found {len(records)} of {n_problems} distinct {n_blocks}-block problems with optimal length "
                f"{steps} in {MAX_FAILED_DRAWS} draws in a row; ask for fewer problems, another length or more blocks"
            )
        init = random_state(objects, rng)
        goal = frozenset(f for f in random_state(objects, rng) if f.startswith("on "))
        if not goal or (init, goal) in seen or 2 * len(_must_move(init, goal, objects)) > steps:
            failed += 1
            continue
        plan = _bfs_plan(init, goal, objects, max_len=steps)
        if plan is None or len(plan) != steps:
            failed += 1
            continue
        failed = 0
        seen.add((init, goal))
        records.append(
            {
                "id": f"generated-{n_blocks}b-{steps}s-{seed}-{len(records)}",
                "objects": list(objects),
                "init": canonical_facts(init, objects),
                "goal": sorted(goal),
                "gold_plan": [a.pddl() for a in plan],
                "steps": steps,
            }
        )
    return records
