"""In-context evaluation (task.evaluator=in_context): a follow-up turn continues a finished thought's
own tokens, so the engine computes only the new turn; the seam matches the chat template; pinned
thoughts wait for their follow-ups in a small store; every decoder still builds `hf`'s trees."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import DEVICE
from test_decoders import EOS_ID
from test_run import make_config
from test_tasks_e2e import CASES, SEARCHES, TINY

from decoding.api.engine import Engine
from decoding.api.kinds import DECODERS
from decoding.base.errors import BackendError, ConfigError
from decoding.base.prompts import PLAIN_SEAM, chat_seam, render_follow_up
from decoding.base.values import GenRequest
from decoding.runtime.kv_cache import RowKVCache
from decoding.runtime.memory import MemoryBudget
from decoding.runtime.models import LoadedModel, ModelSpec, load_tokenizer
from decoding.runtime.prefix_cache import PrefixCache
from decoding.speculation.stopping import reply_ids
from tot.runs.run import run
from tot.show import load_tree


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer(ModelSpec())[0]


def chat_ids(tok, turns: list[tuple[str, str]]) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": r, "content": c} for r, c in turns], add_generation_prompt=True, tokenize=False
    )
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("ends_with_eos", [True, False])
def test_the_seam_is_the_chat_templates(smol, ends_with_eos):
    """A follow-up after [user, reply] tokenises as the template's own [user, assistant, user]
    rendering does, whether the reply closed its turn with EOS or was cut (a stop string)."""
    seam = chat_seam(smol)
    question, reply, message = "What is 2 + 3?", "2 + 3 = 5.", "Rate that step from 1 to 10."
    eos = smol.convert_tokens_to_ids("<|im_end|>")
    context = chat_ids(smol, [("user", question)]) + smol(reply, add_special_tokens=False)["input_ids"]
    context += [eos] if ends_with_eos else []
    rendered = render_follow_up(smol, seam, tuple(context), message, "Score:", frozenset({eos}))
    expected = chat_ids(smol, [("user", question), ("assistant", reply), ("user", message)])
    assert rendered.ids == expected + smol("Score:", add_special_tokens=False)["input_ids"]
    assert rendered.ids[: len(context)] == context  # the reply's tokens as generated: reused


def test_a_template_that_rewrites_replies_is_refused(smol):
    """A template that drops part of an earlier reply (reasoning stripped from past turns) cannot
    serve a follow-up of the very tokens generated: one clear error, naming the fix."""
    tok = type(smol).from_pretrained(smol.name_or_path)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}"
        "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
    )
    with pytest.raises(ValueError, match="does not render an earlier reply"):
        chat_seam(tok)


def test_without_a_template_the_seam_is_plain_text(tokenizer):
    context = (*tokenizer("Q: 2 + 3? A: 5", add_special_tokens=False)["input_ids"], EOS_ID)
    rendered = render_follow_up(tokenizer, PLAIN_SEAM, context, "Rate it.", "Score:", frozenset({EOS_ID}))
    assert rendered.ids[: len(context) - 1] == list(context[:-1])  # EOS dropped: plain text has no turns
    assert rendered.text.endswith("5\n\nRate it.\n\nScore:")


def test_a_stop_string_inside_the_reply_is_cut(tokenizer):
    """The reply a follow-up continues ends where its text ends: the stop string's tokens go."""
    generated = tokenizer("x = 5. Sub-question 3: next", add_special_tokens=False)["input_ids"]
    kept = reply_ids(generated, "stop", "x = 5. ", tokenizer)
    assert tokenizer.decode(kept).startswith("x = 5. ")
    assert "Sub" not in tokenizer.decode(kept)
    assert reply_ids(generated, "length", "ignored", tokenizer) == generated


