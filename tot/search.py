"""ToT-BFS (SEED Algorithm 2): generate n thoughts per frontier state, value them, keep the best b.

Every request of one step goes to the engine in one call, so the backend sees all sequences of
the step at once: the n samples of one state share a `group` (the same prompt, n trajectories).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Protocol

from decoding.core.values import DecodeStats, GenRequest, GenResult
from tasks.base import Problem, Prompt, Task
from tot.tree import ReasoningTree

PHASES = ("generate", "evaluate")


@dataclass(frozen=True)
class GenSettings:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_thought_tokens: int = 128
    max_eval_tokens: int = 128
    eval_temperature: float = 0.7

    def request(self, prompt: Prompt, group: str, seed: int, evaluate: bool = False) -> GenRequest:
        """The request for a thought (or, with evaluate, for a state evaluation)."""
        return GenRequest(
            prompt=prompt.text,
            prefix=prompt.prefix,
            stop=prompt.stop,
            max_new_tokens=self.max_eval_tokens if evaluate else self.max_thought_tokens,
            temperature=self.eval_temperature if evaluate else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            group=group,
            seed=seed,
        )


@dataclass(frozen=True)
class BFSSettings:
    n_thoughts: int = 3
    breadth: int = 1


@dataclass
class PhaseStats:
    """Decode cost and wall time of one phase (thought generation or state evaluation)."""

    decode: DecodeStats = field(default_factory=DecodeStats)
    wall_s: float = 0.0
    calls: int = 0

    def to_dict(self) -> dict:
        return {
            "tokens": self.decode.generated_tokens,
            "wall_s": self.wall_s,
            "calls": self.calls,
            **{f"decode_{k}": v for k, v in self.decode.to_dict().items()},
        }


@dataclass
class Solution:
    answer: str
    tree: ReasoningTree
    phases: dict[str, PhaseStats]


class GenerationEngine(Protocol):
    """What a search needs of an engine: `generate` and the stats of its latest call
    (decoding.Engine, or a scripted fake in the tests)."""

    last_stats: DecodeStats

    def generate(self, requests: list[GenRequest]) -> list[GenResult]: ...


class Search(Protocol):
    def solve(self, problem: Problem, engine: GenerationEngine) -> Solution: ...


def request_seed(seed: int, *parts: object) -> int:
    """A request's seed from the run seed and where it sits in the tree: a resumed run samples
    exactly what an uninterrupted one would have."""
    return zlib.crc32("/".join(map(str, (seed, *parts))).encode())


class Step:
    """Thought generation and state evaluation for one problem's tree: every batch of requests goes to
    the engine in one call, its cost added to the phase's stats."""

    def __init__(self, task: Task, gen: GenSettings, seed: int, problem: Problem, engine: GenerationEngine) -> None:
        self.task, self.gen, self.seed, self.problem, self.engine = task, gen, seed, problem, engine
        self.tree = ReasoningTree(problem.question)
        self.phases = {p: PhaseStats() for p in PHASES}

    def expand(self, parents: list[tuple[int, int, str]], group: str | None = None) -> list[int]:
        """Sample n thoughts from each (state, n, seed key) in one call, in the given group (default:
        the thoughts of one state share a group). Returns the new nodes in request order."""
        task, gen, tree, pid = self.task, self.gen, self.tree, self.problem.id
        requests, of = [], []
        for state, n, key in parents:
            prompt = task.generator_prompt(self.problem, tree.steps(state))
            for i in range(n):
                seed = request_seed(self.seed, pid, state, *([key] if key else []), i)
                requests.append(gen.request(prompt, group=group or f"{pid}/{state}", seed=seed))
                of.append(state)
        outputs = self._call(requests, "generate")
        children = []
        for parent, out in zip(of, outputs):
            text = task.parse_thought(self.problem, tree.steps(parent), out.text)
            child = tree.add(parent, text, raw=out.text, tokens=len(out.token_ids))
            tree[child]["terminal"] = self.finished(child)
            children.append(child)
        return children

    def evaluate(self, nodes: list[int], group: str) -> None:
        """Value each node: the mean of task.n_evaluate evaluator samples, all nodes in one call."""
        task, pid, k = self.task, self.problem.id, self.task.n_evaluate
        requests = [
            self.gen.request(
                task.evaluator_prompt(self.problem, self.tree.steps(c)),
                group=group,
                # Sample 0 keeps the seed a single evaluation always had.
                seed=request_seed(self.seed, pid, c, "eval", *([j] if j else [])),
                evaluate=True,
            )
            for c in nodes
            for j in range(k)
        ]
        outputs = self._call(requests, "evaluate")
        for i, c in enumerate(nodes):
            texts = [o.text for o in outputs[i * k : (i + 1) * k]]
            self.tree[c]["value"] = sum(map(task.parse_value, texts)) / k
            self.tree[c]["evaluation"] = texts[0] if k == 1 else texts

    def finished(self, node: int) -> bool:
        """A path ends at the depth limit or where the task says it is complete."""
        steps = self.tree.steps(node)
        return len(steps) >= self.task.depth or self.task.is_terminal(self.problem, steps)

    def solution(self, best: int) -> Solution:
        self.tree.mark_answer(best)
        return Solution(self.task.answer(self.problem, self.tree.steps(best)), self.tree, self.phases)

    def _call(self, requests: list[GenRequest], phase: str) -> list[GenResult]:
        stats = self.phases[phase]
        t0 = time.perf_counter()
        outputs = self.engine.generate(requests)
        stats.wall_s += time.perf_counter() - t0
        stats.decode += self.engine.last_stats
        stats.calls += 1
        return outputs


class BFS:
    def __init__(self, task: Task, settings: BFSSettings, gen: GenSettings, seed: int) -> None:
        self.task, self.settings, self.gen, self.seed = task, settings, gen, seed

    def solve(self, problem: Problem, engine: GenerationEngine) -> Solution:
        step = Step(self.task, self.gen, self.seed, problem, engine)
        tree = step.tree
        frontier = [tree.root]
        for depth in range(1, self.task.depth + 1):
            # Finished states are not extended; they compete with the new thoughts for the frontier.
            done = [s for s in frontier if s != tree.root and tree[s]["terminal"]]
            open_ = [s for s in frontier if s not in done]
            if not open_:
                break
            children = step.expand([(s, self.settings.n_thoughts, "") for s in open_])
            step.evaluate(children, group=f"{problem.id}/d{depth}/eval")
            # Stable sort: among equal values the earlier thought wins, deterministically.
            frontier = sorted(done + children, key=lambda c: -tree[c]["value"])[: self.settings.breadth]
            for c in frontier:
                tree[c]["chosen"] = True
        return step.solution(frontier[0])
