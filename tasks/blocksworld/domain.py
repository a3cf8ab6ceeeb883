"""The 4-operator PDDL blocksworld (blocksworld-4ops): states, actions, the simulator, plan checking, and the
natural-language rendering and parsing of facts and actions.

Facts are strings in the PDDL vocabulary ("on c d", "ontable a", "clear a", "handempty", "holding a"); a state
is the frozenset of the facts that hold. Goals are sets of facts that must all hold (partial: the data gives
only "on" facts).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ARITY = {"pick-up": 1, "put-down": 1, "stack": 2, "unstack": 2}
FACT_ARITY = {"handempty": 0, "holding": 1, "clear": 1, "on": 2, "ontable": 1}
COLOURS = {
    "a": "red",
    "b": "blue",
    "c": "orange",
    "d": "yellow",
    "e": "white",
    "f": "magenta",
    "g": "black",
    "h": "cyan",
    "i": "green",
    "j": "violet",
}
OBJECT_OF_COLOUR = {colour: obj for obj, colour in COLOURS.items()}
# The order render_facts lists facts in: the hand first, then what is free, then the towers.
_FACT_ORDER = ("handempty", "holding", "clear", "on", "ontable")


class InvalidAction(ValueError):
    """An action whose preconditions do not hold; the message says which one fails."""


@dataclass(frozen=True)
class Action:
    name: str  # "pick-up" | "put-down" | "stack" | "unstack"
    args: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.name not in ARITY:
            raise ValueError(f"unknown blocksworld action {self.name!r}; expected one of {', '.join(ARITY)}")
        if not isinstance(self.args, tuple) or len(self.args) != ARITY[self.name]:
            raise ValueError(f"{self.name} takes {ARITY[self.name]} object(s) as a tuple, got {self.args!r}")
        # pddl() joins args with spaces, so an arg with a space (or an empty one) could not be read back.
        if any(not isinstance(a, str) or not a or a.split() != [a] for a in self.args):
            raise ValueError(f"objects must be non-empty names without spaces, got {self.args!r}")

    def pddl(self) -> str:
        return " ".join((self.name, *self.args))


@dataclass(frozen=True)
class PlanCheck:
    valid: bool  # every action applicable in turn
    reached_goal: bool  # the goal holds after the whole plan (False when the plan is invalid)
    n_steps: int  # actions in the plan
    failed_step: int | None  # 0-based index of the first inapplicable action
    failed_action: str | None  # its PDDL form
    reason: str | None  # why it is inapplicable


# --- facts and the simulator ------------------------------------------------------------------------


def is_fact(text: str) -> bool:
    """Whether text is a well-formed fact: a known predicate with the right number of objects."""
    parts = text.split() if isinstance(text, str) else []
    return bool(parts) and FACT_ARITY.get(parts[0]) == len(parts) - 1


def canonical_facts(state: Iterable[str], objects: Sequence[str]) -> list[str]:
    """The facts in the data files' order: the hand, each object's position in object order, then the clear
    objects; so generated records line up with the benchmark's."""
    facts = set(state)
    ordered = [f for f in sorted(facts) if f == "handempty" or f.startswith("holding ")]
    for obj in objects:
        ordered += sorted(f for f in facts if f.split()[0] in ("on", "ontable") and f.split()[1] == obj)
    ordered += [f"clear {obj}" for obj in objects if f"clear {obj}" in facts]
    return ordered + sorted(facts.difference(ordered))


def precondition_failure(state: frozenset[str], action: Action) -> str | None:
    """None when action is applicable in state, else a short reason naming the first failed precondition."""
    x = action.args[0]
    if action.name in ("pick-up", "unstack") and "handempty" not in state:
        return "the hand is not empty"
    if action.name == "pick-up" and f"ontable {x}" not in state:
        return f"{x} is not on the table"
    if action.name == "unstack" and f"on {x} {action.args[1]}" not in state:
        return f"{x} is not on top of {action.args[1]}"
    if action.name in ("pick-up", "unstack") and f"clear {x}" not in state:
        return f"{x} is not clear"
    if action.name in ("put-down", "stack") and f"holding {x}" not in state:
        return f"the hand is not holding {x}"
    if action.name == "stack" and f"clear {action.args[1]}" not in state:
        return f"{action.args[1]} is not clear"
    return None


