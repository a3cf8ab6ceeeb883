"""Tree verification and speculative decoding (`sd`, and the shared loop with any drafter) on tiny models."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from helpers import UNCAPPED, admit_prompts, assert_same_forward, prefill
from test_decoders import (
    BUDGETS,
    EOS_ID,
    PROMPTS,
    _greedy_with_eos_mid_batch,
    _stop_string_case,
    empirical,
    encode,
    reference_greedy,
    target_probs,
    tvd,
    tvd_tolerance,
)

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine
from decoding.base.errors import ConfigError
from decoding.base.values import GenRequest
from decoding.drafters.draft_model import ModelDrafter
from decoding.runtime.memory import MemoryBudget
from decoding.runtime.models import LoadedModel, ModelSpec
from decoding.runtime.prefix_cache import PrefixCache
from decoding.runtime.runner import ModelRunner
from decoding.schedules.planner import Planner, goodput_planner
from decoding.schedules.scheduler import Scheduler
from decoding.schedules.step import cut_to_budget
from decoding.speculation.cost import ForwardCost
from decoding.speculation.draft_tree import ROOT, DraftTree, k_config_parents
from decoding.speculation.options import VerifyOptions
from decoding.speculation.row_sampling import RowSampling
from decoding.speculation.sampling import SamplingParams
from decoding.speculation.sequence import Sequence
from decoding.speculation.stopping import StopRule
from decoding.speculation.verify import verify
from decoding.trees.policies import DraftTreeOptions

K_CONFIGS = [(1, 1, 1), (2, 2, 1), (4, 2, 1), (3,)]
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def unrelated(tokenizer) -> LoadedModel:
    """A draft model with other random weights: its drafts are almost always rejected."""
    from conftest import DEVICE, build_model

    return LoadedModel(build_model(len(tokenizer), seed=1), tokenizer, DEVICE, False, "unrelated")


def sd_engine(
    loaded: LoadedModel, draft: LoadedModel, k_config=(2, 2, 1), serial=True, planned=True, **options
) -> Engine:
    spec = DraftTreeOptions(k_config=k_config, **options)
    engine = Engine(loaded, DecoderConfig("sd", spec, draft=ModelSpec("draft", key="draft"), verify=UNCAPPED), draft)
    if not serial:
        # The same loop and drafter with every sequence in one batch (the shape SEED and STAND use),
        # the step planner in charge on a curve where trees are cut part-way (3 to 4 of 6 nodes),
        # with the rejection rules: they stay exact through cut trees.
        drafter = ModelDrafter(ModelRunner(draft.model), spec, len(loaded.tokenizer), coupled=False)
        # planned=False: whole trees (the fixed plan without a cap).
        verify = VerifyOptions(rule="rejection") if planned else UNCAPPED
        planner = fixed_planner() if planned else None
        engine.decoder = Scheduler(
            "batched-sd", engine.target, loaded.tokenizer, drafter, verify=verify, planner=planner
        )
    return engine


@pytest.mark.parametrize("rule", ["match_gumbel", "match_multinomial"])
def test_coupled_drafts_of_the_target_itself_are_all_accepted(loaded, rule):
    """draft.path=self at t = 0.6: the draft model is the target, so under match_gumbel each drafted
    chain is the target's own samples and is accepted whole, every step, until its sequence ends;
    under match_multinomial the same drafts, blind to the target's stream, are kept about p(x) of the
    time. The outputs are `hf`'s under each rule."""
    verify = VerifyOptions(plan="fixed", max_tokens=None, rule=rule)
    config = DecoderConfig("sd", DraftTreeOptions(k_config=(1, 1, 1, 1)), draft=ModelSpec("draft", key="draft"))
    engine = Engine(loaded, replace(config, verify=verify), loaded)
    requests = [GenRequest(p, max_new_tokens=40, temperature=0.6, seed=i) for i, p in enumerate(PROMPTS[:3])]
    out = [r.token_ids for r in engine.generate(requests)]
    stats = engine.total_stats
    assert stats.drafted_tokens > 60
    rate = stats.accepted_tokens / stats.drafted_tokens
    if rule == "match_gumbel":
        assert rate == 1.0
    else:
        assert rate < 0.8
    hf = Engine(loaded, DecoderConfig("hf", verify=verify))
    assert out == [r.token_ids for r in hf.generate(requests)]