def test_a_follow_up_computes_only_its_turn(loaded):
    """The thought's keys and values are reused: the follow-up computes its seam (and the reply's
    last two tokens, whose keys a finished row never committed), counted on the sequence itself."""
    engine = Engine(loaded, "ar")
    (thought,) = engine.generate([GenRequest("the cat sat on", max_new_tokens=12, keep=True)])
    assert thought.context[: -len(thought.token_ids)] == tuple(engine.encode("the cat sat on"))
    follow = GenRequest("how good is that?", prefix="Score:", max_new_tokens=4, context=thought.context)
    (valued,) = engine.generate([follow])
    seam = len(engine.encode(follow.prompt, follow.prefix, follow.context)) - len(thought.context)
    assert valued.stats.prompt_tokens_computed <= seam + 2
    assert engine.last_stats.prompt_tokens_computed == valued.stats.prompt_tokens_computed
    assert engine.target.prefixes.pinned == 0  # its admission released the pin
    # The same prompt sent on its own, on a fresh engine, is computed whole.
    ids = engine.encode(follow.prompt, follow.prefix, follow.context)
    (alone,) = Engine(loaded, "ar").generate([GenRequest(tuple(ids), max_new_tokens=4)])
    assert alone.stats.prompt_tokens_computed == len(ids)
    assert alone.token_ids == valued.token_ids  # the same prompt, however it was computed


def test_pinned_thoughts_survive_a_small_store(tiny_model):
    """Stored sequences waiting for a follow-up are not evicted however much else comes; once
    admitted they are; when pins alone would pass the cap, the oldest pin goes first."""
    from decoding.runtime.runner import ModelRunner

    runner = ModelRunner(tiny_model, paged=False)  # a store of copies (test_paged_kv.py: the paged store's budget)
    cache: RowKVCache = runner.new_cache(1, 64)
    cache.advance(torch.tensor([40]))
    one = runner.new_cache(1, 64).keys[0][0, :, :1].nbytes * 2 * len(cache.keys)  # a position's bytes
    store = PrefixCache(MemoryBudget(30 * one))
    keep = tuple(range(100, 120))
    store.store(keep, cache, 0, pin=keep)
    for i in range(10):  # ten others of 20 positions each: far past the cap of 30
        store.store(tuple(range(200 + 30 * i, 220 + 30 * i)), cache, 0)
    assert store.match(keep).length == len(keep)
    assert store.nbytes <= 30 * one
    store.unpin(keep)
    for i in range(3):
        store.store(tuple(range(600 + 30 * i, 620 + 30 * i)), cache, 0)
    assert store.match(keep).length == 0  # evictable again, and the oldest
    first, second = tuple(range(700, 720)), tuple(range(800, 820))
    store.store(first, cache, 0, pin=first)
    store.store(second, cache, 0, pin=second)  # two pins of 20 > 30: the older one gives way
    assert store.match(second).length == len(second) and store.match(first).length == 0
    assert store.nbytes <= 30 * one


def test_the_server_refuses_in_context_evaluation():
    with pytest.raises(ConfigError, match="decoder=server sends text"):
        make_config("decoder=server", "task.evaluator=in_context")


@pytest.mark.parametrize("task", list(CASES))
def test_a_bad_evaluator_name_is_one_line(task):
    from tasks import make_task
    from tasks.base import DataError

    with pytest.raises(DataError, match=r"task\.evaluator='inline' is not one of separate, in_context"):
        make_task(task, 2, {"evaluator": "inline"})


def run_tree(loaded, tmp_path, name: str, *overrides: str) -> tuple[list, dict]:
    cfg = make_config(*overrides)
    out = tmp_path / name
    run(cfg, out, engine=Engine(loaded, cfg.decoder), progress=False)
    record = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    tree = load_tree(out, record["id"])
    return [(t.text, t.value) for _, t in sorted(tree.thoughts.items())], record | {"tree": tree}


