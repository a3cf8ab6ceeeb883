"""Test-only helpers: what the tests need of the backend that the backend itself does not."""

from __future__ import annotations

import asyncio
import copy
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from filelock import FileLock

from decoding.base.values import Completion, DecodeStats, GenRequest, GenResult
from decoding.runtime.kv_cache import RowKVCache, _by_position
from decoding.runtime.paged_kv import NULL, PagedKVCache
from decoding.runtime.rows_linear import RowsLinear, use_rows_kernel
from decoding.runtime.runner import ModelRunner
from decoding.speculation.acceptance import chain, proposals, sample_chain
from decoding.speculation.draft_tree import DraftDist, Draw
from decoding.speculation.options import VerifyOptions
from tasks.base import Problem, Prompt, TaskDefaults

T = TypeVar("T")


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], T]) -> T:
    """`make(folder)` once per test run: under pytest-xdist the first worker to ask makes it (in a folder
    beside the workers' own, under a file lock) and pickles it there, and the others read it. A module
    fixture that runs commands (seconds of imports each) then runs them once, not in every worker that
    picks one of its tests. Without xdist: `make` in a new temporary folder."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        return make(tmp_path_factory.mktemp(name))
    folder = tmp_path_factory.getbasetemp().parent / f"{name}-{run}"
    with FileLock(f"{folder}.lock"):
        made = folder / "made.pickle"
        if made.is_file():
            return pickle.loads(made.read_bytes())
        folder.mkdir(exist_ok=True)
        value = make(folder)
        made.write_bytes(pickle.dumps(value))
        return value


# verify.plan=fixed, verify.max_tokens=null: trees verified whole however many rows share a forward (tests of tree
# verification; the default cuts them to 16 tokens per forward on a CPU), with the rejection rules
# at temperature > 0 (verify.rule=rejection), which those tests check.
UNCAPPED = VerifyOptions(plan="fixed", max_tokens=None, rule="rejection")


def acceptance_chain(
    p: torch.Tensor, candidates: list[int], q: DraftDist | None, draw: Draw
) -> tuple[list[float], torch.Tensor]:
    """The rejection rule at one node: the acceptance probability of each candidate given that the
    earlier ones were rejected, and the distribution drawn from when all are rejected."""
    return chain(p, candidates, proposals(q, candidates, draw, p.shape[-1]))


def choose(
    p: torch.Tensor, candidates: list[int], q: DraftDist | None, draw: Draw, generator: torch.Generator
) -> tuple[int | None, int]:
    """Run the rule once: (index of the accepted candidate or None, the token that comes next)."""
    return sample_chain(p, candidates, proposals(q, candidates, draw, p.shape[-1]), generator)


def select_rows(cache: RowKVCache, index: torch.Tensor) -> None:
    """Keep (or repeat) rows, as a cache of just those rows (a copy of each)."""
    lens_index, index = index.cpu(), index.to(cache.device)  # (lengths live on the host)
    if isinstance(cache, PagedKVCache):  # a repeated row holds its blocks once more
        old, new = cache.tables, cache.tables.index_select(0, lens_index)
        cache.pool.hold(new[new != NULL])
        cache.pool.drop(old[old != NULL])
        cache._own.tables = new
        cache.lens = cache.lens.index_select(0, lens_index)
        return
    # Keys stored by position stay so: rows are selected from the storage, not the view.
    cache.keys = [
        k.transpose(2, 3).index_select(0, index).transpose(2, 3) if _by_position(k) else k.index_select(0, index)
        for k in cache.keys
    ]
    cache.values = [v.index_select(0, index) for v in cache.values]
    cache.lens = cache.lens.index_select(0, lens_index)
    cache.siblings = cache.siblings.index_select(0, lens_index)  # a repeated row: a copy, of its siblings
    if cache.graphs is not None:
        cache.graphs.clear()  # they read the replaced tensors


def prefill(runner: ModelRunner, prompts: list[list[int]], capacity: int) -> tuple[RowKVCache, torch.Tensor]:
    """Cache each prompt and return the next-token logits [B, V].

    Identical prompts (the n samples of one thought step) are computed once and fanned out.
    Ragged prompts are padded on the right; a pad slot lies past its row's length, so it is
    never seen and is overwritten by the next forward.
    """
    unique: dict[tuple[int, ...], int] = {}
    fan_out = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
    distinct = list(unique)
    lengths = torch.tensor([len(p) for p in distinct])
    width = int(lengths.max())
    tokens = torch.zeros(len(distinct), width, dtype=torch.long)
    for i, p in enumerate(distinct):
        tokens[i, : len(p)] = torch.tensor(p)
    causal = torch.ones(width, width, dtype=torch.bool).tril().expand(len(distinct), -1, -1)
    depth = torch.arange(width).expand(len(distinct), -1)
    last = lengths - 1
    keep = torch.unique(last)
    cache = runner.new_cache(len(distinct), capacity)
    logits = runner.forward(cache, tokens, causal, depth, logits_at=keep).logits
    cache.advance(lengths)
    rows = torch.arange(len(distinct))
    next_logits = logits[rows, torch.searchsorted(keep, last).to(logits.device)]
    index = torch.tensor(fan_out)
    if len(distinct) != len(prompts) or fan_out != list(range(len(prompts))):
        select_rows(cache, index)
        next_logits = next_logits.index_select(0, index.to(next_logits.device))
    return cache, next_logits


def admit_prompts(runner: ModelRunner, prompts: list[list[int]], capacity: int) -> tuple[RowKVCache, list[list[int]]]:
    """A cache holding the prompts as the schedulers admit them (row b = prompts[b]) and per row the
    tokens still to feed; a row then holds `capacity` positions past its prompt's fed part."""
    cache = runner.new_cache(0, 1)
    return cache, runner.admit(cache, list(range(len(prompts))), prompts, capacity - max(map(len, prompts))).pending