# --- one verification forward ----------------------------------------------------------------------


def plain_next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1]


def tree_of(parents: list[int], tokens: list[int]) -> DraftTree:
    tree = DraftTree()
    for p, t in zip(parents, tokens):
        tree.add(t, p)
    return tree


def check_tree_logits(model, contexts, trees, verdicts):
    """Logits at the root and at each node equal a plain forward over context + the node's path."""
    for ctx, tree, v in zip(contexts, trees, verdicts):
        assert torch.allclose(v.logits[0], plain_next_logits(model, ctx), atol=1e-4)
        for node in range(len(tree)):
            ids = ctx + [tree.tokens[n] for n in tree.path(node)]
            assert torch.allclose(v.logits[1 + node], plain_next_logits(model, ids), atol=1e-4), node


LONG = "once upon a time there was a cat"
PROMPT_SETS = {
    "ragged": PROMPTS[:3],  # nothing shared: each whole prompt is fed with its first tree
    "repeated": [LONG] * 3,  # all but the last token computed once
    "shared-prefix": [LONG, "once upon a time there was a dog and", "once upon a time there was"],
}


@pytest.mark.parametrize("case", list(PROMPT_SETS))
def test_tree_verification_logits_equal_sequential_decoding(tiny_model, tokenizer, case):
    """Tolerance 1e-4 on logits (float32; the tiny model's logits are of order 1-10)."""
    target = ModelRunner(tiny_model)
    prompts = [encode(tokenizer, p) for p in PROMPT_SETS[case]]
    if case == "ragged":  # every whole prompt fed with its first tree (left-padded pending tokens)
        cache, pending = target.new_cache(3, 64), [list(p) for p in prompts]
    else:  # admitted: each row's prompt computed but its last token, shared parts once
        cache, pending = admit_prompts(target, prompts, capacity=64)
        assert pending == [p[-1:] for p in prompts]
        assert cache.lens.tolist() == [len(p) - 1 for p in prompts]
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence.create(p, StopRule(frozenset(), (), 64), GREEDY, seed=0) for p in prompts]
    shapes = [(2, 1), (1, 1, 1), (4, 2, 1)]
    contexts = [list(p) for p in prompts]
    for step in range(3):
        trees = []
        for b, shape in enumerate(shapes[step:] + shapes[:step]):
            parents = k_config_parents(shape) if b != step else []  # one row with an empty tree
            trees.append(tree_of(parents, torch.randint(3, len(tokenizer), (len(parents),), generator=g).tolist()))
        sampling = RowSampling.of(s.params for s in seqs)
        packed, verdicts = verify(target, cache, pending, trees, seqs, sampling, "match_gumbel")
        check_tree_logits(tiny_model, contexts, trees, verdicts)
        # Commit a path of a different length per row (not the greedy one: any path must be keepable).
        for b, tree in enumerate(trees):
            path = tree.path(len(tree) - 1) if len(tree) else []
            cache.commit(b, packed.committed(b, path))
            nxt = int(torch.randint(3, len(tokenizer), (1,), generator=g))
            contexts[b] = contexts[b] + [tree.tokens[n] for n in path]
            assert int(cache.lens[b]) == len(contexts[b])
            pending[b] = [nxt]
            contexts[b].append(nxt)


# --- greedy identity -------------------------------------------------------------------------------


