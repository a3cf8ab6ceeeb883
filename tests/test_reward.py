"""The reward-model plug-in (`reward.path`): tiny random checkpoints of each kind written to disk,
loaded, scoring a crafted path in the documented format, driving BFS and MCTS through tot.runs.run; bad
input is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import BOS_ID, EOS_ID, PAD_ID
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from decoding.api.engine import Engine
from decoding.base.errors import BackendError, ConfigError
from decoding.runtime.models import ModelSpec
from tot.runs.run import run
from tot.search.base import run_sync
from tot.search.reward import (
    IN_CONTEXT_REFUSED,
    ProcessReward,
    RewardSpec,
    ScoringModel,
    aggregate,
    load_reward,
    path_ids,
    resolve_kind,
)
from tot.show import load_tree

REPO = Path(__file__).resolve().parents[1]


def config(vocab: int, **extra: object) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, initializer_range=0.2, pad_token_id=PAD_ID,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False, **extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """A causal LM (judge or PRM), classifiers with one and two labels, and one with three."""
    root = tmp_path_factory.mktemp("reward")
    torch.manual_seed(7)
    models = {
        "causal": LlamaForCausalLM(config(len(tokenizer))),
        "one_label": LlamaForSequenceClassification(config(len(tokenizer), num_labels=1)),
        "two_labels": LlamaForSequenceClassification(config(len(tokenizer), num_labels=2)),
        "three_labels": LlamaForSequenceClassification(config(len(tokenizer), num_labels=3)),
    }
    paths = {}
    for name, model in models.items():
        paths[name] = root / name
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def spec(path: Path, **options: object) -> RewardSpec:
    return RewardSpec(ModelSpec(path=str(path), device="cpu", key="reward"), **options)  # type: ignore[arg-type]


def test_kinds_resolve_from_the_checkpoint(checkpoints):
    assert resolve_kind(spec(checkpoints["one_label"])) == "classifier"
    assert resolve_kind(spec(checkpoints["causal"])) == "judge"
    assert resolve_kind(spec(checkpoints["causal"], kind="prm")) == "prm"


@pytest.mark.parametrize("name", ["one_label", "two_labels"])
def test_a_classifier_scores_the_question_and_steps_joined_by_the_separator(checkpoints, tokenizer, name):
    scorer = load_reward(spec(checkpoints[name], step_separator="|"))
    assert isinstance(scorer, ScoringModel)
    got = scorer.score("What is 2 + 3?", ["2 + 3 = 5", "The answer is 5."])
    ids = tokenizer.encode("What is 2 + 3?|2 + 3 = 5|The answer is 5.|")
    with torch.no_grad():
        logits = scorer.model(input_ids=torch.tensor([ids])).logits[0].float()
    want = torch.sigmoid(logits[0]) if name == "one_label" else torch.softmax(logits, -1)[1]
    assert 0 < got.value < 1 and got.value == pytest.approx(float(want), abs=1e-6)
    assert got.steps == ()


def test_a_prm_reads_the_labels_after_each_separator(checkpoints, tokenizer):
    """The crafted path: question, separator, step, separator, step, separator; a step's score is
    P(+) / (P(+) + P(-)) at its separator's last token (a choice request on the PRM's engine, all steps
    in one call); the path's their minimum."""
    scorer = load_reward(spec(checkpoints["causal"], kind="prm", step_separator=" ;"))
    assert isinstance(scorer, ProcessReward)
    steps = ["add 2 and 3", "so 5"]
    ids, ends = path_ids(tokenizer, scorer.separator, "Sum?", steps)
    assert tokenizer.decode(ids) == "Sum? ;add 2 and 3 ;so 5 ;"
    assert [tokenizer.decode(ids[: e + 1]) for e in ends] == ["Sum? ;add 2 and 3 ;", "Sum? ;add 2 and 3 ;so 5 ;"]
    got, cost = run_sync(scorer.score("Sum?", steps))
    assert cost.generated_tokens == 0 and cost.prompt_tokens > 0  # scored, nothing generated
    model = scorer.engine.loaded.model  # a plain forward of the model as the engine loaded it
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0].float().cpu()
    plus, minus = tokenizer.encode("+"), tokenizer.encode("-")
    want = [float(torch.softmax(logits[e, plus + minus], -1)[0]) for e in ends]
    assert list(got.steps) == pytest.approx(want, abs=1e-5)
    assert got.value == pytest.approx(min(want), abs=1e-5)


