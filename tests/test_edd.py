"""EDD (decoding/edd/, decoding/drafters/edd.py, tuning/train_edd.py) on tiny models: the dual-block mask,
training, save/load, and drafting with sd and seed, lossless at temperature 0 and above."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from helpers import UNCAPPED, once_per_run, prefill
from test_cli import REPO, subprocess_env
from test_decoders import BUDGETS, EOS_ID, PROMPTS, _stop_string_case, encode, reference_greedy
from test_speculative import PARAMS, RULES, check_three_tokens, sample_three

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine
from decoding.base.errors import BackendError
from decoding.base.values import DecodeStats, GenRequest
from decoding.drafters.edd import EddDrafter
from decoding.drafters.load import load_draft
from decoding.edd.model import (
    EddConfig,
    EddModel,
    draft_vocab,
    dual_block_mask,
    edd_dir,
    load_edd,
    load_edd_model,
    save_edd,
    vocab_ranking,
)
from decoding.edd.train import Example, TrainSettings, evaluate, split, target_features, train
from decoding.runtime.models import LoadedModel, ModelSpec
from decoding.runtime.runner import ModelRunner
from decoding.schedules.rounds import RoundsOptions
from decoding.schedules.scheduler import Scheduler
from decoding.speculation.options import VerifyOptions
from decoding.trees.policies import DraftTreeOptions
from tuning.train_edd import TrainConfig

EVERY_STEP = VerifyOptions(plan="fixed", max_tokens=None)  # every row drafted and verified whole, every step

LAYER = -1  # the tiny target has 2 layers: its last one's output is the soft prompt


# --- the dual-block mask ----------------------------------------------------------------------------


def test_dual_block_mask_is_the_papers():
    """Figure 3(a)'s mask for 6 tokens in blocks of 2, written out by hand (1 = sees): a token sees
    its block's tokens up to itself and the hidden states of every earlier block."""
    h = """
        100000 000000
        110000 000000
        111000 000000
        111100 000000
        111110 000000
        111111 000000
        000000 100000
        000000 110000
        110000 001000
        110000 001100
        111100 000010
        111100 000011
    """
    expected = torch.tensor(
        [[c == "1" for c in a + b] for a, b in zip(h.split()[0::2], h.split()[1::2])], dtype=torch.bool
    )
    assert torch.equal(dual_block_mask(6, 2), expected)


def test_dual_block_mask_blocks_of_three_and_the_docstring():
    m = dual_block_mask(5, 3).int()
    # Tokens t3, t4 (block 1) see h0..h2 and block 1's tokens; t0..t2 see no hidden state.
    assert m[5 + 3].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 1, 0]
    assert m[5 + 4].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1]
    assert m[5 + 2].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0]
    rows = [line.split() for line in dual_block_mask.__doc__.splitlines()]
    table = [r[1:] for r in rows if len(r) == 9 and set(r[1:]) <= {"1", "."}]
    assert len(table) == 8
    drawn = torch.tensor([[c == "1" for c in row] for row in table])
    assert torch.equal(drawn, dual_block_mask(4, 2))


def test_one_block_is_plain_causal_decoding_over_tokens():
    m = dual_block_mask(4, 4)
    assert not m[4:, :4].any() and torch.equal(m[4:, 4:], torch.ones(4, 4, dtype=torch.bool).tril())


# --- training -------------------------------------------------------------------------------------


def tiny_texts(model, tokenizer, per_prompt: int = 24, length: int = 48) -> list[list[int]]:
    """Texts the tiny target wrote itself: samples at temperature 1 from each of PROMPTS."""
    torch.manual_seed(0)
    out = []
    for p in PROMPTS:
        ids = torch.tensor([encode(tokenizer, p)], device=model.device)
        with torch.inference_mode():
            texts = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                top_k=0,
                max_new_tokens=length,
                min_new_tokens=length,
                num_return_sequences=per_prompt,
                pad_token_id=0,
            )
        out += texts.tolist()
    return out


def examples_for(model, texts: list[list[int]]) -> list[Example]:
    feats = target_features(model, LAYER, texts)
    return [
        Example(f"p{i % 10}", torch.tensor(t), h.half(), f.half()) for i, (t, (h, f)) in enumerate(zip(texts, feats))
    ]