class ScriptedDrafter:
    """Drafts k_config trees from the known greedy continuation: perfect, always wrong, or random.

    Perfect drafts put the true next tokens first under every true node; wrong drafts never contain
    the true token; random drafts mix true and random tokens.
    """

    def __init__(self, refs: list[list[int]], k_config: tuple[int, ...], kind: str, vocab: int, draw="top"):
        self.refs, self.kind, self.vocab, self.draw = refs, kind, vocab, draw
        self.parents = k_config_parents(k_config)
        self.max_nodes = len(self.parents)
        self.learns_top = 0
        self.g = torch.Generator().manual_seed(1)

    def admit(self, slots):
        self.order = getattr(self, "order", 0)
        for slot in slots:  # the i-th sequence ever admitted follows refs[i]
            slot.put(self, self.order)
            self.order += 1

    def draft(self, slots):
        return [self._tree(slot) for slot in slots]

    def _tree(self, slot) -> DraftTree:
        ref, pos = self.refs[slot.state(self)], len(slot.seq.generated)
        tree = DraftTree(draw=self.draw)
        on_path = {-1: True}
        depth = {-1: 0}
        first_child: set[int] = set()
        for node, parent in enumerate(self.parents):
            d = depth[parent] + 1
            truth = ref[pos + d - 1] if pos + d - 1 < len(ref) else -1
            is_first = parent not in first_child
            first_child.add(parent)
            rand = int(torch.randint(3, self.vocab, (1,), generator=self.g))
            if self.kind == "perfect":
                token = truth if (on_path[parent] and is_first and truth >= 0) else rand
            elif self.kind == "wrong":
                token = rand if rand != truth else (rand + 1) % self.vocab
            else:
                token = truth if (truth >= 0 and float(torch.rand((), generator=self.g)) < 0.5) else rand
            tree.add(token, parent)
            on_path[node] = on_path[parent] and token == truth
            depth[node] = d
        return tree

    def update(self, slots, verdicts):
        """Scripted drafts learn nothing."""

    def release(self, slots, live):
        """No per-row state that matters."""


def ragged_requests():
    specs = [*zip(PROMPTS, BUDGETS), ("the cat", 5), ("the cat", 25), ("the cat", 25), ("a", 20)]
    return specs, [GenRequest(p, max_new_tokens=m) for p, m in specs]


@pytest.mark.parametrize("plan", ["goodput", "fixed"])
@pytest.mark.parametrize("kind", ["perfect", "wrong", "random"])
@pytest.mark.parametrize("k_config", K_CONFIGS, ids=str)
def test_greedy_identity_scripted_drafters(tiny_model, tokenizer, loaded, kind, k_config, plan):
    specs, requests = ragged_requests()
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    # And a row that a stop string ends partway through a drafted run.
    prompt, budget, gen, stop = _stop_string_case(tiny_model, tokenizer)
    n = next(i for i in range(1, len(gen) + 1) if stop in tokenizer.decode(gen[:i]))
    requests.append(GenRequest(prompt, max_new_tokens=budget, stop=stop))
    refs.append(gen[:n])
    engine = Engine(loaded, "ar")
    drafter = ScriptedDrafter(refs, k_config, kind, len(tokenizer))
    # The step planner (the product default) cuts trees as it sees fit: outputs stay hf's.
    verify = VerifyOptions(plan=plan, max_tokens=None)
    planner = goodput_planner(engine.target) if plan == "goodput" else None
    engine.decoder = Scheduler("scripted", engine.target, tokenizer, drafter, verify=verify, planner=planner)
    results = engine.generate(requests)
    assert [r.token_ids for r in results] == refs
    assert results[-1].finish_reason == "stop"
    stats = engine.last_stats
    if plan == "goodput":
        assert stats.drafted_tokens <= stats.verify_steps * len(k_config_parents(k_config))
        return
    depth = len(k_config)
    if kind == "perfect":
        # Every step commits a full path plus the bonus token, except where a budget cuts it.
        assert stats.acceptance_length > depth
    if kind == "wrong":
        assert stats.accepted_tokens == 0 and stats.acceptance_length == 1.0
    assert stats.drafted_tokens == stats.verify_steps * len(k_config_parents(k_config))


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "batched"])
@pytest.mark.parametrize("k_config", K_CONFIGS, ids=str)
@pytest.mark.parametrize("draft_name", ["self", "perturbed", "unrelated"])
def test_greedy_identity_sd(tiny_model, tokenizer, loaded, perturbed, unrelated, draft_name, k_config, serial):
    draft = {"self": loaded, "perturbed": perturbed, "unrelated": unrelated}[draft_name]
    specs, requests = ragged_requests()
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    engine = sd_engine(loaded, draft, k_config, serial=serial, multi_candidate=max(k_config) > 1)
    results = engine.generate(requests)
    assert [r.token_ids for r in results] == refs
    stats = engine.last_stats
    if draft_name == "self":
        # Batched, the planner cuts trees to what its (synthetic, steep) cost curve pays for.
        assert stats.acceptance_length > (0.8 * (len(k_config) + 1) if serial else 1.2)


