"""The `ar` and `hf` decoders against `transformers` generate and against the target distribution."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from decoding.base.values import GenRequest
from decoding.speculation.sampling import SamplingParams, process_logits

EOS_ID = 2  # the tiny tokenizer's <eos> (tests/conftest.py)

PROMPTS = ["the cat", "hello world and more", "a", "1 2 3 4", "once upon a time"]
BUDGETS = [20, 7, 12, 15, 9]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def reference_greedy(model, ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """`transformers` generate(do_sample=False) on one prompt: the tokens it adds (EOS included)."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(eos_ids),
            pad_token_id=0,
        )
    return out[0, x.shape[1] :].tolist()


def expected_reason(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> str:
    if tokens and tokens[-1] in eos_ids:
        return "eos"
    assert len(tokens) == max_new_tokens
    return "length"


def tvd(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def tvd_tolerance(p: torch.Tensor, n: int, delta: float = 1e-6) -> float:
    """A bound the TVD between p and the empirical distribution of n draws from p exceeds with probability < delta.

    E[TVD] = 1/2 sum_i E|p̂_i - p_i| <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen). The TVD changes by at
    most 1/n when one draw changes, so by McDiarmid P(TVD >= E[TVD] + t) <= exp(-2 n t^2); with
    t = sqrt(ln(1/delta) / (2n)) a correct sampler fails with probability below delta (the seeds are
    fixed anyway, so the outcome is deterministic).

    With n = 10,000 first tokens this is 0.083 at temperature 1 (all 282 tokens in the support; the
    measured TVD is 0.044) and 0.041 at temperature 0.7 with top-k 20 / top-p 0.9 (11 tokens; measured
    0.017). The plausible bugs checked alongside sit well outside: temperature off by 20% (0.15 and
    0.07), top-k/top-p not applied (0.22), temperature not applied (0.11). Smaller errors, such as a
    temperature off by 10% on the near-flat temperature-1 distribution, are below what 10,000 draws
    resolve. The conditional second-token check sees fewer draws (about 700 and 1,500), so its
    tolerance is wider (0.27 and 0.12).
    """
    p = p.double()
    return 0.5 * float((p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1 / delta) / (2 * n))


def empirical(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def target_probs(model, ids: list[int], params: SamplingParams) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[:, -1]
    return process_logits(logits, [params])[0].double().cpu()


# --- greedy ----------------------------------------------------------------------------------------


def test_greedy_ar_and_hf_equal_generate(tiny_model, tokenizer, make_engine):
    # Different prompts, the same prompt with several budgets, and one prompt repeated three times.
    specs = [*zip(PROMPTS, BUDGETS), ("the cat", 5), ("the cat", 5), ("the cat", 5), ("a", 20)]
    requests = [GenRequest(p, max_new_tokens=m) for p, m in specs]
    eos = {EOS_ID}
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, eos) for p, m in specs]
    for decoder in ("ar", "hf"):
        results = make_engine(decoder).generate(requests)
        for (_, m), ref, res in zip(specs, refs, results):
            assert res.token_ids == ref, decoder
            assert res.finish_reason == expected_reason(ref, m, eos)
            assert res.text == tokenizer.decode(ref, skip_special_tokens=True)


def _greedy_with_eos_mid_batch(tiny_model, tokenizer):
    """Requests, and an EOS id that the greedy continuation of the first prompt emits partway.

    The random model never emits the tokenizer's EOS, so a token that "the cat" produces greedily at
    step k (and nowhere before it) is declared an EOS as well; no other prompt produces it within
    its budget, so those rows end on length while the first row ends on EOS mid-batch.
    """
    conts = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in zip(PROMPTS, BUDGETS)]
    others = {t for c in conts[1:] for t in c}
    first = conts[0]
    for k in range(5, BUDGETS[0] - 3):
        if first[k] not in first[:k] and first[k] not in others and first[k] > EOS_ID:
            return first[k], k
    pytest.fail(f"no token usable as a mid-sequence EOS in {first}")


def test_eos_mid_batch(tiny_model, tokenizer, make_engine, monkeypatch):
    extra_eos, k = _greedy_with_eos_mid_batch(tiny_model, tokenizer)
    config = copy.deepcopy(tiny_model.generation_config)
    config.eos_token_id = [EOS_ID, extra_eos]
    monkeypatch.setattr(tiny_model, "generation_config", config)
    eos = {EOS_ID, extra_eos}

    # The same prompt again with a budget that ends before its EOS, and with one that reaches it.
    specs = [*zip(PROMPTS, BUDGETS), ("the cat", 4), ("the cat", 30)]
    requests = [GenRequest(p, max_new_tokens=m) for p, m in specs]
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, eos) for p, m in specs]
    assert len(refs[0]) == k + 1 and refs[0][-1] == extra_eos
    for decoder in ("ar", "hf"):
        engine = make_engine(decoder)
        assert engine.eos_ids == frozenset(eos)
        results = engine.generate(requests)
        assert [r.token_ids for r in results] == refs, decoder
        reasons = [r.finish_reason for r in results]
        assert reasons == ["eos", "length", "length", "length", "length", "length", "eos"], decoder
        assert len(results[0].token_ids) == k + 1 < BUDGETS[0]
        if decoder == "ar":
            # The EOS row left the batch; the others went on: one forward per token of the longest row,
            # after one forward computing every prompt.
            assert engine.last_stats.target_forwards == max(len(r) for r in refs) + 1