def apply(state: frozenset[str], action: Action) -> frozenset[str]:
    """The state after action; InvalidAction when a precondition fails."""
    reason = precondition_failure(state, action)
    if reason is not None:
        raise InvalidAction(reason)
    x = action.args[0]
    if action.name == "pick-up":
        removed, added = {f"ontable {x}", f"clear {x}", "handempty"}, {f"holding {x}"}
    elif action.name == "put-down":
        removed, added = {f"holding {x}"}, {f"ontable {x}", f"clear {x}", "handempty"}
    elif action.name == "stack":
        y = action.args[1]
        removed, added = {f"holding {x}", f"clear {y}"}, {f"on {x} {y}", f"clear {x}", "handempty"}
    else:
        y = action.args[1]
        removed, added = {f"on {x} {y}", f"clear {x}", "handempty"}, {f"holding {x}", f"clear {y}"}
    return (state - removed) | added


def goal_reached(state: frozenset[str], goal: Iterable[str]) -> bool:
    return all(fact in state for fact in goal)


def check_plan(init: Iterable[str], goal: Iterable[str], plan: Sequence[Action]) -> PlanCheck:
    state, goal = frozenset(init), frozenset(goal)
    for i, action in enumerate(plan):
        reason = precondition_failure(state, action)
        if reason is not None:
            return PlanCheck(False, False, len(plan), i, action.pddl(), reason)
        state = apply(state, action)
    return PlanCheck(True, goal_reached(state, goal), len(plan), None, None, None)


def first_goal_prefix(init: Iterable[str], goal: Iterable[str], plan: Sequence[Action]) -> int | None:
    """The smallest k such that the goal holds after the first k actions (all applicable); None if never."""
    state, goal = frozenset(init), frozenset(goal)
    for k, action in enumerate(plan):
        if goal_reached(state, goal):
            return k
        if precondition_failure(state, action) is not None:
            return None
        state = apply(state, action)
    return len(plan) if goal_reached(state, goal) else None


# --- natural language ---------------------------------------------------------------------------------


def block(obj: str) -> str:
    """'a' -> 'the red block'."""
    if obj not in COLOURS:
        raise ValueError(f"only the 10 objects a-j have colour names, got {obj!r}")
    return f"the {COLOURS[obj]} block"


def render_fact(fact: str) -> str:
    if not is_fact(fact):
        raise ValueError(f"not a blocksworld fact: {fact!r}")
    pred, *args = fact.split()
    if pred == "handempty":
        return "the hand is empty"
    if pred == "holding":
        return f"the hand is holding {block(args[0])}"
    if pred == "clear":
        return f"{block(args[0])} is clear"
    if pred == "ontable":
        return f"{block(args[0])} is on the table"
    return f"{block(args[0])} is on top of {block(args[1])}"


def _fact_key(fact: str) -> tuple[int, list[str]]:
    pred, *args = fact.split()
    return _FACT_ORDER.index(pred), args


def render_facts(facts: Iterable[str]) -> str:
    """'the hand is empty, the red block is clear, ... and the red block is on the table'; the order depends
    only on the set of facts, so equal states read the same."""
    texts = [render_fact(f) for f in sorted(set(facts), key=_fact_key)]
    if len(texts) <= 1:
        return "".join(texts)
    return ", ".join(texts[:-1]) + " and " + texts[-1]


def render_action(action: Action) -> str:
    x = block(action.args[0])
    if action.name == "pick-up":
        return f"pick up {x}"
    if action.name == "put-down":
        return f"put down {x}"
    y = block(action.args[1])
    if action.name == "stack":
        return f"stack {x} on top of {y}"
    return f"unstack {x} from on top of {y}"


# --- parsing --------------------------------------------------------------------------------------