def train_config(tmp_path, steps: int, **settings) -> TrainConfig:
    return TrainConfig(
        model=ModelSpec("tiny"),
        sources=(),
        n_thoughts=1,
        temperature=1.0,
        problems_per_call=1,
        corpus_seed=0,
        layer=LAYER,
        init_layer=None,
        train=TrainSettings(steps=steps, batch_size=4, lr=1e-2, warmup=5, eval_every=steps, **settings),
        out=tmp_path / "edd",
        work_dir=tmp_path / "work",
    )


@pytest.fixture(scope="module")
def one_thread():
    """Module fixtures run before the per-test one-thread fixture; tiny tensors want one thread too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_examples(one_thread, tiny_model, tokenizer) -> list[Example]:
    return examples_for(tiny_model, tiny_texts(tiny_model, tokenizer))


@pytest.fixture(scope="module")
def trained(one_thread, tmp_path_factory, loaded, tiny_examples) -> tuple[dict, LoadedModel]:
    """A briefly trained EDD for the tiny target (and its training summary): 300 steps, about 15 s."""
    root = tmp_path_factory.mktemp("edd")
    cfg = train_config(root, steps=300)
    vocab = vocab_ranking([e.ids.tolist() for e in tiny_examples], len(loaded.tokenizer))
    summary = train(cfg, loaded, tiny_examples, progress=False, vocab=vocab)
    edd = load_edd_model(cfg.out, loaded.model)
    return summary, LoadedModel(edd, loaded.tokenizer, loaded.device, False, str(cfg.out), "edd")


def test_training_lowers_the_heldout_kl(trained):
    summary, _ = trained
    first, last = summary["heldout_kl_first"], summary["heldout_kl"]
    # A random 2-layer target is hard to imitate with one layer and 5k tokens: the KL halves.
    assert last < 0.6 * first, (first, last)
    assert summary["heldout_top1"] > 0.05
    assert summary["heldout_texts"] > 0 and summary["train_texts"] > summary["heldout_texts"]


def test_corpus_rollouts_are_cached_per_chunk(tmp_path, tokenizer):
    """ToT-BFS rollouts of the bundled GSM8K problems on a tiny model; a rerun decodes nothing."""
    from conftest import DEVICE, build_model

    from decoding.edd.train import build_features
    from tasks import DataSpec
    from tuning.train_edd import Source, build_corpus

    model = LoadedModel(build_model(len(tokenizer), max_positions=4096), tokenizer, DEVICE, False, "t")
    source = Source("gsm8k", 2, DataSpec(limit=3), max_thought_tokens=6, max_eval_tokens=4)
    cfg = replace(train_config(tmp_path, steps=1), sources=(source,), n_thoughts=2, problems_per_call=2)
    docs = build_corpus(cfg, Engine(model, "ar"), progress=False)
    # 3 problems x 2 depths x (2 thoughts + 2 evaluations), in chunks of 2 and 1 problems.
    assert len(docs) == 3 * 2 * 4 and {d["chunk"] for d in docs} == {"gsm8k/0", "gsm8k/2"}
    assert all(len(d["ids"]) > d["prompt_len"] for d in docs)

    class NoDecoding:
        def generate(self, requests):
            raise AssertionError("a rerun decodes nothing")

    assert build_corpus(cfg, NoDecoding(), progress=False) == docs
    examples = build_features(cfg, model, docs, progress=False)
    # Samples of one prompt whose windows differ only in their short replies are kept once.
    assert 0 < len(examples) < len(docs)
    assert all(e.hidden.shape == (len(e.ids), 64) for e in examples)


def test_heldout_split_is_by_problem(tiny_examples):
    train_set, held = split(tiny_examples, 0.1)
    assert {e.group for e in train_set}.isdisjoint({e.group for e in held})
    assert len({e.group for e in held}) == 1 and len(train_set) + len(held) == len(tiny_examples)


def test_training_resumes_from_its_checkpoint(tmp_path, loaded, tiny_examples, monkeypatch):
    """A run killed after its step-10 checkpoint and rerun ends with the weights of an uninterrupted run."""
    import decoding.edd.train as train_edd

    whole = train_config(tmp_path / "a", steps=20, checkpoint_every=10)
    train(whole, loaded, tiny_examples, progress=False)
    cut = train_config(tmp_path / "b", steps=20, checkpoint_every=10)
    real, calls = train_edd.batch_loss, []

    def dies_at_step_11(*args):
        calls.append(torch.is_grad_enabled())
        if sum(calls) > 10:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(train_edd, "batch_loss", dies_at_step_11)
    with pytest.raises(KeyboardInterrupt):
        train(cut, loaded, tiny_examples, progress=False)
    assert not cut.out.exists()
    monkeypatch.setattr(train_edd, "batch_loss", real)
    resumed = train(cut, loaded, tiny_examples, progress=False)
    assert [h["step"] for h in resumed["history"]] == [0, 20]
    a = load_edd_model(whole.out, loaded.model).trained_state()
    b = load_edd_model(cut.out, loaded.model).trained_state()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


# --- save / load ----------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path, tiny_model, tokenizer, trained):
    _, loaded_edd = trained
    edd = loaded_edd.model
    path = edd_dir("some/model", tmp_path)
    assert path == tmp_path / "edd" / "some--model"
    save_edd(edd, path, {"note": 1})
    save_edd(edd, path)  # overwriting keeps one directory
    back = load_edd_model(path, tiny_model)
    assert back.config == edd.config
    for k, v in edd.trained_state().items():
        assert torch.equal(back.trained_state()[k], v), k
    assert not any(k.startswith(("embed", "lm_head")) for k in back.state_dict())
    # The shared modules are the target's own, frozen.
    assert back.shared[0] is tiny_model.get_input_embeddings()
    assert back.shared[1] is tiny_model.get_output_embeddings()
    assert {n for n, p in back.named_parameters() if p.requires_grad} == set(back.trained_state())


def test_draft_path_edd_finds_the_cache_or_names_the_command(tmp_path, loaded, trained):
    _, loaded_edd = trained
    target = LoadedModel(loaded.model, loaded.tokenizer, loaded.device, False, "tiny", "my/tiny")
    spec = ModelSpec("edd", cache_dir=str(tmp_path), key="draft")
    with pytest.raises(BackendError, match=r"python -m tuning.train_edd model.path=my/tiny"):
        load_draft(spec, target)
    save_edd(loaded_edd.model, edd_dir("my/tiny", tmp_path))
    draft = load_draft(spec, target)
    assert isinstance(draft.model, EddModel) and draft.name == "edd"
    assert load_edd(spec, target).source == str(edd_dir("my/tiny", tmp_path))


# --- drafting: the EDD's cache, and losslessness --------------------------------------------------


class CheckedEddDrafter(EddDrafter):
    """At every draft, the greedy root candidate and its confidence equal an EDD forward computed from
    scratch: the target's hidden states of the whole committed context as the soft prompt, then the
    current block (tolerance 2e-3, ties within 4e-3 not compared: the models run in bfloat16)."""

    checks = 0

    def draft(self, slots):
        trees = super().draft(slots)
        for slot, tree in zip(slots, trees):
            seq = slot.seq
            if not len(tree) or not seq.params.greedy:
                continue
            context = seq.prompt + seq.generated
            n = slot.state(self).known
            feats = target_features(self.target.model, self.edd.config.layer, [context])[0][0][:n]
            block = context[n:]
            width = n + len(block)
            device = feats.device
            see = torch.ones(width, width, dtype=torch.bool, device=device).tril()
            mask = torch.zeros(width, width, device=device).masked_fill(~see, torch.finfo(torch.float32).min)
            embeds = torch.cat([feats, self.edd.embed(torch.tensor(block, device=device))])[None]
            with torch.inference_mode():
                at = torch.tensor([width - 1], device=device)
                logits = self.edd(embeds, mask[None, None], torch.arange(width, device=device)[None], logits_at=at)
            probs = logits[0, 0].softmax(-1)
            first = tree.children(-1)[0]
            top = probs.float().topk(2).values
            if top[0] - top[1] > 4e-3:  # the draft model's bfloat16 sdpa forward is not batch-invariant
                assert tree.tokens[first] == int(probs.argmax())
            assert tree.probs[first] == pytest.approx(float(probs.max()), abs=2e-3)
            type(self).checks += 1
        return trees


def edd_engine(loaded, draft, name="sd", k_config=(2, 2, 1), verify_batch=2, **options) -> Engine:
    spec = DraftTreeOptions(k_config=k_config, key=name, **options)
    cfg = DecoderConfig(name, spec, RoundsOptions(verify_batch), draft=ModelSpec("edd", key="draft"), verify=UNCAPPED)
    return Engine(loaded, cfg, draft)


def ragged():
    specs = [*zip(PROMPTS, BUDGETS), ("the cat", 25), ("the cat", 25), ("a", 20)]
    return specs, [GenRequest(p, max_new_tokens=m) for p, m in specs]


def test_the_drafters_soft_prompt_cache_equals_a_fresh_forward(loaded, tokenizer, trained):
    _, draft = trained
    engine = Engine(loaded, "ar")
    drafter = CheckedEddDrafter(draft.model, engine.target, DraftTreeOptions((2, 2, 1)))
    # Every row drafted every step (plan=fixed): the drafter's cache is checked at each draft, however
    # little its trees pay.
    engine.decoder = Scheduler("checked", engine.target, tokenizer, drafter, verify=EVERY_STEP)
    CheckedEddDrafter.checks = 0
    # Shared prefixes (fanned out by ModelRunner.start) and ragged rows that finish at different times.
    prompts = ["once upon a time there was a cat", "once upon a time there was a dog", "the cat", "a"]
    engine.generate([GenRequest(p, max_new_tokens=m) for p, m in zip(prompts, (30, 12, 20, 25))])
    assert CheckedEddDrafter.checks >= 20


def test_each_row_gets_its_own_admissions_states(loaded, tokenizer, trained):
    """Two admissions before the drafter hears of either (as with seed.overlap, where the drafter
    thread runs later): each row's soft prompt starts with its own admission's hidden states."""
    _, draft = trained
    engine = Engine(loaded, "ar")
    drafter = CheckedEddDrafter(draft.model, engine.target, DraftTreeOptions((2, 2, 1)))
    decoder = Scheduler("checked", engine.target, tokenizer, drafter, verify=EVERY_STEP)
    engine.decoder = decoder
    CheckedEddDrafter.checks = 0
    first = ["once upon a time there was a cat", "once upon a time there was a dog"]
    second = ["the dog ran far away from home", "the dog ran far away from here"]
    for prompts in (first, second):
        decoder.admit([engine._sequence(GenRequest(p, max_new_tokens=10)) for p in prompts])
        decoder._fill(DecodeStats())  # rows taken, the target's admission done; the drafter has not heard yet
    slots = list(decoder.slots.values())
    assert slots[0].start_hidden is not slots[2].start_hidden
    while decoder.busy:
        decoder.step()
    assert CheckedEddDrafter.checks >= 8


@pytest.mark.parametrize("k_config", [(1, 1, 1), (2, 2, 1), (4, 2, 1)], ids=str)
@pytest.mark.parametrize("name", ["sd", "seed"])
def test_greedy_identity(tiny_model, tokenizer, loaded, trained, name, k_config):
    """Ragged rows, shared prefixes, EOS, and a stop string that ends a row inside a drafted run."""
    _, draft = trained
    specs, requests = ragged()
    prompt, budget, gen, stop = _stop_string_case(tiny_model, tokenizer)
    requests.append(GenRequest(prompt, max_new_tokens=budget, stop=stop))
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    refs.append(next(gen[:i] for i in range(1, len(gen) + 1) if stop in tokenizer.decode(gen[:i])))
    results = edd_engine(loaded, draft, name, k_config, multi_candidate=max(k_config) > 1).generate(requests)
    assert [r.token_ids for r in results] == refs
    assert results[-1].finish_reason == "stop"
    # The briefly trained EDD drafts something the target accepts.
    assert sum(r.stats.accepted_tokens for r in results) > 0


@pytest.mark.parametrize("ratio", [0.05, None], ids=["given", "measured"])
def test_greedy_identity_pct(tiny_model, tokenizer, loaded, trained, ratio):
    """EDD with its own pruned candidate tree (draft_tree.tree_policy=pct), s_d / s_t given or measured."""
    _, draft = trained
    specs, requests = ragged()
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    for name in ("sd", "seed"):
        engine = edd_engine(loaded, draft, name, tree_policy="pct", pct_ratio=ratio, pct_max_depth=4)
        assert [r.token_ids for r in engine.generate(requests)] == refs
        assert engine.decoder.drafter.policy.name == "pct"


def test_seed_stand_grafts_edd_and_ngram_trees(tiny_model, tokenizer, loaded, trained):
    _, draft = trained
    specs, requests = ragged()
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    cfg = DecoderConfig(
        "seed_stand",
        DraftTreeOptions(),
        RoundsOptions(2),
        draft=ModelSpec("edd", key="draft"),
        verify=UNCAPPED,
    )
    engine = Engine(loaded, cfg, draft)
    assert [r.token_ids for r in engine.generate(requests)] == refs
    assert isinstance(engine.decoder.drafter.drafters[0], EddDrafter)


def test_untrained_edd_is_still_lossless(tiny_model, tokenizer, loaded):
    edd = EddModel(EddConfig("tiny", LAYER), tiny_model).eval()
    draft = LoadedModel(edd, tokenizer, loaded.device, False, "untrained", "edd")
    specs, requests = ragged()
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    for name in ("sd", "seed"):
        assert [r.token_ids for r in edd_engine(loaded, draft, name).generate(requests)] == refs


def test_other_drafters_leave_hidden_capture_off(loaded, perturbed):
    engine = Engine(
        loaded, DecoderConfig("sd", DraftTreeOptions(), draft=ModelSpec("x", key="draft"), verify=UNCAPPED), perturbed
    )
    engine.generate([GenRequest("the cat", max_new_tokens=5)])
    assert engine.target.hidden_layer is None


# The rules of test_speculative.py, and EDD's pruned candidate tree (top-k children, point masses).
EDD_RULES = {**RULES, "pct": dict(tree_policy="pct", pct_ratio=0.05, pct_max_depth=3)}


@pytest.mark.parametrize("params_name", list(PARAMS))
@pytest.mark.parametrize("rule", list(EDD_RULES))
def test_sampling_follows_the_target(tiny_model, tokenizer, loaded, trained, rule, params_name):
    """8,000 seeded runs of 3 tokens drafted by the trained EDD (all sequences in one batch, so rows
    draft, accept and leave together); tolerance `tvd_tolerance` as in test_speculative.py."""
    _, draft = trained
    params = PARAMS[params_name]
    prompt = encode(tokenizer, "once upon a time")
    engine = edd_engine(loaded, draft, "sd", **EDD_RULES[rule])
    engine.decoder = Scheduler("batched-edd", engine.target, tokenizer, engine.decoder.drafter, verify=UNCAPPED)
    samples = sample_three(engine, prompt, params, 8000)
    stats = engine.total_stats
    assert stats.accepted_tokens > 0 and stats.accepted_tokens < stats.drafted_tokens
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))


# --- draft.vocab: drafting over the corpus's most frequent tokens ---------------------------------


def test_vocab_ranking_orders_by_count_then_id():
    ranking = vocab_ranking([[5, 3, 5, 7], [3, 5, 9], [7]], 10)
    assert ranking.tolist() == [5, 3, 7, 9]  # 5 thrice; 3 and 7 twice (3 first); 9 once; unseen left out


def test_draft_vocab_is_the_saved_ranking_cut(trained, tmp_path):
    _, draft = trained
    full = torch.load(f"{draft.source}/draft_vocab.pt")
    assert draft_vocab(draft.source, 10).tolist() == full[:10].tolist()
    assert len(draft_vocab(draft.source, 10**6)) == len(full)  # more than the corpus saw: all it saw
    with pytest.raises(BackendError, match=r"rerun `python -m tuning.train_edd`"):
        draft_vocab(tmp_path, 10)
    with pytest.raises(BackendError, match=r"draft.vocab=8: .*draft.path=edd"):
        ModelSpec("some/model", key="draft", vocab=8)


def test_vocab_head_rows_give_the_full_heads_logits(trained):
    _, draft = trained
    edd = draft.model
    ids = draft_vocab(draft.source, 20)
    hidden = torch.randn(3, edd.lm_config.hidden_size).to(edd.device, edd.dtype)
    with torch.inference_mode():
        torch.testing.assert_close(edd.head(hidden, edd.vocab_rows(ids)), edd.head(hidden)[:, ids])


def vocab_engine(loaded, draft, name, size, **options) -> Engine:
    spec = DraftTreeOptions(key=name, **options)
    cfg = DecoderConfig(name, spec, RoundsOptions(2), draft=ModelSpec("edd", key="draft", vocab=size), verify=UNCAPPED)
    return Engine(loaded, cfg, draft)


@pytest.mark.parametrize("name", ["sd", "seed"])
def test_greedy_identity_with_a_draft_vocabulary(tiny_model, tokenizer, loaded, trained, name):
    """A draft vocabulary of half the corpus's tokens, grown by the prompts' tokens and those the
    target commits: the output is still generate's."""
    _, draft = trained
    size = len(torch.load(f"{draft.source}/draft_vocab.pt")) // 2
    specs, requests = ragged()
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    engine = vocab_engine(loaded, draft, name, size)
    results = engine.generate(requests)
    assert [r.token_ids for r in results] == refs
    drafter = engine.decoder.drafter
    base, vocab = set(drafter.base_vocab.tolist()), set(drafter.vocab.tolist())
    assert len(base) == size and sum(r.stats.accepted_tokens for r in results) > 0
    # The target said tokens outside the corpus's ranking (so the test can tell); the vocabulary took
    # them in, and every prompt token.
    said = {t for r in results for t in r.token_ids}
    assert said - base and (said - base) & vocab
    assert {t for p, _ in specs for t in encode(tokenizer, p)} <= vocab