@pytest.mark.parametrize("draft_name", ["perturbed", "self"])
def test_sd_stops_like_plain_decoding(tiny_model, tokenizer, loaded, perturbed, draft_name, monkeypatch):
    """Stop strings and EOS inside an accepted run end the row exactly where plain decoding does."""
    draft = perturbed if draft_name == "perturbed" else loaded
    prompt, budget, gen, stop = _stop_string_case(tiny_model, tokenizer)
    n = next(i for i in range(1, len(gen) + 1) if stop in tokenizer.decode(gen[:i]))
    extra_eos, k = _greedy_with_eos_mid_batch(tiny_model, tokenizer)
    config = copy.deepcopy(tiny_model.generation_config)
    config.eos_token_id = [EOS_ID, extra_eos]
    monkeypatch.setattr(tiny_model, "generation_config", config)
    requests = [
        GenRequest(prompt, max_new_tokens=budget, stop=("QQQ", stop)),
        GenRequest(PROMPTS[0], max_new_tokens=BUDGETS[0]),
        GenRequest(prompt, max_new_tokens=budget),
    ]
    for serial in (True, False):
        engine = sd_engine(loaded, draft, (4, 2, 1), serial=serial)
        results = engine.generate(requests)
        assert results[0].finish_reason == "stop" and results[0].token_ids == gen[:n]
        assert results[1].finish_reason == "eos" and len(results[1].token_ids) == k + 1
        assert results[2].token_ids == reference_greedy(tiny_model, encode(tokenizer, prompt), budget, {EOS_ID})


def test_sd_decode_stats(loaded):
    engine = sd_engine(loaded, loaded, (1, 1, 1), multi_candidate=False)
    results = engine.generate([GenRequest(p, max_new_tokens=m) for p, m in zip(PROMPTS, BUDGETS)])
    stats = engine.last_stats
    assert stats.generated_tokens == sum(len(r.token_ids) for r in results)
    # Serial: one row per forward, plus a prefill for prompts long enough to keep their prefix.
    assert stats.target_forwards == engine.target.forwards
    assert stats.verify_steps <= stats.target_forwards <= stats.verify_steps + len(PROMPTS)
    # Full chains except where a row's remaining budget leaves room for fewer drafted tokens.
    assert stats.verify_steps * 2 < stats.drafted_tokens <= 3 * stats.verify_steps
    assert 0 < stats.accepted_tokens <= stats.drafted_tokens
    assert stats.acceptance_length == pytest.approx(stats.generated_tokens / stats.verify_steps)
    assert stats.acceptance_length > 3.0  # the target drafting for itself at temperature 0
    assert stats.draft_s > 0 and stats.verify_s > 0
    for r in results:
        assert r.stats.acceptance_length > 1.0
    # One token to go: nothing drafted can be kept, so nothing is drafted.
    one = engine.generate([GenRequest("the cat", max_new_tokens=1)])[0]
    assert engine.last_stats.drafted_tokens == 0 and one.token_ids == results[0].token_ids[:1]