def _stop_string_case(tiny_model, tokenizer):
    """A greedy continuation and a stop string that starts inside one of its multi-character tokens."""
    prompt, budget = "hello world and more", 20
    gen = reference_greedy(tiny_model, encode(tokenizer, prompt), budget, {EOS_ID})
    for k in range(3, budget - 4):
        a, b = tokenizer.decode([gen[k]]), tokenizer.decode([gen[k + 1]])
        if len(a) >= 2 and len(b) >= 2 and (a + b)[1:-1].strip():
            return prompt, budget, gen, (a + b)[1:-1]
    pytest.fail(f"no two neighbouring multi-character tokens in {gen}")


def test_stop_string(tiny_model, tokenizer, make_engine):
    prompt, budget, gen, stop = _stop_string_case(tiny_model, tokenizer)
    # Expected, one token at a time: the first prefix whose text contains the stop string.
    n = next(i for i in range(1, len(gen) + 1) if stop in tokenizer.decode(gen[:i]))
    assert n < budget
    full = tokenizer.decode(gen[:n])
    expected_text = full[: full.find(stop)]
    # The stop string starts and ends inside tokens: the text is cut mid-token, and the last kept
    # token carries characters past the stop string.
    assert expected_text not in {tokenizer.decode(gen[:j]) for j in range(n + 1)}
    assert not full.endswith(stop)

    other = PROMPTS[3]
    other_ref = reference_greedy(tiny_model, encode(tokenizer, other), 15, {EOS_ID})
    never = "QQQ"
    assert never not in tokenizer.decode(other_ref) and never not in tokenizer.decode(gen)
    requests = [
        GenRequest(prompt, max_new_tokens=budget, stop=(never, stop)),
        GenRequest(other, max_new_tokens=15, stop=(never,)),
        GenRequest(prompt, max_new_tokens=budget),
        GenRequest(prompt, max_new_tokens=budget, stop=stop),
    ]
    for decoder in ("ar", "hf"):
        results = make_engine(decoder).generate(requests)
        for i in (0, 3):
            assert results[i].finish_reason == "stop", decoder
            assert results[i].token_ids == gen[:n], decoder
            assert results[i].text == expected_text
            assert stop not in results[i].text
        assert results[1].finish_reason == "length"
        assert results[1].token_ids == other_ref
        assert results[2].finish_reason == "length"
        assert results[2].token_ids == gen


def test_hf_ignores_model_generation_defaults(tiny_model, tokenizer, make_engine, monkeypatch):
    """A checkpoint's generation_config may carry its own sampling options (repetition penalty, min_p,
    sampling on by default, ...). Every decoder samples only the request's temperature / top-k / top-p,
    so hf must not pick those up: it has to agree with ar."""
    requests = [
        GenRequest("the cat", max_new_tokens=20),
        GenRequest("once upon a time", max_new_tokens=20, temperature=1.0, seed=3),
        GenRequest("a", max_new_tokens=20, temperature=0.8, top_k=30, top_p=0.9, seed=4),
    ]
    before = [r.token_ids for r in make_engine("hf").generate(requests)]
    config = copy.deepcopy(tiny_model.generation_config)
    for key, value in {
        "do_sample": True,
        "temperature": 0.3,
        "top_k": 3,
        "repetition_penalty": 1.5,
        "no_repeat_ngram_size": 2,
        "min_p": 0.2,
    }.items():
        setattr(config, key, value)
    monkeypatch.setattr(tiny_model, "generation_config", config)
    after = [r.token_ids for r in make_engine("hf").generate(requests)]
    assert after == before
    assert tiny_model.generation_config is config  # restored after the call
    greedy_ar = make_engine("ar").generate(requests[:1])[0].token_ids
    assert after[0] == greedy_ar


# --- sampling --------------------------------------------------------------------------------------


def sampled_requests(seed: int) -> list[GenRequest]:
    return [
        GenRequest("the cat", max_new_tokens=12, temperature=1.0, seed=seed),
        GenRequest("the cat", max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=seed + 1),
        GenRequest("hello world and more", max_new_tokens=8, temperature=1.2, top_p=0.8, seed=seed + 2),
    ]