class AwaitableFake:
    """Gives a scripted fake engine (its `generate` and `last_stats`) the awaitable call searches
    make; each call yields once first, as a real engine's caller waits for a step."""

    async def agenerate(self, requests: list[GenRequest]) -> Completion:
        await asyncio.sleep(0)
        results = self.generate(requests)  # type: ignore[attr-defined]
        return Completion(results, self.last_stats)  # type: ignore[attr-defined]


def reply(text: str, token_ids: list[int]) -> GenResult:
    """A scripted engine's result, counted as an engine counts it (tokens in its stats)."""
    return GenResult(text, token_ids, "stop", DecodeStats(generated_tokens=len(token_ids)))


class ScriptedTask(TaskDefaults):
    """What the scripted tasks of the search tests share: thoughts are the replies as written, the
    generator sees the path (prefix "G"), the evaluator the last step (prefix "E") and replies with a
    number, the answer is the last step, nothing is correct."""

    def generator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        return Prompt("/".join(steps), prefix="G")

    def parse_thought(self, problem: Problem, steps: list[str], text: str) -> str:
        return text

    def evaluator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        return Prompt(steps[-1], prefix="E")

    def parse_value(self, text: str) -> float:
        return float(text)

    def answer(self, problem: Problem, steps: list[str]) -> str:
        return steps[-1]

    def is_correct(self, problem: Problem, answer: str) -> bool:
        return False


def assert_same_forward(a: torch.Tensor, b: torch.Tensor) -> None:
    """What the same tokens give in two forwards of different batches: the same bits on the CPU (the
    batch-invariant forward); on a GPU, where cuBLAS and sdpa choose kernels by shape
    (TOT_TEST_DEVICE=cuda, float32 without TF32), equal to float32 rounding."""
    if a.device.type == "cpu":
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def with_linear_kernel(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """A copy of a bfloat16 model whose dense linears run torch's kernel (aten) or the row-invariant one (rows)."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if type(module) is RowsLinear:
            module.__class__ = torch.nn.Linear
    if kind == "rows":
        use_rows_kernel(model)
    return model