# --- the draft model's cache --------------------------------------------------------------------------


class CheckedDrafter(ModelDrafter):
    """Before every draft: the draft cache holds exactly the keys/values a fresh prefill of the
    committed tokens gives (tolerance 1e-5), and cache + pending tokens = the whole context."""

    checks = 0

    def draft(self, slots):
        for slot in slots:
            b = slot.row  # the draft cache's row i is the target's row i
            seq = slot.seq
            context = seq.prompt + seq.generated
            n = int(self.cache.lens[b])
            pending = slot.state(self).pending
            assert n + len(pending) == len(context)
            assert pending == context[n:]
            if n == 0:  # a one-token prompt: nothing in the cache yet
                continue
            fresh, _ = prefill(ModelRunner(self.model.model), [context[:n]], capacity=n + 1)
            got, want = self.cache.read(b, 0, n), fresh.read(0, 0, n)
            for k_row, k_fresh in zip(got[0] + got[1], want[0] + want[1]):
                assert torch.allclose(k_row, k_fresh, atol=1e-5)
            type(self).checks += 1
        return super().draft(slots)


def fixed_planner() -> Planner:
    """The step planner on a fixed cost curve, never the clock: the same plans on every run."""
    return Planner(ForwardCost({1: [(1, 10.0), (4, 12.0), (5, 16.0), (16, 60.0)]}), timed=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_cache_stays_consistent(loaded, tokenizer, perturbed, temperature):
    spec = DraftTreeOptions(k_config=(2, 2, 1))
    engine = Engine(loaded, "ar")
    drafter = CheckedDrafter(ModelRunner(perturbed.model), spec, len(tokenizer))
    engine.decoder = Scheduler("checked", engine.target, tokenizer, drafter, planner=fixed_planner())
    requests = [
        GenRequest(p, max_new_tokens=30, temperature=temperature, seed=s)
        for s, p in enumerate(["the cat", "the cat", "hello world and more", "a", "the cat"])
    ]
    CheckedDrafter.checks = 0
    engine.generate(requests)
    stats = engine.last_stats
    # Many rounds of accepts, rejects and (the step planner's) undrafted steps caught up were checked.
    assert CheckedDrafter.checks >= 25
    assert 0 < stats.accepted_tokens < stats.drafted_tokens


# --- statistical losslessness --------------------------------------------------------------------------

RULES = {
    "single": dict(k_config=(1, 1, 1), multi_candidate=False),
    "multi": dict(k_config=(2, 2, 1)),
    "without-replacement": dict(k_config=(2, 2, 1), without_replacement=True),
}
PARAMS = {"t1.0": SamplingParams(1.0), "t0.7-k20-p0.9": SamplingParams(0.7, 20, 0.9)}


def sample_three(engine: Engine, prompt: list[int], params: SamplingParams, n: int) -> list[list[int]]:
    out = []
    for start in range(0, n, 2000):
        out += engine.generate(
            [
                GenRequest(
                    tuple(prompt),
                    max_new_tokens=3,
                    temperature=params.temperature,
                    top_k=params.top_k,
                    top_p=params.top_p,
                    seed=s,
                )
                for s in range(start, min(n, start + 2000))
            ]
        )
    return [r.token_ids for r in out]


def check_three_tokens(model, prompt, params, samples, vocab):
    """First token against p(. | prompt); second and third conditional on the most frequent prefix.

    Tolerance: `tvd_tolerance` (test_decoders.py), exceeded by a correct sampler with probability
    below 1e-6 for each check, at the sample count each check sees.
    """
    context = list(prompt)
    rows = samples
    for pos in range(3):
        tokens = [r[pos] for r in rows]
        p = target_probs(model, context, params)
        emp = empirical(tokens, vocab)
        tol = tvd_tolerance(p, len(tokens))
        assert tvd(emp, p) < tol, f"token {pos + 1}: TVD {tvd(emp, p):.4f} >= {tol:.4f} over {len(tokens)} draws"
        assert (emp[p == 0] == 0).all(), "sampled a token outside the top-k / top-p support"
        top = max(set(tokens), key=tokens.count)
        context.append(top)
        rows = [r for r in rows if r[pos] == top and len(r) > pos + 1]


@pytest.mark.parametrize("params_name", list(PARAMS))
@pytest.mark.parametrize("rule", list(RULES))
def test_sampling_follows_the_target(tiny_model, tokenizer, loaded, perturbed, rule, params_name):
    """8,000 seeded runs of 3 tokens with a draft close to (not equal to) the target."""
    params = PARAMS[params_name]
    prompt = encode(tokenizer, "once upon a time")
    engine = sd_engine(loaded, perturbed, serial=False, **RULES[rule])
    samples = sample_three(engine, prompt, params, 8000)
    stats = engine.total_stats
    # Both paths of the rule are exercised: drafts get accepted and rejected.
    assert stats.accepted_tokens / stats.drafted_tokens > 0.1 and stats.acceptance_length < 3.5
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))


