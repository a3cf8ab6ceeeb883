"""Values that cross the backend boundary: what is asked, what comes back, what it cost."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from decoding.base.errors import ConfigError

FinishReason = Literal["stop", "length", "eos"]
MAX_TOP_LOGPROBS = 20  # as OpenAI's API bounds top_logprobs


@dataclass(frozen=True)
class Group:
    """Which requests share cross-trajectory draft statistics: the trajectories of one step of one
    problem (a ToT state's n thoughts, a DVTS depth's candidates, a step's evaluations). A drafter's
    pool scope reads it: one pool per group, per problem, or one for the run."""

    problem: str = ""
    step: str = ""

    def __post_init__(self) -> None:
        for name in ("problem", "step"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Group.{name}={getattr(self, name)!r} must be text (a str)")


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
        """Every field checked for its type, finiteness and range, each as it is read (a list of ids
        or of strings becomes a tuple, a numpy integer an int): a `TypeError` or `ValueError` naming the
        field and the fix. What needs the model (ids against its vocabulary, lengths against its
        context) the engine checks as it tokenizes (`check_ids`, `Engine`)."""
        if not isinstance(self.prompt, str):
            if not isinstance(self.prompt, (list, tuple, range)):
                raise TypeError(
                    f"prompt is a {type(self.prompt).__name__}: give text (a str) or token ids (a list of ints)"
                )
            self._set("prompt", token_ids("prompt", self.prompt))
        self._set("context", token_ids("context", self.context))
        if self.context and not isinstance(self.prompt, str):
            raise ValueError("a follow-up's prompt is the new turn's message: give it as text")
        for name in ("stop", "choices"):  # a string is one of them; a list, a tuple
            self._set(name, texts(name, getattr(self, name)))
        if any(not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} holds an empty string, which would stop at once; leave it out")
        self._set("max_new_tokens", integer("max_new_tokens", self.max_new_tokens, 1))
        self._set("temperature", real("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={self.temperature} is too small to sample with (logits / temperature overflow): use 0 "
                f"for greedy decoding or at least {MIN_TEMPERATURE}"
            )
        self._set("top_p", real("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        self._set("top_k", integer("top_k", self.top_k, 0, fix="0 disables top-k"))
        self._set("seed", integer("seed", self.seed, 0, MAX_SEED))
        if not isinstance(self.group, Group):
            raise TypeError(f"group={self.group!r} must be a Group (decoding.base.values.Group(problem, step))")
        if not isinstance(self.prefix, str):
            raise TypeError(f"prefix={self.prefix!r} must be text (a str): the start of the model's reply")
        for name in ("keep", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False")
        self._set("top_logprobs", integer("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS))
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True (as OpenAI's API has it)")
        if any(not a for a in self.choices) or len(set(self.choices)) < len(self.choices):
            raise ValueError(f"choices={self.choices!r}: give distinct, non-empty answers")

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)


def _as_type_of(default: Any, value: Any) -> Any:
    """`value` read as its field's default's type (a saved summary's numbers as the record's)."""
    return type(default)(value)


MIN_TEMPERATURE = 1e-4  # below it (and above 0) logits / temperature overflow float32
MAX_SEED = 2**63 - 1  # a torch generator's seed, and the draft generator's (seed ^ a salt)


def integer(name: str, value: object, low: int, high: int | None = None, fix: str = "") -> int:
    """`value` as an int in [low, high]: a TypeError for anything but an integer (a bool included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an integer, not a {type(value).__name__}")
    value = int(value)  # numpy's integers as Python's
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name}={value} must be {span}" + (f" ({fix})" if fix else ""))
    return value


def real(name: str, value: object) -> float:
    """`value` as a finite float: a TypeError for anything but a number, a ValueError for NaN or inf."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number, not a {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range
        raise ValueError(f"{name}={value} is too large to be a float; give a finite number") from None
    if not math.isfinite(number):
        raise ValueError(f"{name}={value} must be a finite number")
    return number


def token_ids(name: str, ids: object) -> tuple[int, ...]:
    """A list or tuple of token ids as a tuple of non-negative ints; each checked against the
    model's vocabulary by `check_ids` when the engine tokenizes."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, range)):
        raise TypeError(f"{name} must be a list of token ids (ints), not a {type(ids).__name__}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}[{i}]={t!r} is not a token id (an int)")
        if t < 0:
            raise ValueError(f"{name}[{i}]={t} is a negative token id")
        out.append(int(t))
    return tuple(out)


def check_ids(name: str, ids: tuple[int, ...], vocab: int) -> None:
    """Token ids given by a caller are ids of the model's vocabulary (its embedding's `vocab` rows)."""
    bad = next((i for i, t in enumerate(ids) if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"{name}[{bad}]={ids[bad]} is outside the model's vocabulary of {vocab} tokens")


def texts(name: str, value: object) -> tuple[str, ...]:
    """One string or a list / tuple of strings, as a tuple of strings."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a string or a list of strings, not a {type(value).__name__}")
    bad = next((i for i, v in enumerate(value) if not isinstance(v, str)), None)
    if bad is not None:
        raise TypeError(f"{name}={value!r} holds {value[bad]!r}, which is not text: give strings")
    return tuple(value)


def check_sampling(settings: dict[str, tuple[str, object]]) -> None:
    """A command's sampling settings ({config key: (GenRequest field, value)}) checked at load by the
    request's own rules, each error naming the key: a ConfigError (one line, exit 2) rather than a
    request refused after the model has loaded."""
    for key, (name, value) in settings.items():
        try:
            GenRequest("x", **{name: value})  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{key}{str(e).removeprefix(name)}") from None


def request_list(call: str, requests: object) -> list[GenRequest]:
    """`requests` as a list of GenRequest, or a TypeError saying what `call` takes."""
    if isinstance(requests, (GenRequest, str)) or not isinstance(requests, (list, tuple)):
        raise TypeError(
            f"{call} takes a list of GenRequest, not a {type(requests).__name__}: wrap one request in a list, "
            f"{call}([GenRequest(prompt)])"
        )
    bad = next((i for i, r in enumerate(requests) if not isinstance(r, GenRequest)), None)
    if bad is not None:
        raise TypeError(
            f"{call}: requests[{bad}] is a {type(requests[bad]).__name__}, not a GenRequest: give "
            "GenRequest(prompt, ...)"
        )
    return list(requests)


def add_counts(into: object, other: object, names: tuple[str, ...]) -> None:
    """`other`'s numbers added into `into`'s, field by field (a zero skipped: `+=` runs once a step per call
    in flight)."""
    for name in names:
        if value := getattr(other, name):
            setattr(into, name, getattr(into, name) + value)


HOST_STAGES = ("learn", "plan", "draft", "cut", "pack", "launch", "accept", "commit", "finish", "rounds")


@dataclass
class ScheduleStats:
    """The scheduler's own counters, beside what the tokens cost (`DecodeStats.schedule`): SEED's verify
    queue, the drafter's calls, the step planner's plans, the CPU attention's shared reads and the decode
    steps' time by stage. Adds up with `+=`; its `to_dict` keys sit beside DecodeStats' in a summary."""

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
    # Verification forwards: committed positions their rows attend (summed over rows), and of them those
    # the CPU attention read from a sibling's row, once for its siblings (rows admitted with one prefix).
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
    def context_shared_fraction(self) -> float:
        """Share of the attended context read from a sibling's row instead of the row's own."""
        return self.context_positions_shared / self.context_positions if self.context_positions else 0.0

    def __iadd__(self, other: ScheduleStats) -> ScheduleStats:
        add_counts(self, other, _SCHEDULE_FIELDS)
        return self

    def __sub__(self, other: ScheduleStats) -> ScheduleStats:
        return ScheduleStats(**{name: getattr(self, name) - getattr(other, name) for name in _SCHEDULE_FIELDS})

    def to_dict(self) -> dict[str, float]:
        d: dict[str, float] = {name: getattr(self, name) for name in _SCHEDULE_FIELDS}
        d["mean_queue_wait_s"] = self.mean_queue_wait_s
        d["drafts_per_round"] = self.drafts_per_round
        d["context_shared_fraction"] = self.context_shared_fraction
        d["host_ms_per_step"] = self.host_ms_per_step
        d["forward_ms_per_step"] = self.forward_ms_per_step
        return d

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> ScheduleStats:
        return cls(**{f.name: _as_type_of(f.default, d.get(f.name, f.default)) for f in fields(cls)})


_SCHEDULE_FIELDS = tuple(f.name for f in fields(ScheduleStats))


@dataclass
class DecodeStats:
    """What producing some tokens cost. Adds up across sequences and calls with `+=`.

    `verify_steps` counts (sequence, target forward) pairs: one per sequence each time the target
    scores it, so acceptance_length = generated_tokens / verify_steps (1.0 for autoregressive).
    `target_forwards` counts calls of the target model (one batched call is one forward).
    `elapsed_s` is the wall-clock time; draft_s + verify_s + other_s exceed it when drafting runs
    beside verification. The scheduler's own counters (its queue, the drafter's calls, the planner,
    the steps' host work by stage) are `schedule`'s.
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
    sequences: int = 0
    sequence_acceptance_sum: float = 0.0  # sum over sequences of each one's acceptance length
    kv_waits: int = 0  # sequences that waited for the KV pool's memory (model.kv_memory) before decoding
    schedule: ScheduleStats = field(default_factory=ScheduleStats)

    @property
    def wall_s(self) -> float:
        return self.elapsed_s if self.elapsed_s > 0 else self.draft_s + self.verify_s + self.other_s

    @property
    def target_busy_fraction(self) -> float:
        """Share of the wall time the target model spent verifying (prefill included)."""
        return min(1.0, self.verify_s / self.wall_s) if self.wall_s else 0.0

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
        add_counts(self, other, _STAT_FIELDS)
        self.schedule += other.schedule
        return self

    def __sub__(self, other: DecodeStats) -> DecodeStats:
        return DecodeStats(
            **{name: getattr(self, name) - getattr(other, name) for name in _STAT_FIELDS},
            schedule=self.schedule - other.schedule,
        )

    def to_dict(self) -> dict[str, float]:
        """Its counts and rates and `schedule`'s, in one flat record (a run's summary, results.json)."""
        d: dict[str, float] = {name: getattr(self, name) for name in _STAT_FIELDS}
        d["wall_s"] = self.wall_s
        d["acceptance_length"] = self.acceptance_length
        d["forwards_per_token"] = self.forwards_per_token
        d["rows_per_forward"] = self.rows_per_forward
        d["target_busy_fraction"] = self.target_busy_fraction
        d["mean_sequence_acceptance_length"] = self.mean_sequence_acceptance_length
        return {**d, **self.schedule.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> DecodeStats:
        counts = {
            name: _as_type_of(f.default, d.get(name, f.default))
            for f in fields(cls)
            if (name := f.name) in _STAT_FIELDS
        }
        return cls(**counts, schedule=ScheduleStats.from_dict(d))


_STAT_FIELDS = tuple(f.name for f in fields(DecodeStats) if f.name != "schedule")


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, and the most likely tokens at its position with theirs
    (most likely first; `GenRequest.top_logprobs` of them). Tokens are ids, or their text where a
    server's reply names no ids (decoder=server)."""

    token: int | str
    logprob: float
    top: tuple[tuple[int | str, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
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


def host_line(summary: dict[str, Any]) -> str:
    """A summary's step times in words ("" for one without them: a server, an older run)."""
    if not summary.get("steps"):
        return ""
    return (
        f"{summary['host_ms_per_step']:.2f} ms host work a step around its "
        f"{summary['forward_ms_per_step']:.2f} ms forward"
    )