def test_aggregates():
    assert aggregate([0.5, 0.8, 0.2], "min") == 0.2
    assert aggregate([0.5, 0.8, 0.2], "last") == 0.2
    assert aggregate([0.5, 0.8, 0.2], "mean") == pytest.approx(0.5)
    assert aggregate([0.5, 0.8, 0.2], "product") == pytest.approx(0.08)


@pytest.mark.parametrize(
    ("name", "options", "error", "named"),
    [
        ("three_labels", {}, ConfigError, "classification head of 3 labels"),
        ("causal", {"kind": "prm", "step_separator": " ки"}, ConfigError, "reward.step_separator=' ки' is not in"),
        (
            "causal",
            {"kind": "prm", "step_separator": "|", "good_label": "good"},
            ConfigError,
            "reward.good_label is 3 tokens",
        ),
    ],
)
def test_bad_reward_models_are_one_line(checkpoints, name, options, error, named):
    with pytest.raises(error, match=named):
        load_reward(spec(checkpoints[name], **options))


def test_a_path_that_is_no_model(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(BackendError, match=r"reward\.path=.* could not be loaded as a classifier"):
        load_reward(spec(tmp_path, kind="classifier"))


def test_the_command_exits_2_on_a_bad_reward_path(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tot.solve", "model=smollm2-135m", "search=bfs", f"reward.path={tmp_path}",
         "reward.kind=prm", "data.limit=1", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if "reward.path" in line]
    assert len(lines) == 1 and "could not be loaded" in lines[0]  # as the target is (the PRM runs on an engine)


def test_in_context_evaluation_with_a_reward_model_is_refused():
    from test_run import make_config

    with pytest.raises(ConfigError, match=r"reward\.path values states with a model of its own"):
        make_config("reward.path=somewhere", "task.evaluator=in_context")
    assert "task.evaluator=separate" in IN_CONTEXT_REFUSED


SMALL = ["task=gsm8k", "task.depth=2", "data.limit=1", "gen.max_thought_tokens=5", "gen.max_eval_tokens=3"]
SEARCHES = {"bfs": ["search=bfs", "search.n_thoughts=2"], "mcts": ["search=mcts", "search.iterations=3"]}


@pytest.mark.parametrize("search", list(SEARCHES))
@pytest.mark.parametrize("kind", ["classifier", "prm", "judge"])
def test_a_reward_model_drives_the_search(checkpoints, long_context, tmp_path, search, kind):
    """Every state valued by the reward model: scores in [0, 1] (classifier, prm) or the judge's replies
    to the task's evaluator prompt, which the target's differ from; the search keeps the best-scored."""
    from test_run import make_config

    path = checkpoints["two_labels" if kind == "classifier" else "causal"]
    trees = {}
    for name, extra in (
        ("target", []),
        ("reward", [f"reward.path={path}", f"reward.kind={kind}", "reward.step_separator='|'"]),
    ):
        cfg = make_config(*SMALL, *SEARCHES[search], "gen.temperature=0", "model.device=cpu", *extra)
        run(cfg, tmp_path / name, engine=Engine(long_context, cfg.decoder), progress=False)
        record = json.loads((tmp_path / name / "results.jsonl").read_text().splitlines()[0])
        trees[name] = load_tree(tmp_path / name, record["id"])
    tree = trees["reward"]
    valued = [n for n in tree.graph.nodes if n != tree.root]
    assert valued and all(tree[n].value is not None for n in valued)
    if kind == "judge":
        own = [trees["target"][n].evaluation for n in trees["target"].graph.nodes if n != 0]
        assert [tree[n].evaluation for n in valued][: len(own)] != own  # another model answered
    else:
        assert all(0 <= tree[n].value <= 1 and tree[n].evaluation.startswith("reward ") for n in valued)
        assert all(len(tree[n].reward_steps or []) == tree[n].depth for n in valued) or kind != "prm"
    if search == "bfs":
        first = list(tree.graph.successors(tree.root))
        chosen = [n for n in first if tree[n].chosen]
        assert chosen == [max(first, key=lambda n: tree[n].value)]