def test_sampling_with_deterministic_drafts(tiny_model, tokenizer, loaded):
    """Drafts chosen without randomness (n-gram style) at temperature 1: the point-mass rule."""
    params = PARAMS["t1.0"]
    prompt = encode(tokenizer, "once upon a time")
    first = target_probs(tiny_model, prompt, params)
    likely = torch.topk(first, 3).indices.tolist()

    class TopDrafter(ScriptedDrafter):
        def _tree(self, i):
            tree = DraftTree(draw="top")
            for t in likely:  # three likely first tokens, each followed by a fixed guess
                node = tree.add(t, -1)
                tree.add(likely[0], node)
            return tree

    engine = Engine(loaded, "ar")
    drafter = TopDrafter([[]], (1,), "top", len(tokenizer))
    drafter.max_nodes = 6
    engine.decoder = Scheduler("top", engine.target, tokenizer, drafter, verify=UNCAPPED)
    samples = sample_three(engine, prompt, params, 8000)
    assert engine.total_stats.accepted_tokens > 0
    check_three_tokens(tiny_model, prompt, params, samples, len(tokenizer))


def test_statistical_check_can_fail(tiny_model, tokenizer, loaded, perturbed, monkeypatch):
    """Accepting every draft (no rejection test) samples the draft, not the target: caught."""
    import decoding.speculation.acceptance

    def accept_all(p, candidates, props):
        return [1.0] * len(candidates), p.double()

    monkeypatch.setattr(decoding.speculation.acceptance, "chain", accept_all)
    prompt = encode(tokenizer, "once upon a time")
    engine = sd_engine(loaded, perturbed, serial=False, k_config=(1, 1, 1), multi_candidate=False)
    samples = sample_three(engine, prompt, PARAMS["t1.0"], 4000)
    with pytest.raises(AssertionError, match="TVD"):
        check_three_tokens(tiny_model, prompt, PARAMS["t1.0"], samples, len(tokenizer))


def test_prefix_kept_across_calls(tiny_model, tokenizer):
    """A call whose prompts extend an earlier call's computes only the new part of the prefix, and
    the cache holds what a fresh computation gives (tolerance 1e-5)."""
    target = ModelRunner(tiny_model)
    first = encode(tokenizer, LONG + " and a dog")
    admit_prompts(target, [first, first], capacity=64)
    second = first + encode(tokenizer, " who liked to run")
    before = target.forwards
    cache, pending = admit_prompts(target, [second, [*second, 5]], capacity=64)
    # The shared prefix's tokens after the stored part in one forward, then row 1's own token.
    assert target.forwards == before + 2
    assert pending == [second[-1:], [5]]
    fresh, _ = prefill(ModelRunner(tiny_model), [second[:-1]], capacity=64)
    n = len(second) - 1
    for k_row, k_fresh in zip(cache.read(1, 0, n)[0], fresh.read(0, 0, n)[0]):
        assert torch.allclose(k_row, k_fresh, atol=1e-5)


