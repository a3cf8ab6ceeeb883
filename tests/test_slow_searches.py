"""Every search on every task with the embedded model (loaded once): each runs end to end, and
`ar` and `seed_stand` build the very same trees at temperature 0 and under the matched sampling rule;
best-of-N's answer on GSM8K is the vote over what its replies state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decoding.api.engine import Engine
from decoding.runtime.models import LoadedModel, ModelSpec, load_model
from tot.runs.run import run
from tot.show import load_tree

TASKS = {
    "gsm8k": ["task.depth=2"],
    "creative_writing": ["task.depth=2", "task.n_evaluate=1"],
    "blocksworld": ["task.depth=2", "task.n_problems=1", "task.steps=2"],
}
SEARCHES = {
    "bfs": ["search=bfs", "search.n_thoughts=2"],
    "dvts": ["search=dvts", "search.n=2", "search.beam_width=1"],
    "best_of_n": ["search=best_of_n", "search.n=2", "search.max_tokens=48", "search.aggregate=weighted"],
    "mcts": ["search=mcts", "search.iterations=2", "search.n_thoughts=2", "search.parallel=2"],
}
SMALL = ["data.limit=1", "gen.max_thought_tokens=24", "gen.max_eval_tokens=8", "model.device=cpu"]


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_model(ModelSpec(device="cpu"))


def solve(smol: LoadedModel, out: Path, *overrides: str) -> tuple[dict, list]:
    from test_run import make_config

    cfg = make_config(*SMALL, *overrides)
    summary = run(cfg, out, engine=Engine(smol, cfg.decoder), progress=False)
    record = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    tree = load_tree(out, record["id"])
    return summary, [(t.text, t.value) for _, t in sorted(tree.thoughts.items())]


@pytest.mark.slow
@pytest.mark.parametrize("search", list(SEARCHES))
@pytest.mark.parametrize("task", list(TASKS))
def test_search_on_the_embedded_model(smol, tmp_path, task, search):
    for temperature in (0.0, 0.7):
        trees = {}
        for decoder in ("ar", "seed_stand"):
            out = tmp_path / f"{temperature}-{decoder}"
            overrides = [f"task={task}", *TASKS[task], *SEARCHES[search], f"decoder={decoder}"]
            summary, trees[decoder] = solve(smol, out, *overrides, f"gen.temperature={temperature}")
            assert summary["n_problems"] == 1 and summary["generated_tokens"] > 0
            if search != "best_of_n":  # every grown state is valued (a best-of-N solution at its last step only)
                assert all(value is not None for _, value in trees[decoder][1:])
        assert trees["ar"] == trees["seed_stand"], (task, search, temperature)


@pytest.mark.slow
def test_a_best_of_n_gsm8k_answer_is_the_vote_over_the_replies(smol, tmp_path):
    """Four sampled solutions, written out and as a function in turn (task.solutions=mixed): the recorded
    answer is the most frequent answer GSM8K reads or runs in them (the first of equals), from the reply
    the answer path starts with."""
    from tasks.gsm8k import GSM8K

    overrides = ["task=gsm8k", "search=best_of_n", "search.n=4", "search.max_tokens=96", "gen.temperature=0.7"]
    summary, _ = solve(smol, tmp_path, *overrides)
    record = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])
    tree = load_tree(tmp_path, record["id"])
    firsts = list(tree.graph.successors(tree.root))
    task = GSM8K(value="sampled")
    answers = [task.answer(None, [tree[n].text]) for n in firsts]  # type: ignore[arg-type]
    assert len(firsts) == 4 and all(tree[n].reply is not None for n in firsts)  # a tiny model may write no code
    stated = [a for a in answers if a]  # a reply that states no answer (a program that failed) does not vote
    assert record["answer"] == (max(stated, key=stated.count) if stated else "")
    assert summary["accuracy_by"].keys() == {"strict", "flexible"}
