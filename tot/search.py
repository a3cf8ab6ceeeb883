"""ToT-BFS (SEED Algorithm 2): generate n thoughts per frontier state, value them, keep the best b.

Every request of one step goes to the engine in one call, so the backend sees all sequences of
the step at once: the n samples of one state share a `group` (the same prompt, n trajectories).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field

from decoding.types import DecodeStats, GenRequest, GenResult
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


class Generator:
    """Something with Engine.generate and the stats of its latest call (the engine, or a fake)."""

    last_stats: DecodeStats

    def generate(self, requests: list[GenRequest]) -> list[GenResult]: ...


def request_seed(seed: int, *parts: object) -> int:
    """A request's seed from the run seed and where it sits in the tree: a resumed run samples
    exactly what an uninterrupted one would have."""
    return zlib.crc32("/".join(map(str, (seed, *parts))).encode())


class BFS:
    def __init__(self, task: Task, settings: BFSSettings, gen: GenSettings, seed: int) -> None:
        self.task, self.settings, self.gen, self.seed = task, settings, gen, seed

    def solve(self, problem: Problem, engine: Generator) -> Solution:
        task, gen = self.task, self.gen
        tree = ReasoningTree(problem.question)
        phases = {p: PhaseStats() for p in PHASES}
        frontier = [tree.root]
        for depth in range(1, task.depth + 1):
            gen_requests, parents = [], []
            for state in frontier:
                prompt = task.generator_prompt(problem, tree.steps(state))
                for i in range(self.settings.n_thoughts):
                    seed = request_seed(self.seed, problem.id, state, i)
                    gen_requests.append(gen.request(prompt, group=f"{problem.id}/{state}", seed=seed))
                    parents.append(state)
            outputs = self._call(engine, gen_requests, phases["generate"])
            children = []
            for parent, out in zip(parents, outputs):
                text = task.parse_thought(problem, tree.steps(parent), out.text)
                children.append(tree.add(parent, text, raw=out.text, tokens=len(out.token_ids)))

            eval_requests = [
                gen.request(
                    task.evaluator_prompt(problem, tree.steps(c)),
                    group=f"{problem.id}/d{depth}/eval",
                    seed=request_seed(self.seed, problem.id, c, "eval"),
                    evaluate=True,
                )
                for c in children
            ]
            for c, out in zip(children, self._call(engine, eval_requests, phases["evaluate"])):
                tree[c]["value"] = task.parse_value(out.text)
                tree[c]["evaluation"] = out.text

            # Stable sort: among equal values the earlier-generated thought wins, deterministically.
            frontier = sorted(children, key=lambda c: -tree[c]["value"])[: self.settings.breadth]
            for c in frontier:
                tree[c]["chosen"] = True
        best = frontier[0]
        tree.mark_answer(best)
        return Solution(task.answer(problem, tree.steps(best)), tree, phases)

    @staticmethod
    def _call(engine: Generator, requests: list[GenRequest], phase: PhaseStats) -> list[GenResult]:
        t0 = time.perf_counter()
        outputs = engine.generate(requests)
        phase.wall_s += time.perf_counter() - t0
        phase.decode += engine.last_stats
        phase.calls += 1
        return outputs
