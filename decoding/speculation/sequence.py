"""The decode state of one request, shared by every decoder."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoding.base.values import DecodeStats, FinishReason, Group, TokenLogprob
from decoding.runtime.kv_bytes import Need
from decoding.speculation.gumbel import Coupling
from decoding.speculation.logprobs import Choices
from decoding.speculation.sampling import SamplingParams, make_generator
from decoding.speculation.stopping import Detokenizer, StopRule, final_text, reply_ids

DRAFT_SEED_SALT = 0x5EED_D4AF7


@dataclass
class Sequence:
    prompt: list[int]
    rule: StopRule
    params: SamplingParams
    generator: torch.Generator
    # Drafting draws its own random numbers, so that the target's stream stays that of the request.
    draft_generator: torch.Generator
    # Plain decoding's sampling stream under match_multinomial: on the model's device, where
    # `transformers` draws with torch.multinomial (a GPU's stream is not a CPU's).
    sample_generator: torch.Generator
    group: Group = field(default_factory=Group)  # trajectories of one ToT step share cross-trajectory draft statistics
    seed: int = 0  # the request's seed: its generator's, and the key of its Gumbel noise
    generated: list[int] = field(default_factory=list)
    reason: FinishReason | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)
    follows: tuple[int, ...] = ()  # a follow-up: the finished sequence it continues (GenRequest.context)
    keep: bool = False  # stored and pinned when it finishes, until a follow-up of it is admitted
    waits_for_memory: bool = False  # queued while the KV pool had no room for it (counted once)
    # GenRequest.logprobs: the most likely tokens kept beside each (None: not asked), and what the
    # commits found, one per generated token.
    top_logprobs: int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # GenRequest.choices: the answers' tree, scored in place of generating (then `choice_logprobs`).
    choices: Choices | None = None
    choice_logprobs: list[float] | None = None
    _checked: int = 0
    _context: tuple[int, ...] | None = None
    _prompt_key: tuple[int, ...] | None = None

    @classmethod
    def create(
        cls,
        prompt: list[int],
        rule: StopRule,
        params: SamplingParams,
        seed: int,
        group: Group | None = None,
        device: torch.device | None = None,
    ) -> Sequence:
        return cls(
            prompt=prompt,
            group=Group() if group is None else group,
            seed=seed,
            rule=rule,
            params=params,
            generator=make_generator(seed),
            draft_generator=make_generator(seed ^ DRAFT_SEED_SALT),
            sample_generator=make_generator(seed, device),
        )

    def context(self, tokenizer: Detokenizer, text: str | None = None) -> tuple[int, ...]:
        """What a follow-up of this finished sequence continues: its prompt, then its reply up to
        where the reply's text (`text`, if the caller has it) ends. Worked out once: the scheduler
        pins a kept sequence under it, and its result carries it."""
        if self._context is None:
            if text is None:
                text = final_text(self.generated, self.reason, self.rule.stop, tokenizer)
            self._context = tuple(self.prompt + reply_ids(self.generated, self.reason, text, tokenizer))
        return self._context

    @property
    def prompt_key(self) -> tuple[int, ...]:
        """The prompt as a tuple, made once: the pool's tally reads it for every live row each step."""
        if self._prompt_key is None:
            self._prompt_key = tuple(self.prompt)
        return self._prompt_key

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def position(self) -> int:
        """The absolute position of the next token (prompt included): where its Gumbel noise is keyed."""
        return len(self.prompt) + len(self.generated)

    def tail(self, n: int) -> list[int]:
        """The last n tokens of the context (prompt and generated), without copying the whole of it."""
        gen = self.generated
        if len(gen) >= n:
            return gen[len(gen) - n :]
        return self.prompt[max(0, len(self.prompt) - (n - len(gen))) :] + gen

    def coupling(self) -> Coupling:
        """What a coupled drafter needs to propose this sequence's own next samples."""
        return Coupling(self.seed, self.position)

    @property
    def room(self) -> int:
        """The deepest draft node worth drafting: a step commits at most the accepted path plus the
        target's own token, so deeper nodes could never be kept (and could pass the model's context)."""
        return self.rule.max_new_tokens - len(self.generated) - 1

    def scored(self, logprobs: list[float]) -> None:
        """A choice's answers were scored: it ends without a token."""
        self.choice_logprobs, self.reason = logprobs, "stop"
        self.stats.target_forwards += 1

    def commit(self, tokens: list[int], tokenizer: Detokenizer, drafted: int = 0, accepted: int = 0) -> int:
        """Append tokens accepted in one verification step, stopping where plain decoding would.

        `drafted` is the size of the draft tree verified, `accepted` how many of its tokens the
        target kept (tokens[:accepted]; the last token is the target's own). Returns how many
        tokens were kept.
        """
        before = len(self.generated)
        self.generated.extend(tokens)
        n, reason = self.rule.check(self.generated, tokenizer, start=self._checked)
        del self.generated[n:]
        self._checked = n
        self.reason = reason
        kept = n - before
        self.stats.generated_tokens += kept
        self.stats.drafted_tokens += drafted
        self.stats.accepted_tokens += min(accepted, kept)
        self.stats.verify_steps += 1
        self.stats.target_forwards += 1
        return kept


def needs(seqs: list[Sequence], max_nodes: int) -> list[Need]:
    """What each sequence's row of the KV pool must hold: its prompt, and room for its new tokens, a
    draft tree of `max_nodes` and the bonus token."""
    return [Need(len(s.prompt), s.rule.max_new_tokens + max_nodes + 1, s.prompt_key) for s in seqs]


def widest_need(seqs: list[Sequence], max_nodes: int) -> Need | None:
    """The longest prompt and the largest room of `seqs`' needs (None for no sequence): what a row of the
    pool must hold for any of them, with no record made a sequence (a step of a few rows beside
    thousands queued in rounds spent a fifth of its time making them)."""
    if not seqs:
        return None
    return Need(max(len(s.prompt) for s in seqs), max(s.rule.max_new_tokens for s in seqs) + max_nodes + 1)


def admission_room(seqs: list[Sequence], max_nodes: int) -> int:
    """The room the rows of `seqs` are admitted with: the largest of their needs'."""
    widest = widest_need(seqs, max_nodes)
    return 0 if widest is None else widest.room