@pytest.mark.parametrize("decoder", ["ar", "hf"])
def test_same_seed_same_output(make_engine, decoder):
    engine = make_engine(decoder)
    first = engine.generate(sampled_requests(10))
    second = make_engine(decoder).generate(sampled_requests(10))
    again = engine.generate(sampled_requests(10))
    assert [r.token_ids for r in first] == [r.token_ids for r in second] == [r.token_ids for r in again]
    assert [r.text for r in first] == [r.text for r in second]


@pytest.mark.parametrize("decoder", ["ar", "hf"])
def test_different_seeds_different_outputs(make_engine, decoder):
    requests = [GenRequest("the cat", max_new_tokens=10, temperature=1.0, seed=s) for s in range(6)]
    outputs = {tuple(r.token_ids) for r in make_engine(decoder).generate(requests)}
    assert len(outputs) == 6


def test_ar_output_does_not_depend_on_batch(make_engine):
    probe = GenRequest("the cat", max_new_tokens=12, temperature=0.9, top_k=50, seed=123)
    alone = make_engine("ar").generate([probe])[0]
    crowd = [
        GenRequest("hello world and more", max_new_tokens=3, temperature=1.0, seed=1),
        GenRequest("the cat", max_new_tokens=20, temperature=1.0, seed=124),
        probe,
        GenRequest("the cat", max_new_tokens=12, temperature=0.9, top_k=50, seed=125),
        GenRequest("once upon a time", max_new_tokens=16),
        probe,
        GenRequest("a", max_new_tokens=2, temperature=1.5, top_p=0.5, seed=2),
    ]
    results = make_engine("ar").generate(crowd)
    assert results[2].token_ids == alone.token_ids
    assert results[5].token_ids == alone.token_ids
    assert results[3].token_ids != alone.token_ids  # a different seed does differ


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)],
    ids=["t1.0", "t0.7-k20-p0.9"],
)
def test_ar_sampling_matches_target_distribution(tiny_model, tokenizer, make_engine, params):
    """Statistical losslessness: first (and second) generated tokens follow the processed target distribution."""
    n, chunk = 10_000, 5_000
    prompt = encode(tokenizer, "once upon a time")
    engine = make_engine("ar")
    results = []
    for start in range(0, n, chunk):
        results += engine.generate(
            [
                GenRequest(
                    tuple(prompt),
                    max_new_tokens=2,
                    temperature=params.temperature,
                    top_k=params.top_k,
                    top_p=params.top_p,
                    seed=s,
                )
                for s in range(start, start + chunk)
            ]
        )
    vocab = len(tokenizer)
    first = [r.token_ids[0] for r in results]
    emp = empirical(first, vocab)
    p = target_probs(tiny_model, prompt, params)
    tol = tvd_tolerance(p, n)
    assert tvd(emp, p) < tol, f"TVD {tvd(emp, p):.4f} >= tolerance {tol:.4f}"
    assert (emp[p == 0] == 0).all(), "sampled a token outside the top-k / top-p support"
    # The test can fail: distributions a plausible bug would sample are far outside the tolerance.
    wrong = [SamplingParams(0.8 * params.temperature, params.top_k, params.top_p)]
    if params.top_k or params.top_p < 1:
        wrong += [SamplingParams(params.temperature), SamplingParams(1.0, params.top_k, params.top_p)]
    for w in wrong:
        assert tvd(emp, target_probs(tiny_model, prompt, w)) > tol, w

    # Second token, conditional on the most frequent first token.
    top = max(set(first), key=first.count)
    assert top != EOS_ID
    second = [r.token_ids[1] for r in results if r.token_ids[0] == top]
    q = target_probs(tiny_model, [*prompt, top], params)
    tol2 = tvd_tolerance(q, len(second))
    assert tvd(empirical(second, vocab), q) < tol2, f"n={len(second)}"


# --- statistics ------------------------------------------------------------------------------------


