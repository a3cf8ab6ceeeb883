"""Values that cross the backend boundary: what is asked, what comes back, what it cost."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

FinishReason = Literal["stop", "length", "eos"]
MAX_TOP_LOGPROBS = 20  # as OpenAI's API bounds top_logprobs


@dataclass(frozen=True)
class Group:
    """Which requests share cross-trajectory draft statistics: the trajectories of one step of one
    problem (a ToT state's n thoughts, a DVTS depth's candidates, a step's evaluations). A drafter's
    pool scope reads it: one pool per group, per problem, or one for the run."""

    problem: str = ""
    step: str = ""


@dataclass(frozen=True)
class GenRequest:
    """One sequence to generate.

    `prompt` is text (the engine applies the chat template when the model has one) or token ids
    (used as they are). `prefix` starts the model's reply (after the chat template's assistant
    header): small chat models follow a format far better when its first words are given; the
    prefix is part of the prompt, not of the returned text. Requests with the same `group` (a
    `Group`) are trajectories of one ToT step and share cross-trajectory draft statistics; `seed` makes a
    sampled request reproducible.
    """

    prompt: str | tuple[int, ...]
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    group: Group = Group()
    seed: int = 0
    prefix: str = ""
    # A follow-up: the finished sequence it continues with a new user turn (a `GenResult.context`);
    # `prompt` is then that turn's message. Its stored keys and values serve the follow-up, so
    # only the new turn is computed (decoding/base/prompts.py renders the seam).
    context: tuple[int, ...] = ()
    # Keep this sequence's keys and values stored when it finishes, pinned until a follow-up of
    # it is admitted (only then evictable): the follow-ups a search sends moments later.
    keep: bool = False
    # Each generated token's log-probability under the request's own sampling distribution (the
    # target's logits after temperature, top-k and top-p; the raw logits' at temperature 0), and the
    # `top_logprobs` most likely tokens at each position with theirs (OpenAI's names and meaning).
    logprobs: bool = False
    top_logprobs: int = 0
    # A choice: nothing is generated; each answer is scored as a continuation of the prompt (after
    # `prefix`) in one forward, its log-probability the sum of its tokens' under the model's own
    # distribution (the softmax of the raw logits): `GenResult.choice_logprobs`, in this order.
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.prompt, list):
            object.__setattr__(self, "prompt", tuple(self.prompt))
        if isinstance(self.context, list):
            object.__setattr__(self, "context", tuple(self.context))
        if self.context and not isinstance(self.prompt, str):
            raise ValueError("a follow-up's prompt is the new turn's message: give it as text")
        for name in ("stop", "choices"):  # a string is one of them; a list, a tuple
            value = getattr(self, name)
            if isinstance(value, (list, str)):
                object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs={self.top_logprobs} must be in 0..{MAX_TOP_LOGPROBS}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True (as OpenAI's API has it)")
        if any(not a for a in self.choices) or len(set(self.choices)) < len(self.choices):
            raise ValueError(f"choices={self.choices!r}: give distinct, non-empty answers")


HOST_STAGES = ("learn", "plan", "draft", "cut", "pack", "launch", "accept", "commit", "finish", "rounds")


@dataclass
class DecodeStats:
    """What producing some tokens cost. Adds up across sequences and calls with `+=`.

    `verify_steps` counts (sequence, target forward) pairs: one per sequence each time the target
    scores it, so acceptance_length = generated_tokens / verify_steps (1.0 for autoregressive).
    `target_forwards` counts calls of the target model (one batched call is one forward).
    `elapsed_s` is the wall-clock time; draft_s + verify_s + other_s exceed it when drafting runs
    beside verification. The scheduler fields (queue waits, draft calls) are SEED's.
    """

    generated_tokens: int = 0
    target_forwards: int = 0
    target_rows: int = 0  # sequences scored, summed over target forwards
    prompt_tokens: int = 0  # prompt tokens of the call's sequences
    prompt_tokens_computed: int = 0  # of them, those the target computed (shared prefixes once, reuse skipped)
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    suffix_accepted_tokens: int = 0  # of them, those the suffix drafter proposed (STAND may have too)
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    elapsed_s: float = 0.0
    queue_wait_s: float = 0.0  # summed over verified drafts: enqueued -> taken by the verifier
    verified_drafts: int = 0  # drafts that went through the verify queue
    draft_calls: int = 0  # batched drafter calls
    drafted_rows: int = 0  # sequences drafted, summed over drafter calls
    # The step planner (verify.plan=goodput): rows and draft nodes it kept for verification, and the
    # verification steps' predicted and measured time (the forward and the work after it).
    planned_rows: int = 0
    planned_nodes: int = 0
    predicted_step_s: float = 0.0
    planned_step_s: float = 0.0
    sequences: int = 0
    sequence_acceptance_sum: float = 0.0  # sum over sequences of each one's acceptance length
    kv_waits: int = 0  # sequences that waited for the KV pool's memory (model.kv_memory) before decoding
    # Verification forwards: committed positions their rows attend (summed over rows), and of them those
    # the CPU attention read from a sibling's row, once for its group (rows admitted with one prefix).
    context_positions: int = 0
    context_positions_shared: int = 0
    # Decode steps and where their time went: admitting sequences (their prefill forwards included),
    # the verification forward, and the host's work around it by stage (HOST_STAGES: what a GPU waits
    # on). admit_s + forward_s + host_s is the steps' wall time, step_s.
    steps: int = 0
    step_s: float = 0.0
    admit_s: float = 0.0
    forward_s: float = 0.0
    host_learn_s: float = 0.0  # the drafter hears arrivals, verdicts and departures
    host_plan_s: float = 0.0  # the planner's draft budgets
    host_draft_s: float = 0.0  # the drafter's call
    host_cut_s: float = 0.0  # trees cut to what the forward verifies
    host_pack_s: float = 0.0  # the forward's tokens, mask and positions
    host_launch_s: float = 0.0  # the forward's call less the forward (indexing, splitting the logits)
    host_accept_s: float = 0.0  # the verification rule's walk of the trees
    host_commit_s: float = 0.0  # tokens to sequences, stop rules, accepted paths to the KV rows
    host_finish_s: float = 0.0  # finished sequences to the prefix store, their rows freed
    host_rounds_s: float = 0.0  # the rounds' queue and phases, the statistics, the pool's trim

    def add_step(self, wall_s: float, forward_s: float, stages: dict[str, float]) -> None:
        """One step's times: its wall time, its verification forward's, and the rest by stage
        ("admit" or one of HOST_STAGES)."""
        self.steps += 1
        self.step_s += wall_s
        self.forward_s += forward_s
        for stage, seconds in stages.items():
            name = "admit_s" if stage == "admit" else f"host_{stage}_s"
            setattr(self, name, getattr(self, name) + seconds)

    @property
    def host_by_stage(self) -> dict[str, float]:
        """Seconds of host work per stage, summed over the steps."""
        return {stage: getattr(self, f"host_{stage}_s") for stage in HOST_STAGES}

    @property
    def host_s(self) -> float:
        return sum(self.host_by_stage.values())

    @property
    def host_ms_per_step(self) -> float:
        """The host's work around a step's forward, admissions aside: what a GPU would wait on."""
        return 1000 * self.host_s / self.steps if self.steps else 0.0

    @property
    def forward_ms_per_step(self) -> float:
        return 1000 * self.forward_s / self.steps if self.steps else 0.0

    def host_summary(self) -> dict[str, float | dict[str, float]]:
        """Milliseconds a decode step: its forward, the host's work around it, and that by stage."""
        per_step = 1000 / self.steps if self.steps else 0.0
        return {
            "steps": self.steps,
            "forward_ms_per_step": self.forward_ms_per_step,
            "host_ms_per_step": self.host_ms_per_step,
            "host_ms_per_step_by_stage": {k: v * per_step for k, v in self.host_by_stage.items()},
        }

    @property
    def wall_s(self) -> float:
        return self.elapsed_s if self.elapsed_s > 0 else self.draft_s + self.verify_s + self.other_s

    @property
    def target_busy_fraction(self) -> float:
        """Share of the wall time the target model spent verifying (prefill included)."""
        return min(1.0, self.verify_s / self.wall_s) if self.wall_s else 0.0

    @property
    def mean_queue_wait_s(self) -> float:
        return self.queue_wait_s / self.verified_drafts if self.verified_drafts else 0.0

    @property
    def drafts_per_round(self) -> float:
        """Sequences drafted together per drafter call."""
        return self.drafted_rows / self.draft_calls if self.draft_calls else 0.0

    @property
    def planned_nodes_per_row(self) -> float:
        """Draft nodes the step planner gave a verified row on average (0: it planned plain decoding)."""
        return self.planned_nodes / self.planned_rows if self.planned_rows else 0.0

    @property
    def mean_sequence_acceptance_length(self) -> float:
        """Acceptance length averaged over sequences (each sequence weighs the same)."""
        return self.sequence_acceptance_sum / self.sequences if self.sequences else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per sequence per verification step, bonus token included."""
        return self.generated_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def rows_per_forward(self) -> float:
        """Sequences a target forward scored on average: how full the batches were."""
        return self.target_rows / self.target_forwards if self.target_forwards else 0.0

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / self.generated_tokens if self.generated_tokens else 0.0

    def __iadd__(self, other: DecodeStats) -> DecodeStats:
        for name in _STAT_FIELDS:
            if value := getattr(other, name):
                setattr(self, name, getattr(self, name) + value)
        return self

    def __sub__(self, other: DecodeStats) -> DecodeStats:
        return DecodeStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    @property
    def context_shared_fraction(self) -> float:
        """Share of the attended context read from a sibling's row instead of the row's own."""
        return self.context_positions_shared / self.context_positions if self.context_positions else 0.0

    def to_dict(self) -> dict[str, float]:
        d: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["wall_s"] = self.wall_s
        d["acceptance_length"] = self.acceptance_length
        d["forwards_per_token"] = self.forwards_per_token
        d["rows_per_forward"] = self.rows_per_forward
        d["target_busy_fraction"] = self.target_busy_fraction
        d["mean_queue_wait_s"] = self.mean_queue_wait_s
        d["drafts_per_round"] = self.drafts_per_round
        d["mean_sequence_acceptance_length"] = self.mean_sequence_acceptance_length
        d["context_shared_fraction"] = self.context_shared_fraction
        d["host_ms_per_step"] = self.host_ms_per_step
        d["forward_ms_per_step"] = self.forward_ms_per_step
        return d

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> DecodeStats:
        return cls(**{f.name: type(f.default)(d.get(f.name, f.default)) for f in fields(cls)})


_STAT_FIELDS = tuple(f.name for f in fields(DecodeStats))  # `+=` runs once a step per call in flight


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, and the most likely tokens at its position with theirs
    (most likely first; `GenRequest.top_logprobs` of them). Tokens are ids, or their text where a
    server's reply names no ids (decoder=server)."""

    token: int | str
    logprob: float
    top: tuple[tuple[int | str, float], ...] = ()

    def to_dict(self) -> dict:
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}


@dataclass
class GenResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: DecodeStats = field(default_factory=DecodeStats)
    # What a follow-up of this reply continues (`GenRequest.context`): the prompt's ids, then the
    # reply's up to where its text ends (decoding/base/prompts.py `reply_ids`).
    context: tuple[int, ...] = ()
    # GenRequest.logprobs: one per token of `token_ids`; None when not asked.
    logprobs: list[TokenLogprob] | None = None
    # GenRequest.choices: each answer's log-probability as a continuation of the prompt; None otherwise.
    choice_logprobs: list[float] | None = None


@dataclass
class Completion:
    """What one `agenerate` call returns: its results, and its cost: its sequences' tokens, and its
    share of every step it was part of (time, forwards, rows, prompt tokens computed), in proportion
    to its live sequences in that step, so that the shares of all calls add up to the engine's cost."""

    results: list[GenResult]
    stats: DecodeStats


def host_line(summary: dict) -> str:
    """A summary's step times in words ("" for one without them: a server, an older run)."""
    if not summary.get("steps"):
        return ""
    return (
        f"{summary['host_ms_per_step']:.2f} ms host work a step around its "
        f"{summary['forward_ms_per_step']:.2f} ms forward"
    )