def test_each_row_reuses_the_longest_stored_prefix_of_its_own_prompt(tiny_model, tokenizer):
    """Rows whose prompts diverge after the common part each take their own longest stored prefix
    (also a prefix of a longer stored sequence, cut where it diverges); the cache holds bitwise what
    a fresh computation gives, and only the rest is computed."""
    target = ModelRunner(tiny_model)
    base = encode(tokenizer, LONG)
    a = base + encode(tokenizer, " and a dog who liked to run")
    b = base + encode(tokenizer, " on a warm mat by the door")
    admit_prompts(target, [a, [*a, 7]], capacity=64)  # stores a[:-1]
    cache, _ = admit_prompts(target, [b, [*b, 9]], capacity=64)  # stores the common part of b's prompts
    target.remember(cache, 1, [*b, 9])  # row 1 as committed (b, each row's prompt but its last token)
    a2 = [*a[:-3], 11, 12]  # diverges from the stored `a` three tokens before its end
    prompts = [[*base, 13], a2, [*b, 17, 18]]
    computed = target.prompt_tokens_computed
    cache, pending = admit_prompts(target, prompts, capacity=64)
    reused = [len(base), len(a) - 3, len(b)]
    assert pending == [p[-1:] for p in prompts]
    assert cache.lens.tolist() == [len(p) - 1 for p in prompts]
    assert target.prompt_tokens_computed - computed == sum(len(p) - n for p, n in zip(prompts, reused))
    for row, p in enumerate(prompts):
        n = len(p) - 1
        fresh, _ = prefill(ModelRunner(tiny_model), [p[:n]], capacity=64)
        got, want = cache.read(row, 0, n), fresh.read(0, 0, n)
        for k_row, k_fresh in zip(got[0] + got[1], want[0] + want[1]):
            assert_same_forward(k_row, k_fresh)


def test_prefix_cache_is_a_radix_tree_under_its_cap(tiny_model):
    """Shared prefixes are stored once (edges split where sequences diverge), a match may end inside
    an edge, the restored KV is the row's own, and least recently used leaves go past the cap
    (stored as copies: rows of their own; tests/test_paged_kv.py has the paged store's)."""
    target = ModelRunner(tiny_model, paged=False)
    cache = target.new_cache(3, 60)
    cache.lens[:] = 55
    for k in cache.keys + cache.values:
        k.copy_(torch.randn(k.shape))
    per_token = sum(k[0, :, :1].nbytes + v[0, :, :1].nbytes for k, v in zip(cache.keys, cache.values))
    store = PrefixCache(MemoryBudget(50 * per_token))
    a, b = tuple(range(20)), (*range(12), 99, 98)
    store.store(a[:10], cache, 0)
    store.store(a, cache, 0)  # extends the stored sequence: only the last 10 tokens are added
    assert store.sequences() == [a] and store.nbytes == 20 * per_token
    store.store(b, cache, 1)  # shares 12 tokens: the edge splits, 2 tokens are added
    assert sorted(store.sequences()) == sorted([a, b]) and store.nbytes == 22 * per_token
    match = store.match([*range(15), 7])
    assert match.length == 15
    fresh = target.new_cache(1, 60)
    store.restore(match, fresh, 0, 3, 15)
    for got, want in zip(fresh.keys + fresh.values, cache.keys + cache.values):
        assert torch.equal(got[0, :, 3:15], want[0, :, 3:15])
    assert int(fresh.lens[0]) == 15 and store.match([5, 6]).length == 0
    c = tuple(range(100, 130))
    store.match(a)  # a is now more recently used than b
    store.store(c, cache, 2)  # 52 tokens > 50: the least recently used leaf (b's 2 tokens) goes
    assert sorted(store.sequences()) == sorted([a, c]) and store.nbytes == 50 * per_token
    store.store(tuple(range(200, 251)), cache, 2)  # larger than the whole cap: not stored
    assert store.nbytes <= store.max_bytes and tuple(range(200, 251)) not in store.sequences()