def test_ar_decode_stats(make_engine):
    requests = [GenRequest(p, max_new_tokens=m) for p, m in zip(PROMPTS, BUDGETS)]
    requests.append(GenRequest("the cat", max_new_tokens=6, temperature=1.0, seed=9))
    engine = make_engine("ar")
    results = engine.generate(requests)
    stats = engine.last_stats
    lengths = [len(r.token_ids) for r in results]
    assert stats.generated_tokens == sum(lengths)
    assert stats.acceptance_length == 1.0
    assert stats.verify_steps == sum(lengths)
    # One forward computing the prompts but their last tokens (each distinct prompt of more than one
    # once), then one batched forward per step of the longest sequence (the first yields the first tokens).
    prefilled = len({tuple(engine.encode(r.prompt)) for r in requests if len(engine.encode(r.prompt)) > 1})
    assert stats.target_forwards == max(lengths) + 1 == engine.target.forwards
    assert stats.target_forwards < stats.generated_tokens
    # Each forward scores every live row once: a row is in as many forwards as it has tokens.
    assert stats.target_rows == sum(lengths) + prefilled
    assert stats.rows_per_forward == (sum(lengths) + prefilled) / (max(lengths) + 1)
    assert stats.prompt_tokens == sum(len(engine.encode(r.prompt)) for r in requests)
    assert stats.drafted_tokens == stats.accepted_tokens == 0
    assert stats.wall_s > 0
    for r in results:
        assert r.stats.generated_tokens == len(r.token_ids)
        assert r.stats.acceptance_length == 1.0
    engine.generate(requests[:2])
    assert engine.total_stats.generated_tokens == sum(lengths) + sum(lengths[:2])
    # The second call's prompts are stored: nothing to compute before its first step.
    assert engine.total_stats.target_forwards == max(lengths) + 1 + max(lengths[:2])
    assert engine.generate([]) == []
    assert engine.last_stats.generated_tokens == 0


def test_shared_prompt_tokens_are_computed_once(make_engine):
    engine = make_engine("ar")
    prompt = "once upon a time there was a cat who sat"
    n = len(engine.encode(prompt))
    requests = [GenRequest(prompt, max_new_tokens=m, temperature=1.0, seed=m) for m in (3, 5, 7)]
    lengths = [len(r.token_ids) for r in engine.generate(requests)]
    stats = engine.last_stats
    # All but the last prompt token once (one row, one forward), then each row's last token.
    assert (stats.prompt_tokens, stats.prompt_tokens_computed) == (3 * n, n - 1 + 3)
    assert stats.target_forwards == 1 + max(lengths) and stats.target_rows == 1 + sum(lengths)
    engine.generate(requests)  # the prefix is stored: only the rows' last tokens are computed
    assert (engine.last_stats.prompt_tokens, engine.last_stats.prompt_tokens_computed) == (3 * n, 3)


@pytest.mark.parametrize("decoder", ["ar", "seed_stand"])
def test_reused_prefixes_change_no_sample(make_engine, decoder):
    """Sampled continuations are the same whether their prompts' KV is computed afresh or restored
    from what earlier calls stored (their prompts and their outputs): the restored KV has the bits.
    Both engines below start with empty drafter pools; one gets the stored prefixes of a warm one."""
    first = [
        GenRequest("once upon a time there was a cat", max_new_tokens=12, temperature=1.0, seed=s) for s in range(3)
    ]
    warm = make_engine(decoder)
    outs = warm.generate(first)
    longer = [
        GenRequest(r.prompt + o.text + " and", max_new_tokens=8, temperature=1.0, seed=7) for r, o in zip(first, outs)
    ]
    longer.append(GenRequest("the dog", max_new_tokens=8, temperature=1.0, seed=8))
    reusing = make_engine(decoder)
    reusing.target.prefixes = warm.target.prefixes
    reused = reusing.generate(longer)
    assert reusing.last_stats.prompt_tokens_computed < reusing.last_stats.prompt_tokens
    fresh = make_engine(decoder)
    assert [r.token_ids for r in reused] == [r.token_ids for r in fresh.generate(longer)]
    assert fresh.last_stats.prompt_tokens_computed > reusing.last_stats.prompt_tokens_computed


def test_hf_decode_stats(make_engine):
    requests = [GenRequest(p, max_new_tokens=m) for p, m in zip(PROMPTS[:3], BUDGETS[:3])]
    engine = make_engine("hf")
    results = engine.generate(requests)
    total = sum(len(r.token_ids) for r in results)
    assert engine.last_stats.generated_tokens == total
    assert engine.last_stats.acceptance_length == 1.0
    # generate runs one forward per new token, one sequence at a time.
    assert engine.last_stats.target_forwards == total
    assert engine.last_stats.rows_per_forward == 1.0


def test_ar_samples_what_hf_samples(make_engine):
    """At temperature > 0 a row without a draft samples as `hf` does (the same logits bits, the same
    Gumbel noise of the request's seed at each position), so `ar` gives `hf`'s very samples."""
    requests = [
        GenRequest(p, max_new_tokens=m, temperature=0.9, seed=i) for i, (p, m) in enumerate(zip(PROMPTS, BUDGETS))
    ]
    ar = [r.token_ids for r in make_engine("ar").generate(requests)]
    assert ar == [r.token_ids for r in make_engine("hf").generate(requests)]
    assert len({tuple(t) for t in ar}) > 1
