"""The reasoning tree of one problem: a networkx DiGraph of thoughts, saved as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx

from tot.output import make_dirs, write_atomic


class ReasoningTree:
    """Node 0 is the problem; every other node is one thought with its text, value and depth.

    `chosen` marks the nodes kept by the search (the BFS frontier at each depth) and `answer`
    marks the path of the final answer.
    """

    def __init__(self, question: str) -> None:
        self.graph = nx.DiGraph()
        self.graph.add_node(0, text=question, value=None, depth=0, chosen=True, answer=True)

    @property
    def root(self) -> int:
        return 0

    def add(self, parent: int, text: str, **attrs: object) -> int:
        node = self.graph.number_of_nodes()
        depth = self.graph.nodes[parent]["depth"] + 1
        self.graph.add_node(node, **{"value": None, "chosen": False, "answer": False, **attrs}, text=text, depth=depth)
        self.graph.add_edge(parent, node)
        return node

    def __getitem__(self, node: int) -> dict:
        return self.graph.nodes[node]

    def steps(self, node: int) -> list[str]:
        """Thought texts from the root's child down to node."""
        path = nx.shortest_path(self.graph, self.root, node)
        return [self.graph.nodes[n]["text"] for n in path[1:]]

    def mark_answer(self, node: int) -> None:
        for n in nx.shortest_path(self.graph, self.root, node):
            self.graph.nodes[n]["answer"] = True

    def to_dict(self) -> dict:
        return nx.node_link_data(self.graph, edges="edges")

    @classmethod
    def from_dict(cls, data: dict) -> ReasoningTree:
        tree = cls.__new__(cls)
        tree.graph = nx.node_link_graph(data, edges="edges")
        return tree

    def save(self, path: Path) -> None:
        make_dirs(path.parent)
        write_atomic(path, json.dumps(self.to_dict(), indent=1))