@pytest.mark.parametrize("rule", ["multi", "without-replacement"])
def test_sampling_follows_the_target_with_a_draft_vocabulary(tiny_model, tokenizer, loaded, trained, rule):
    """8,000 seeded 3-token samples at temperature 1.0 with a draft vocabulary of 16 tokens (most of the
    target's mass lies outside it: the residual must supply it); tolerance as in test_speculative.py."""
    _, draft = trained
    params = PARAMS["t1.0"]
    prompt = encode(tokenizer, "once upon a time")
    engine = vocab_engine(loaded, draft, "sd", 16, **RULES[rule])
    engine.decoder = Scheduler("batched-edd", engine.target, tokenizer, engine.decoder.drafter, verify=UNCAPPED)
    samples = sample_three(engine, prompt, params, 8000)
    stats = engine.total_stats
    assert stats.accepted_tokens > 0 and stats.accepted_tokens < stats.drafted_tokens
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))


# --- config errors --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_errors(tmp_path_factory):
    """case -> (the completed command, the text its error names); once per test run."""
    return once_per_run(tmp_path_factory, "train_edd_errors", lambda _: run_cli_errors())


def run_cli_errors() -> dict[str, tuple[subprocess.CompletedProcess, str]]:
    cases = {
        "unknown_key": (["train.nope=1"], "train.nope is not a config key"),
        "blocks": (["train.min_block=9"], "train.min_block=9 exceeds train.max_block=8"),
        "task": (["corpus.tasks=[nope]"], "corpus.tasks: 'nope' is not one of"),
        "model": (["model=nope"], "model=nope is unknown"),
        "steps": (["train.steps=0"], "train.steps=0 must be a positive integer"),
        "heldout": (["train.heldout=1.5"], "train.heldout=1.5 must be a fraction"),
    }

    def run(args):
        cmd = [sys.executable, "-m", "tuning.train_edd", *args]
        return subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=3) as pool:
        procs = dict(zip(cases, pool.map(run, [a for a, _ in cases.values()])))
    return {k: (procs[k], cases[k][1]) for k in cases}