# A leading list marker: "1.", "2)", "(3)", "Step 3:", "-", "*", "•".
_MARKER = re.compile(r"^(?:step\s*\d+\s*[:.)\-]?|\d+\s*[.):]|\(\d+\)|[-*•])\s*")
_WORDS_ONLY = re.compile(r"[a-z\s-]+")
_FILLERS = frozenset({"the", "block"})
_OBJ = r"([a-j])"
_FROM_TABLE = r"(?: (?:from|off)(?: of)? table)?"
_ON_TABLE = r"(?: (?:on|onto) table)?"
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        ("pick-up", rf"(?:pick-up|pickup|pick up) {_OBJ}{_FROM_TABLE}"),
        ("pick-up", rf"pick {_OBJ} up{_FROM_TABLE}"),
        ("put-down", rf"(?:put-down|putdown|put down) {_OBJ}{_ON_TABLE}"),
        ("put-down", rf"put {_OBJ} down{_ON_TABLE}"),
        ("put-down", rf"put {_OBJ} (?:on|onto) table"),
        ("stack", rf"stack {_OBJ}(?: (?:on top of|on|onto|upon|atop))? {_OBJ}"),
        ("stack", rf"put {_OBJ} (?:on top of|on|onto) {_OBJ}"),
        ("unstack", rf"unstack {_OBJ}(?: (?:from on top of|from top of|from|off of|off))? {_OBJ}"),
    )
)


# Markdown emphasis and quotes around an action, and whitespace.
_DECORATION = "*`\"'“” \t"
# How models start an action besides the imperative: "Now, pick up ...", "I unstack ...",
# "Picking up ...", "Stacks ...": the lead-in dropped, the verb put in the imperative.
_LEAD_IN = re.compile(
    r"^(?:(?:now|next|then|finally|first(?: of all)?|so|ok|okay)\s*,?\s+"
    r"|(?:i will|i['’]ll|i|let['’]s|let us|let me)\s+)+"
)
_VERB_FORMS = (
    (re.compile(r"^(?:picking|picks)\b"), "pick"),
    (re.compile(r"^(?:putting|puts)\b"), "put"),
    (re.compile(r"^(?:unstacking|unstacks)\b"), "unstack"),
    (re.compile(r"^(?:stacking|stacks)\b"), "stack"),
)


def action_words(text: str) -> str | None:
    """The action's words with markers, quotes, punctuation and fillers gone, the verb in the
    imperative and colours mapped to letters."""
    text = _MARKER.sub("", text.lower().strip(_DECORATION), count=1)
    text = text.strip(_DECORATION).rstrip(".!").strip(_DECORATION)
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1].strip()
    text = _LEAD_IN.sub("", text)
    for form, verb in _VERB_FORMS:
        text = form.sub(verb, text, count=1)
    if not _WORDS_ONLY.fullmatch(text):
        return None
    words = text.split()
    kept = []
    for i, word in enumerate(words):
        # "a" is an object (red) in "pick-up a" but an article in "pick up a red block".
        is_article = word == "a" and i + 1 < len(words) and words[i + 1] in OBJECT_OF_COLOUR
        if word not in _FILLERS and not is_article:
            kept.append(OBJECT_OF_COLOUR.get(word, word))
    return " ".join(kept)


def parse_action(text: str) -> Action | None:
    """The action a line names, in natural language or PDDL (see the module's tests for the accepted forms);
    None when the line is not one action."""
    words = action_words(text)
    if words is None:
        return None
    for name, pattern in _PATTERNS:
        m = pattern.fullmatch(words)
        if m:
            return Action(name, m.groups())
    return None


def action_of(text: str) -> Action:
    """The action of a line known to be one (a validated plan's); ValueError otherwise."""
    action = parse_action(text)
    if action is None:
        raise ValueError(f"{text!r} is not a blocksworld action")
    return action


def parse_plan(text: str) -> list[Action | None]:
    """One parsed action (or None) per non-empty line."""
    return [parse_action(line) for line in text.splitlines() if line.strip()]
