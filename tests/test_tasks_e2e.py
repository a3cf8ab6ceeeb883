"""Every task with every search, end to end through tot.runs.run on a tiny random model and a real engine:
results, summary, saved trees, and the same outputs from ar and seed_stand at temperature 0."""

from __future__ import annotations

import json

import pytest

from decoding.api.engine import Engine
from tot.runs.run import run
from tot.show import load_tree

TINY = ["data.limit=1", "gen.max_thought_tokens=5", "gen.max_eval_tokens=3", "gen.temperature=0"]
CASES = {
    "gsm8k": ["task.depth=2"],
    "creative_writing": ["task.n_evaluate=2"],
    "blocksworld": ["task.depth=2", "task.n_problems=1", "task.steps=2"],
}
SEARCHES = {
    "bfs": ["search.n_thoughts=2"],
    "dvts": ["search.n=4", "search.beam_width=2"],
    "best_of_n": ["search.n=3", "search.aggregate=weighted", "search.max_tokens=12"],
    "mcts": ["search.iterations=3", "search.n_thoughts=2", "search.parallel=2"],
}


@pytest.mark.parametrize("search", list(SEARCHES))
@pytest.mark.parametrize("task", list(CASES))
def test_task_and_search_end_to_end(task, search, long_context, tmp_path):
    from test_run import make_config

    trees = {}
    for decoder in ("ar", "seed_stand"):
        cfg = make_config(
            f"task={task}", f"search={search}", f"decoder={decoder}", *TINY, *CASES[task], *SEARCHES[search]
        )
        out = tmp_path / decoder
        summary = run(cfg, out, engine=Engine(long_context, cfg.decoder), progress=False)
        assert summary["n_problems"] == 1 and summary["task"] == task and summary["search"] == search
        assert summary["generated_tokens"] > 0
        record = json.loads((out / "results.jsonl").read_text().splitlines()[0])
        tree = load_tree(out, record["id"])
        answer_path = [n for n in tree.graph if tree[n].answer]
        # A best-of-N solution is valued whole, at its last step; the other searches value each step.
        valued = answer_path[-1:] if search == "best_of_n" else answer_path[1:]
        assert len(answer_path) >= 2 and all(tree[n].value is not None for n in valued)
        if task == "creative_writing":  # the judge scored the passage with the target
            assert set(record["metrics"]) == {"endings_met", "paragraphs", "coherency"}
            assert "coherency" in summary["metrics"]
        trees[decoder] = [(t.text, t.value) for _, t in sorted(tree.thoughts.items())]
    assert trees["ar"] == trees["seed_stand"]  # lossless: the same tree, thought for thought


@pytest.mark.parametrize("search", ["best_of_n", "mcts"])
def test_new_searches_build_hf_trees_under_matched_samples(search, long_context, tmp_path):
    """At temperature > 0 under each matched rule, ar and seed_stand build hf's very tree."""
    from test_run import make_config

    for rule in ("match_gumbel", "match_multinomial"):
        trees = {}
        for decoder in ("hf", "ar", "seed_stand"):
            cfg = make_config(
                "task=gsm8k", f"search={search}", f"decoder={decoder}", f"verify.rule={rule}", *TINY[:3],
                "gen.temperature=0.8", *CASES["gsm8k"], *SEARCHES[search],
            )  # fmt: skip
            out = tmp_path / rule / decoder
            run(cfg, out, engine=Engine(long_context, cfg.decoder), progress=False)
            record = json.loads((out / "results.jsonl").read_text().splitlines()[0])
            tree = load_tree(out, record["id"])
            trees[decoder] = [(t.text, t.value) for _, t in sorted(tree.thoughts.items())]
        assert trees["hf"] == trees["ar"] == trees["seed_stand"], rule
        assert len({text for text, _ in trees["hf"][1:]}) > 1  # sampled: the replies differ
