"""The reasoning tree of one problem: typed thoughts on a networkx DiGraph, saved as node-link JSON."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import networkx as nx


@dataclass
class Valuation:
    """What valued a path: its value and the evaluation that gave it (the evaluator's reply, its
    replies when it was asked several times, or the reward model's score)."""

    value: float
    evaluation: str | list[str] | None = None
    eval_prompt: str | None = None
    eval_in_context: bool | None = None  # asked as a follow-up turn of the reply that wrote the node
    reward_steps: list[float] | None = None  # a process reward model's score of each step
    # task.value=expected or yes: the evaluator's answers' probabilities the value was read from
    distribution: dict[str, float] | None = None
    eval_tokens: int | None = None  # tokens generated to value it (evaluator replies, a reward model's completions)


@dataclass
class Thought:
    """One node: the problem (node 0) or one thought, with what the search learnt about it.

    `chosen` marks the nodes kept by the search (the BFS frontier at each depth, the DVTS beams, the
    MCTS nodes visited) and `answer` the path of the final answer. A field left None is not saved.
    """

    text: str
    depth: int
    value: float | None = None
    chosen: bool = False
    answer: bool = False
    terminal: bool | None = None  # the path ends here (depth limit or the task says so)
    raw: str | None = None  # the reply the thought was parsed from
    tokens: int | None = None  # tokens generated for that reply
    evaluation: str | list[str] | None = None
    eval_prompt: str | None = None
    eval_in_context: bool | None = None
    reward_steps: list[float] | None = None
    distribution: dict[str, float] | None = None
    eval_tokens: int | None = None
    subtree: int | None = None  # DVTS: the subtree the thought grew in
    solution: int | None = None  # best-of-N: the solution the step belongs to
    reply: str | None = None  # best-of-N: the solution's whole reply, on its first step
    visits: int | None = None  # MCTS: visits and mean return
    q: float | None = None
    # Its reply's confidence readings (tot/search/confidence.py), where its log-probabilities were asked.
    confidence: dict[str, float] | None = None
    rollout: bool | None = None  # task.value=rollout: a completion sampled from its parent to an answer
    extra: dict[str, Any] = field(default_factory=dict)  # fields a tree saved by another version holds

    def take(self, valued: Valuation) -> None:
        """Record the valuation of the path ending here."""
        for f in fields(valued):
            setattr(self, f.name, getattr(valued, f.name))

    def to_dict(self) -> dict[str, Any]:
        saved = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {k: v for k, v in saved.items() if v is not None or k == "value"} | self.extra

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Thought:
        known = {f.name for f in fields(cls)} - {"extra"}
        for key in ("text", "depth"):
            if key not in data:
                raise ValueError(f"a node has no {key}")
        return cls(
            **{k: v for k, v in data.items() if k in known}, extra={k: v for k, v in data.items() if k not in known}
        )


class ReasoningTree:
    """The search's tree: `graph` holds its shape (node ids and edges), `tree[n]` node n's Thought."""

    def __init__(self, question: str) -> None:
        self.graph = nx.DiGraph()
        self.thoughts: dict[int, Thought] = {}
        self._put(0, Thought(question, 0, chosen=True, answer=True))

    @property
    def root(self) -> int:
        return 0

    def _put(self, node: int, thought: Thought) -> None:
        self.graph.add_node(node)
        self.thoughts[node] = thought

    def add(self, parent: int, text: str, **attrs: Any) -> int:
        """A new thought below parent (attrs: Thought's fields); its id is the next number."""
        node = int(self.graph.number_of_nodes())
        self._put(node, Thought(text, self.thoughts[parent].depth + 1, **attrs))
        self.graph.add_edge(parent, node)
        return node

    def __getitem__(self, node: int) -> Thought:
        return self.thoughts[node]

    def value(self, node: int) -> float:
        """A valued node's value: what the searches rank and back up (a node not yet valued is an error)."""
        value = self.thoughts[node].value
        if value is None:
            raise ValueError(f"node {node} ({self.thoughts[node].text[:40]!r}) has not been valued")
        return value

    def children(self, node: int) -> list[int]:
        """The thoughts below node (its rollouts, completions that value it, left out)."""
        return [c for c in self.graph.successors(node) if not self.thoughts[c].rollout]

    def rollouts(self, node: int) -> list[int]:
        """The completions sampled from node to an answer (task.value=rollout), in node order."""
        return [c for c in self.graph.successors(node) if self.thoughts[c].rollout]

    def steps(self, node: int) -> list[str]:
        """Thought texts from the root's child down to node."""
        path = nx.shortest_path(self.graph, self.root, node)
        return [self.thoughts[n].text for n in path[1:]]

    def mark_answer(self, node: int) -> None:
        for n in nx.shortest_path(self.graph, self.root, node):
            self.thoughts[n].answer = True

    def to_dict(self) -> dict[str, Any]:
        """networkx's node-link form, each node's saved fields beside its id."""
        nodes = [{**self.thoughts[n].to_dict(), "id": n} for n in self.graph.nodes]
        edges = [{"source": u, "target": v} for u, v in self.graph.edges]
        return {"directed": True, "multigraph": False, "graph": {}, "nodes": nodes, "edges": edges}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReasoningTree:
        graph = nx.node_link_graph(data, edges="edges")
        tree = cls.__new__(cls)
        tree.graph, tree.thoughts = nx.DiGraph(), {}
        for node, attrs in graph.nodes(data=True):
            try:
                tree._put(node, Thought.from_dict(attrs))
            except (TypeError, ValueError) as e:
                raise ValueError(f"node {node}: {e}") from None
        tree.graph.add_edges_from(graph.edges)
        return tree
