"""The matched walk as tensor operations (decoding/speculation/device_walk.py) against the host's walk:
the same path and token for every tree, on the tests' device (TOT_TEST_DEVICE), and the acceptance
stage's verdicts the same whichever walks."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import DEVICE
from test_decoders import EOS_ID, PROMPTS, encode, reference_greedy
from test_speculative import ScriptedDrafter, ragged_requests

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine
from decoding.base.errors import ConfigError
from decoding.base.values import GenRequest
from decoding.runtime.models import ModelSpec
from decoding.runtime.packing import pack
from decoding.runtime.runner import Scored
from decoding.schedules.scheduler import Scheduler
from decoding.speculation.acceptance import walk_matched
from decoding.speculation.device_walk import read_walks, walk_matched_rows
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.options import VerifyOptions
from decoding.speculation.row_sampling import RowSampling
from decoding.speculation.sampling import SamplingParams
from decoding.speculation.sequence import Sequence
from decoding.speculation.stopping import StopRule
from decoding.speculation.verify import Verdict, accept
from decoding.trees.policies import DraftTreeOptions

VOCAB = 40


def random_tree(gen: torch.Generator, n: int) -> DraftTree:
    """n nodes under random parents, tokens from a small vocabulary, so siblings repeat tokens."""
    tree = DraftTree()
    for i in range(n):
        parent = ROOT if i == 0 else int(torch.randint(-1, i, (1,), generator=gen))
        tree.add(int(torch.randint(0, 6, (1,), generator=gen)), parent)
    return tree


def targets_along(tree: DraftTree, gen: torch.Generator) -> list[int]:
    """A target at the root and after each node, mostly one of its children's tokens, so walks go deep."""
    out = []
    for node in (ROOT, *range(len(tree))):
        kids = tree.children(node)
        if kids and float(torch.rand((), generator=gen)) < 0.8:
            out.append(tree.tokens[kids[int(torch.randint(0, len(kids), (1,), generator=gen))]])
        else:
            out.append(int(torch.randint(0, 6, (1,), generator=gen)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_device_walk_is_the_host_walk(seed):
    """Rows of 0-40 nodes, duplicate siblings and chains 1-40 deep, in one call: each row's path (the
    first matching sibling at each depth) and token are what `walk_matched` finds on the host."""
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(gen, n) for n in (0, 1, 3, 12, 40, 0, 7)]
    chain = DraftTree()
    for i in range(40):
        chain.add(i % 5, i - 1 if i else ROOT)
    trees.append(chain)
    twins = (
        DraftTree()
    )  # two children of the root with one token: the first is the walk's, however deep the second goes
    for token, parent in ((1, ROOT), (1, ROOT), (2, 1)):
        twins.add(token, parent)
    trees.append(twins)
    targets = [targets_along(t, gen) for t in trees]
    targets[-2] = [*(i % 5 for i in range(40)), 3]  # the whole chain kept, then its bonus token
    targets[-1] = [1, 3, 2, 4]
    flat = torch.tensor([x for row in targets for x in row], device=DEVICE)
    walked, _ = read_walks(trees, walk_matched_rows(trees, flat))
    for tree, own, got in zip(trees, targets, walked):
        assert got == walk_matched(tree, lambda node, d, own=own: own[node + 1])
    assert walked[-2] == (list(range(40)), 3)
    assert walked[-1] == ([0], 3)


def test_undrafted_rows_alone_read_their_root_targets():
    trees = [DraftTree(), DraftTree(), DraftTree()]
    walks = walk_matched_rows(trees, torch.tensor([7, 9, 11], device=DEVICE))
    assert read_walks(trees, walks)[0] == [([], 7), ([], 9), ([], 11)]
    assert walks.logit_rows().tolist() == [[0], [0], [0]]


@pytest.mark.parametrize("rule", ["match_gumbel", "match_multinomial", "rejection"])
def test_the_acceptance_stage_decides_the_same_whichever_walks(rule):
    """One scored forward of a mixed batch (greedy and sampled rows, drafted and not) decided with the
    walks on the host and with them as tensor operations: the same paths and tokens, row by row (the
    rows that sample from a generator walk on the host in both), and the same top tokens along the
    paths (their probabilities to float32's rounding: the host's softmax is csrc/topk.cpp's, where
    this process has built it)."""
    gen = torch.Generator().manual_seed(11)
    settings = [SamplingParams(0.0), SamplingParams(0.8), SamplingParams(0.7, 20, 0.9), SamplingParams(0.0)]
    trees = [random_tree(gen, n) for n in (9, 6, 0, 0)]
    logits = []
    for tree in trees:
        row = torch.randn(1 + len(tree), VOCAB, generator=gen)
        for node, want in zip((ROOT, *range(len(tree))), targets_along(tree, gen)):
            row[node + 1, want] += 12.0  # the walks' tokens mostly drafted: deep paths
        logits.append(row.to(DEVICE))
    packed = pack([[1] for _ in trees], trees)

    def decided(on_device: bool) -> list[Verdict]:
        seqs = [
            Sequence.create([1, 2, 3 + b], StopRule(frozenset(), (), 50), p, seed=30 + b, device=DEVICE)
            for b, p in enumerate(settings)
        ]
        sampling = RowSampling.of(s.params for s in seqs)
        return accept(packed, Scored(logits, None, 0.0), trees, seqs, sampling, rule, top=5, walk_on_device=on_device)

    host, walked = decided(False), decided(True)
    assert [(v.path, v.token) for v in walked] == [(v.path, v.token) for v in host]
    assert max(len(v.path) for v in host) >= 3
    for w, h in zip(walked, host):  # the top tokens along each path, read back with it
        assert len(w.top[0]) == len(h.top[0]) == 1 + len(h.path)
        assert torch.allclose(torch.tensor(w.top[1]), torch.tensor(h.top[1]), rtol=1e-5, atol=1e-7)
        for ids, probs, host_ids in zip(*w.top, h.top[0]):  # tokens top-k / top-p left out tie at 0, in any order
            kept = sum(p > 0 for p in probs)
            assert ids[:kept] == host_ids[:kept]


@pytest.mark.parametrize("kind", ["perfect", "random"])
def test_scripted_drafts_decode_the_greedy_tokens_with_the_walk_on_device(tiny_model, tokenizer, loaded, kind):
    """`verify.walk=device` on the tests' device (the CPU's default is the host's walk): a batch of
    ragged requests, one ended by a stop string partway through a drafted run, decodes the plain greedy
    tokens whatever the drafts."""
    specs, requests = ragged_requests()
    refs = [reference_greedy(tiny_model, encode(tokenizer, p), m, {EOS_ID}) for p, m in specs]
    engine = Engine(loaded, "ar")
    drafter = ScriptedDrafter(refs, (2, 2, 1), kind, len(tokenizer))
    verify = VerifyOptions(plan="fixed", max_tokens=None, walk="device")
    engine.decoder = Scheduler("scripted", engine.target, tokenizer, drafter, verify=verify)
    assert [r.token_ids for r in engine.generate(requests)] == refs
    assert engine.last_stats.accepted_tokens > 0


@pytest.mark.parametrize("decoder", ["seed_stand", "sd"])
def test_a_mixed_batch_decodes_hfs_tokens_with_the_walk_on_device(loaded, perturbed, decoder):
    """Greedy and sampled requests in one batch, STAND's learnt tables (their top tokens read back with
    the walk) or a perturbed draft model's trees, walked where the logits are: `hf`'s tokens, each
    request's own, the same as with the host's walk."""
    requests = [
        GenRequest(p, max_new_tokens=24, temperature=t, seed=i)
        for i, (p, t) in enumerate(zip([*PROMPTS[:3], "the cat", "the cat"], (0.0, 0.8, 0.0, 1.1, 0.6)))
    ]
    draft = ModelSpec("draft", key="draft") if decoder == "sd" else None
    outs = {}
    for walk in ("device", "host"):
        config = DecoderConfig(
            decoder, DraftTreeOptions(k_config=(2, 2, 1)), verify=VerifyOptions(walk=walk), draft=draft
        )
        engine = Engine(loaded, config, perturbed if draft else None)
        outs[walk] = [r.token_ids for r in engine.generate(requests)]
        assert engine.last_stats.accepted_tokens > 0
    hf = Engine(loaded, DecoderConfig("hf"))
    assert outs["device"] == outs["host"] == [r.token_ids for r in hf.generate(requests)]


def test_an_unknown_walk_is_a_configuration_error():
    with pytest.raises(ConfigError, match=re.escape("verify.walk='gpu' is not one of auto, host, device")):
        VerifyOptions(walk="gpu")
