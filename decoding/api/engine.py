"""The backend's front door: `await Engine.agenerate(requests)` from searches running at once, and
`Engine.generate(requests)`, the synchronous convenience for scripts and notebooks.

Many callers share one running batch: a call's sequences join the decoder's batch between two
steps (forwards) and its awaiter wakes when the last of them stops, while the other calls' rows go
on decoding. The engine steps the decoder only when every caller woken by the previous step has
had its turn to submit, so what runs together is decided by the searches, not by timing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields

from decoding.api.config import DecoderConfig
from decoding.api.decoders import make_decoder
from decoding.base.errors import BackendError
from decoding.base.prompts import PLAIN_SEAM, Seam, chat_seam, render, render_follow_up
from decoding.base.values import Completion, DecodeStats, GenRequest, GenResult, ScheduleStats, check_ids, request_list
from decoding.runtime.memory import peak_rss_mb, rss_mb
from decoding.runtime.models import LoadedModel
from decoding.runtime.runner import ModelRunner
from decoding.schedules.base import add_sequence_totals
from decoding.speculation.logprobs import Choices
from decoding.speculation.sampling import SamplingParams
from decoding.speculation.sequence import Sequence
from decoding.speculation.stopping import StopRule, TokenTexts, final_text

log = logging.getLogger(__name__)
ANOTHER_THREAD = (
    "the engine is decoding a generate call of another thread: one engine serves one caller at a time (a "
    "generate, or the awaited calls of one event loop); give each thread an engine of its own"
)


@dataclass(eq=False)
class _Call:
    requests: list[GenRequest]
    seqs: list[Sequence]
    future: asyncio.Future[Completion]
    live: int
    stats: DecodeStats = field(default_factory=DecodeStats)
    # Per whole-unit field (forwards, rows, ...): its exact shares so far less the units it got.
    owed: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))


class Engine:
    """Tokenizes requests, hands them to one decoder, and detokenizes the results.

    `last_stats` holds the cost of the latest `generate` call as a whole (a batched forward counts
    once); each result's own stats count that sequence's tokens and verification steps.
    """

    def __init__(
        self, loaded: LoadedModel, decoder: str | DecoderConfig = "ar", draft: LoadedModel | None = None
    ) -> None:
        for name, given in (("loaded", loaded), ("draft", draft)):
            if given is not None and not isinstance(given, LoadedModel):
                raise TypeError(
                    f"Engine's {name} is a {type(given).__name__}, not a loaded model: give "
                    f"load_model(ModelSpec(path=...)) (from decoding)"
                )
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.target = ModelRunner(
            loaded.model, loaded.prefix_budget, loaded.static, loaded.strict_graphs, loaded.kv_budget, loaded.paged_kv
        )
        config = decoder if isinstance(decoder, DecoderConfig) else DecoderConfig(decoder)
        if config.server is not None:
            raise BackendError("decoder=server is a client of a server: build it with decoding.api.server.ServerEngine")
        self.decoder = make_decoder(config, self.target, self.tokenizer, draft)
        self.eos_ids = _eos_ids(loaded)
        self.token_texts = TokenTexts()  # each token's text, for the stop checks of every request
        self._seam: Seam | str | None = None  # a follow-up's seam, or why the template has none
        self.last_stats = DecodeStats()
        self.total_stats = DecodeStats()
        self._arrived: list[_Call] = []
        # One caller at a time decodes: a generate call, or the awaited calls of one event loop.
        self._guard = threading.Lock()
        self._generating = False
        self._alone: list[_Call] = []  # after a failed step: its calls, to run one at a time (`_isolate`)
        self._calls: dict[int, _Call] = {}  # id(sequence) -> its call, while it decodes
        self._driver: asyncio.Task[None] | None = None
        # Time spent in the decoder's steps for awaited calls (a bench that interleaves engines
        # forward by forward times each by its own steps, not by the wall clock they share).
        self.step_s = 0.0

    def peak_cache_bytes(self) -> int:
        """The largest KV caches this engine's decoder has held: the target's, plus the draft model's."""
        return self.target.peak_cache_bytes + self.decoder.drafter.peak_cache_bytes()

    def memory(self) -> dict[str, float]:
        """Where this engine's memory is, in MB: the stored prefixes of every engine on its model
        (against their shared cap, and how many leaves were evicted), its KV pool now and at its
        largest (paged: what its rows hold, and the pool's blocks at their most), and the process's
        resident memory now and at its peak."""
        budget = self.target.prefixes.budget
        pool = getattr(self.decoder, "cache", None)
        blocks = self.target.pool
        paged = (
            {}
            if blocks is None
            else {
                "kv_blocks_peak": blocks.peak_used,  # held at once by rows and the prefix store
                "kv_blocks_shared_peak": self.target.peak_shared_blocks,  # held by more than one row
                "kv_block_kb": blocks.block_bytes / 2**10,
            }
        )
        return {
            **paged,
            "prefix_store_mb": budget.nbytes / 2**20,
            "prefix_store_cap_mb": budget.max_bytes / 2**20,
            "prefix_evictions": budget.evictions,
            "kv_pool_mb": (pool.nbytes if pool is not None else 0) / 2**20,
            "peak_kv_mb": self.peak_cache_bytes() / 2**20,
            "rss_mb": rss_mb(),
            "peak_rss_mb": peak_rss_mb(),
        }

    def encode(self, prompt: str | tuple[int, ...], prefix: str = "", context: tuple[int, ...] = ()) -> list[int]:
        if context:
            assert isinstance(prompt, str)
            return render_follow_up(self.tokenizer, self.seam(), context, prompt, prefix, self.eos_ids).ids
        return render(self.tokenizer, self.loaded.use_chat_template, prompt, prefix).ids

    def seam(self) -> Seam:
        """How a follow-up turn joins a finished reply: the chat template's seam, or plain text
        without a template; a BackendError where the template cannot give one."""
        if self._seam is None:
            try:
                self._seam = chat_seam(self.tokenizer) if self.loaded.use_chat_template else PLAIN_SEAM
            except ValueError as e:
                self._seam = str(e)
        if isinstance(self._seam, str):
            raise BackendError(
                f"follow-up turns cannot reuse a reply on {self.loaded.name or self.loaded.source}: {self._seam}; use "
                "task.evaluator=separate, or model.chat_template=false for a plain text seam"
            )
        return self._seam

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Decode `requests` to the end. A request the engine cannot take raises before anything runs; a
        failure while decoding raises too, and the engine drops the call's sequences (their rows, KV
        blocks and pins), so the next call decodes as on a fresh engine."""
        requests = request_list("generate", requests)
        with self._guard:
            if self._driver is not None and not self._driver.done():
                raise BackendError("the engine is serving awaited calls: use `await engine.agenerate(...)` there")
            if self._generating:
                raise BackendError(ANOTHER_THREAD)
            self._generating = True
        try:
            return self._generate(requests)
        finally:
            self._generating = False

    def _generate(self, requests: list[GenRequest]) -> list[GenResult]:
        if not requests:
            self.last_stats = DecodeStats()
            return []
        t0 = time.perf_counter()
        seqs = [self._sequence(r) for r in requests]
        try:
            stats = self.decoder.run(seqs)
        except BaseException:
            self.decoder.clear()
            raise
        # Tokenizing and detokenizing is part of what a call costs.
        self.last_stats = self._finish(seqs, requests, stats, time.perf_counter() - t0).stats
        self.total_stats += self.last_stats
        return self._results(seqs, requests)

    async def agenerate(self, requests: list[GenRequest]) -> Completion:
        """Decode `requests` in the running batch, beside every other call in flight. A request the
        engine cannot take raises here, before it joins; a step that fails is not charged to the calls
        beside the one that caused it (`_isolate`)."""
        requests = request_list("agenerate", requests)
        if not requests:
            return Completion([], DecodeStats())
        loop = asyncio.get_running_loop()
        with self._guard:  # one event loop drives the engine at a time, and no thread's generate beside it
            if self._generating:
                raise BackendError(ANOTHER_THREAD)
            if self._driver is not None and not self._driver.done() and self._driver.get_loop() is not loop:
                raise BackendError(
                    "the engine is serving awaited calls of another event loop (another thread's): await its "
                    "calls in one loop, or give each thread an engine of its own"
                )
            seqs = [self._sequence(r) for r in requests]
            call = _Call(requests, seqs, loop.create_future(), len(seqs))
            self._arrived.append(call)
            if self._driver is None or self._driver.done():
                self._driver = loop.create_task(self._drive())
                # Its callers hear of what stopped it (an interrupt): the task's own error is read here,
                # not reported again as never retrieved.
                self._driver.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await call.future

    async def _drive(self) -> None:
        try:
            while True:
                await self._settle()
                self._admit_next()
                if not self.decoder.busy:
                    return
                t0 = time.perf_counter()
                try:
                    step = self.decoder.step()
                except Exception as e:
                    self._isolate(e)
                    continue
                finally:
                    self.step_s += time.perf_counter() - t0
                self._share(step.cost)
                for s in step.finished:
                    call = self._calls.pop(id(s))
                    call.live -= 1
                    if call.live == 0:
                        self._resolve(call)
        except BaseException as e:  # the driver itself stopped (interrupted): every caller hears of it
            for call in [*self._arrived, *self._alone, *self._in_flight()]:
                if not call.future.done():
                    call.future.set_exception(e)
            self._arrived, self._alone, self._calls = [], [], {}
            self.decoder.clear()
            if not isinstance(e, Exception):
                raise

    def _admit_next(self) -> None:
        """Calls join the batch between steps: those that arrived, or, after a failed step, the calls
        that were in it, one at a time and alone (`_isolate`). A cancelled call never joins."""
        while self._alone and not self.decoder.busy:
            call = self._alone.pop(0)
            if not call.future.done():
                self._admit(call)
                return
        if self._alone:
            return
        for call in self._arrived:
            if not call.future.done():
                self._admit(call)
        self._arrived = []

    def _admit(self, call: _Call) -> None:
        self.decoder.admit(call.seqs)
        call.stats.prompt_tokens = sum(len(s.prompt) for s in call.seqs)
        self._calls.update((id(s), call) for s in call.seqs)

    def _in_flight(self) -> list[_Call]:
        return list({id(c): c for c in self._calls.values()}.values())

    def _isolate(self, error: Exception) -> None:
        """A step failed: the batch is dropped (every row, KV block, pin and drafter entry of it). A call
        alone in it hears of the error. Calls beside others run again from their requests, one at a time
        and alone: one that fails alone is the one at fault and hears of it, the others return what a
        fresh engine returns (seeded decoding is deterministic and lossless, so a rerun's tokens are the
        first run's)."""
        calls = [c for c in self._in_flight() if not c.future.done()]
        self._calls = {}
        self.decoder.clear()
        if len(calls) == 1:
            calls[0].future.set_exception(error)
            return
        log.warning(
            "a decode step failed (%s: %s); its %d calls run again one at a time to find the one at fault",
            type(error).__name__,
            error,
            len(calls),
        )
        for call in calls:
            call.seqs = [self._sequence(r) for r in call.requests]
            call.live, call.stats, call.owed = len(call.seqs), DecodeStats(), defaultdict(float)
        self._alone = calls + self._alone

    def _resolve(self, call: _Call) -> None:
        """A call's sequences all stopped: its results, unless its caller has gone (cancelled)."""
        if call.future.done():
            return
        try:
            # Its time is its share of the steps (draft, verify, other): no wall-clock figure, as calls
            # in flight overlap.
            done = self._finish(call.seqs, call.requests, call.stats, None)
        except Exception as e:  # reading its results failed: this call's fault alone
            call.future.set_exception(e)
            return
        self.total_stats += done.stats
        call.future.set_result(done)

    async def _settle(self) -> None:
        """Yield until the callers woken by the last step have submitted what they send next."""
        n = -1
        while n != len(self._arrived):
            n = len(self._arrived)
            for _ in range(4):
                await asyncio.sleep(0)

    def _share(self, step: DecodeStats) -> None:
        """A step's cost, shared by the live calls in proportion to their live sequences (whole
        forwards and rows by largest remainder, owed remainders carried, so that the shares add up
        and each call's whole units follow its exact share)."""
        step.prompt_tokens = step.prompt_tokens_computed = 0  # counted per call (per sequence), exactly
        calls = list({id(c): c for c in self._calls.values()}.values())
        if len(calls) == 1:  # a whole step to one call: nothing to split
            calls[0].stats += step
            return
        weights = [c.live for c in calls]
        if not sum(weights):
            return
        # The counts and the scheduler's counters alike (their names are distinct: one `owed` per call).
        owed = [c.owed for c in calls]
        split_record(step, [c.stats for c in calls], weights, owed)
        split_record(step.schedule, [c.stats.schedule for c in calls], weights, owed)

    def _finish(
        self, seqs: list[Sequence], requests: list[GenRequest], stats: DecodeStats, elapsed: float | None
    ) -> Completion:
        stats = add_sequence_totals(stats, seqs)
        results = self._results(seqs, requests)
        if elapsed is not None:
            stats.other_s += max(0.0, elapsed - (stats.draft_s + stats.verify_s + stats.other_s))
            stats.elapsed_s = elapsed
        stats.sequences = len(seqs)
        stats.sequence_acceptance_sum = sum(s.stats.acceptance_length for s in seqs)
        return Completion(results, stats)

    def _results(self, seqs: list[Sequence], requests: list[GenRequest]) -> list[GenResult]:
        return [
            GenResult(
                text=(text := final_text(s.generated, s.reason, r.stop, self.tokenizer)),
                token_ids=list(s.generated),
                finish_reason=s.reason or "length",
                stats=s.stats,
                context=s.context(self.tokenizer, text),
                logprobs=list(s.logprobs) if r.logprobs else None,
                choice_logprobs=s.choice_logprobs,
            )
            for s, r in zip(seqs, requests)
        ]

    def _sequence(self, r: GenRequest) -> Sequence:
        """The request as the decoder's sequence; what the model makes of it checked first: its ids
        against the vocabulary, its prompt and what it may generate (or its answers) against the context."""
        vocab = self.target.vocab_size
        if not isinstance(r.prompt, str):
            check_ids("prompt", r.prompt, vocab)
        check_ids("context", r.context, vocab)
        ids = self.encode(r.prompt, r.prefix, r.context)
        if not ids:
            said = (
                "an empty prompt"
                if not r.prompt
                else f"a prompt ({str(r.prompt)[:40]!r}) the tokenizer reads as no token"
            )
            raise BackendError(f"a request has {said}; give at least one token of prompt")
        answers = [self._answer(r, ids, a) for a in r.choices]
        empty = next((i for i, a in enumerate(answers) if not a), None)
        if empty is not None:
            raise BackendError(
                f"choices[{empty}]={r.choices[empty]!r} is no token in the model's tokenizer (characters it cannot "
                "spell); give answers it can"
            )
        choices = Choices.of(answers) if r.choices else None
        # A choice's row holds its answers' tree where a reply's tokens would be.
        room = r.max_new_tokens if choices is None else len(choices.tree)
        limit = self.target.max_length
        if len(ids) + room > limit:
            asked = f"max_new_tokens={r.max_new_tokens}" if choices is None else f"its choices' {room} tokens"
            raise BackendError(
                f"a prompt of {len(ids)} tokens plus {asked} exceeds the model's context of {limit} tokens; shorten "
                "the prompt or lower the token limits (gen.max_thought_tokens, gen.max_eval_tokens)"
                + ("" if choices is None else " or the choices")
            )
        rule = StopRule(self.eos_ids, r.stop, room, self.token_texts)
        params = SamplingParams(r.temperature, r.top_k, r.top_p)
        seq = Sequence.create(ids, rule, params, r.seed, r.group, self.loaded.device)
        seq.follows, seq.keep = r.context, r.keep
        seq.top_logprobs = r.top_logprobs if r.logprobs else None
        seq.choices = choices
        return seq

    def _answer(self, r: GenRequest, ids: list[int], answer: str) -> list[int]:
        """An answer's tokens after the prompt `ids`: as the prompt and answer tokenize together where
        the prompt's tokens stay as they are, else the answer's own."""
        joined = self.encode(r.prompt, r.prefix + answer, r.context)
        if len(joined) > len(ids) and joined[: len(ids)] == ids:
            return joined[len(ids) :]
        return list(self.tokenizer(answer, add_special_tokens=False)["input_ids"])


def split_record(
    step: DecodeStats | ScheduleStats,
    shares: list[DecodeStats] | list[ScheduleStats],
    weights: list[int],
    owed: list[defaultdict[str, float]],
) -> None:
    """Each number of a step's record added to the calls' `shares` in proportion to `weights`: whole
    units (int fields) by largest remainder, counting what each call is `owed` from earlier splits."""
    total = sum(weights)
    for f in fields(step):
        value = getattr(step, f.name)
        if not value or not isinstance(value, int | float):
            continue
        exact = [value * w / total for w in weights]
        parts: list[float] = exact
        if isinstance(value, int):
            parts = list(apportion(value, weights, [o[f.name] for o in owed]))
            for o, e, part in zip(owed, exact, parts):
                o[f.name] += e - part
        for share, part in zip(shares, parts):
            setattr(share, f.name, getattr(share, f.name) + part)


def apportion(total: int, weights: list[int], owed: list[float] | None = None) -> list[int]:
    """`total` split in proportion to `weights` in whole units that add up to it: each exact share
    rounded down, the units left to the largest remainders, counting what each was `owed` from
    earlier splits (exact shares less the units it got), ties to the earlier weight. With `owed`
    carried from step to step, equal weights take turns: a one-forward step does not always go to
    the same caller."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    parts = [int(x) for x in exact]
    carried = owed or [0.0] * len(weights)
    left = [exact[i] - parts[i] + carried[i] for i in range(len(weights))]
    for i in sorted(range(len(weights)), key=lambda i: -left[i])[: total - sum(parts)]:
        parts[i] += 1
    return parts


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    for e in (gen_eos, getattr(loaded.tokenizer, "eos_token_id", None)):
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(e)
    return frozenset(ids)