def test_stores_share_one_budget_and_evict_least_recently_used_first(tiny_model):
    """Two engines' stores on one budget: together they stay under it, the idle store's leaves go
    before the busy one's, and leaves go in the order of their last use (against a full scan)."""
    target = ModelRunner(tiny_model, paged=False)
    cache = target.new_cache(1, 8)
    cache.lens[:] = 2
    per_seq = sum(k[0, :, :2].nbytes + v[0, :, :2].nbytes for k, v in zip(cache.keys, cache.values))
    budget = MemoryBudget(40 * per_seq)
    idle, busy = PrefixCache(budget), PrefixCache(budget)
    for i in range(30):
        idle.store((1000 + i, 1), cache)
    g = torch.Generator().manual_seed(0)
    last_use: dict[tuple[int, ...], int] = {}  # every sequence the busy store was given
    for step in range(300):
        seq = (int(torch.randint(0, 60, (1,), generator=g)), 2)
        if step % 2 and seq in busy.sequences():
            busy.match(seq)
        else:
            busy.store(seq, cache)
        last_use[seq] = step
        assert idle.nbytes + busy.nbytes <= budget.max_bytes
    assert idle.sequences() == []  # the idle store gave everything to the busy one
    kept = set(busy.sequences())
    evicted = set(last_use) - kept
    assert len(kept) == 40 and budget.evictions >= 30 + len(evicted)  # one leaf per sequence
    # Least recently used first: every sequence evicted was last used before every one kept.
    assert max(last_use[s] for s in evicted) < min(last_use[s] for s in kept)


# --- a forward's token budget ---------------------------------------------------------------------------


def test_a_tree_prefix_is_the_tree_drawn_up_to_that_node():
    tree = DraftTree(draw="without_replacement")
    a = tree.add(5, ROOT, 0.5)
    b = tree.add(6, ROOT, 0.3)
    tree.add(7, a, 0.9)
    tree.add(8, b, 0.2)
    tree.dists = {ROOT: ([5, 6], [0.5, 0.3]), a: ([7], [0.9]), b: ([8], [0.2])}
    tree.shape_nodes = [0, 1, 2, 3]
    cut = tree.prefix(3)
    assert (cut.tokens, cut.parents, cut.probs, cut.shape_nodes) == (
        [5, 6, 7],
        [ROOT, ROOT, a],
        [0.5, 0.3, 0.9],
        [0, 1, 2],
    )
    assert set(cut.dists) == {ROOT, a, b} and cut.draw == "without_replacement"
    assert set(tree.prefix(1).dists) == {ROOT, a} and tree.prefix(4) is tree and len(tree.prefix(0)) == 0


def test_trees_are_cut_to_the_forward_budget():
    trees = [DraftTree() for _ in range(3)]
    for t in trees:
        for _ in range(9):
            t.add(1, len(t) - 1)
    assert [len(t) for t in cut_to_budget(trees, 16)] == [4, 4, 4]  # 16 // 3 tokens per row, the root one of them
    assert [len(t) for t in cut_to_budget(trees * 8, 16)] == [0] * 24
    assert cut_to_budget(trees, None) is trees
    assert VerifyOptions().budget(torch.device("cpu")) == 16 and VerifyOptions().budget(torch.device("cuda")) is None
    assert (
        VerifyOptions(max_tokens=None).budget(torch.device("cpu")) is None
        and VerifyOptions(max_tokens=40).budget(torch.device("cpu")) == 40
    )
    with pytest.raises(ConfigError, match=r"verify.max_tokens=0 must be a positive number of tokens, auto or null"):
        VerifyOptions(max_tokens=0)