@pytest.mark.parametrize("search", list(SEARCHES))
@pytest.mark.parametrize("task", list(CASES))
def test_in_context_evaluations_compute_only_their_turn(task, search, long_context, tmp_path):
    """For every task and search, the evaluation phase computes at most each follow-up's seam (and
    the reply's last tokens), less than separate evaluator prompts; the tree keeps each
    evaluation's prompt; `hf` (no reuse at all) builds the very same tree."""
    args = [f"task={task}", f"search={search}", *TINY, *CASES[task], *SEARCHES[search]]
    ours, record = run_tree(long_context, tmp_path, "ar", *args, "decoder=ar", "task.evaluator=in_context")
    reference, _ = run_tree(long_context, tmp_path, "hf", *args, "decoder=hf", "task.evaluator=in_context")
    assert ours == reference
    _, separate = run_tree(long_context, tmp_path, "sep", *args, "decoder=ar", "task.evaluator=separate")
    tree, evaluate = record["tree"], record["phases"]["evaluate"]
    nodes = [t for n, t in tree.thoughts.items() if n != tree.root]
    assert nodes and all(t.eval_in_context and t.eval_prompt for t in nodes)
    tok = long_context.tokenizer
    n_evaluate = make_config(*args).task_options.get("n_evaluate", 1)
    bound = sum(
        n_evaluate * (len(tok(PLAIN_SEAM.text(t.eval_prompt, ""), add_special_tokens=False)["input_ids"]) + 12)
        for t in nodes
    )  # + the reply's prefix (a few bytes here) and the reply's last two tokens
    assert evaluate["decode_prompt_tokens_computed"] <= bound
    assert evaluate["decode_prompt_tokens_computed"] < separate["phases"]["evaluate"]["decode_prompt_tokens_computed"]


@pytest.fixture(scope="session")
def long_draft(long_context) -> LoadedModel:
    """A draft close to the long-context target but not equal (some drafts rejected)."""
    model = copy.deepcopy(long_context.model)
    g = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.add_(0.08 * p.std() * torch.randn(p.shape, generator=g).to(p.device))
    return LoadedModel(model, long_context.tokenizer, DEVICE, False, "perturbed")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", [n for n in DECODERS if n != "hf"])
def test_every_decoder_builds_hfs_tree_in_context(name, temperature, long_context, long_draft, tmp_path):
    """Greedy and matched-sample identity with in-context evaluations: every decoder's tree is
    `hf`'s, thought for thought and value for value."""
    args = ["task=gsm8k", "search=bfs", *TINY, *CASES["gsm8k"], *SEARCHES["bfs"], "task.evaluator=in_context"]
    args += [f"gen.temperature={temperature}", f"gen.eval_temperature={temperature}"]
    needs_draft = DECODERS[name].draft_model == "required"
    cfg = make_config(*args, f"decoder={name}", *(["draft.path=self"] if needs_draft else []))
    draft = long_draft if needs_draft else None
    run(cfg, tmp_path / name, engine=Engine(long_context, cfg.decoder, draft), progress=False)
    record = json.loads((tmp_path / name / "results.jsonl").read_text())
    tree = load_tree(tmp_path / name, record["id"])
    reference, _ = run_tree(long_context, tmp_path, "hf", *args, "decoder=hf")
    assert [(t.text, t.value) for _, t in sorted(tree.thoughts.items())] == reference


def test_a_model_without_a_usable_template_refuses_follow_ups(loaded, smol):
    engine = Engine(loaded, "ar")
    engine._seam = "its chat template does not render an earlier reply after the prompt as it was generated"
    with pytest.raises(BackendError, match=r"use task\.evaluator=separate"):
        engine.generate([GenRequest("rate it", context=(5, 6, 7))])


def test_a_resumed_in_context_run_gives_the_same_trees(loaded, tmp_path):
    """A run stopped after its first problem and resumed writes the trees an uninterrupted run does."""
    args = [
        "task=gsm8k",
        "task.depth=2",
        "gen.max_thought_tokens=5",
        "gen.max_eval_tokens=3",
        "task.evaluator=in_context",
    ]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(make_config(*args, "data.limit=2"), whole, engine=Engine(loaded, "ar"), progress=False)
    run(make_config(*args, "data.limit=1"), resumed, engine=Engine(loaded, "ar"), progress=False)
    run(make_config(*args, "data.limit=2"), resumed, engine=Engine(loaded, "ar"), progress=False)
    for tree in sorted((whole / "trees").iterdir()):
        assert (resumed / "trees" / tree.name).read_text() == tree.read_text()