@pytest.mark.parametrize("case", ["unknown_key", "blocks", "task", "model", "steps", "heldout"])
def test_train_edd_bad_config(cli_errors, case):
    proc, expected = cli_errors[case]
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr


def test_edd_layer_outside_the_target(tiny_model):
    with pytest.raises(BackendError, match="outside the target's 2 layers"):
        EddModel(EddConfig("tiny", layer=5), tiny_model)
    with pytest.raises(BackendError, match="need 1 <= min <= max"):
        EddConfig("tiny", min_block=3, max_block=2)


def test_evaluate_is_token_weighted(trained, tiny_examples):
    _, draft = trained
    kl, top1 = evaluate(draft.model, tiny_examples[:6], 4, batch_size=4)
    assert kl > 0 and 0 <= top1 <= 1


def test_target_hidden_capture_does_not_change_logits(tiny_model, tokenizer):
    prompt = encode(tokenizer, "once upon a time there was a cat")
    target = ModelRunner(tiny_model)
    target.capture_hidden(LAYER)
    _, logits = prefill(target, [prompt], capacity=64)
    _, ref = prefill(ModelRunner(tiny_model), [prompt], capacity=64)
    assert torch.equal(logits, ref)
    causal = torch.ones(1, len(prompt), len(prompt), dtype=torch.bool).tril()
    out = target.forward(target.new_cache(1, 64), torch.tensor([prompt]), causal, torch.arange(len(prompt))[None])
    assert out.hidden.shape == (1, len(prompt), tiny_model.config.hidden_size)
    assert (
        ModelRunner(tiny_model)
        .forward(target.new_cache(1, 64), torch.tensor([prompt]), causal, torch.arange(len(prompt))[None])
        .hidden
        is None
    )
