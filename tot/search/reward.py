"""A reward model beside the target (`reward.path`): what values states and solutions in place of the
target's own evaluator, for BFS (beam search with a step scorer), DVTS, MCTS and weighted votes.

Three kinds (`reward.kind`):
- `judge`: a causal LM answering the task's evaluator prompt, decoded on an engine of its own (the
  project's, `ar`); its reply is read by the task's `parse_value`, so values keep the task's scale.
- `classifier`: a sequence-classification checkpoint (an outcome reward model) scoring the question and
  the path's steps, each followed by `reward.step_separator`: sigmoid of its one logit, or the second
  label's probability of two (bad, good). Values in [0, 1].
- `consistency`: rStar's mutual consistency: the reward model (a second small model, or the target
  again) is shown the first `reward.hint` share of a path's paragraphs, the rest masked, and completes
  the solution `reward.completions` times through the task's rollout prompt; the path's value is the
  share of completions reaching the path's own answer (a path with no answer yet is completed from all
  its paragraphs, its value the share reaching the completions' most frequent answer). With one
  completion a value is 1 or 0: a weighted vote then counts the consistent solutions alone (rStar's
  filter). Values in [0, 1].
- `prm`: a process reward model read as Math-Shepherd and RLHFlow's PRMs are: a causal LM whose next
  token after each step's separator is `reward.good_label` or `reward.bad_label`; a step's score is
  P(good) / (P(good) + P(bad)) there, and the path's is their `reward.aggregate` (min, last, mean or
  product). Values in [0, 1]. Each step is a choice request (`GenRequest.choices`) on an engine of the
  PRM's own, so the steps of every path valued at once share its forwards and its prefix store.

The question and steps are tokenized piece by piece and joined, so every separator keeps its own
tokens wherever it falls; a separator or label the tokenizer cannot spell is refused at load time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from decoding import BackendError, ConfigError, DecodeStats, GenRequest, ModelSpec

if TYPE_CHECKING:  # torch and the engine load with a reward model, not when a config is checked
    import torch

    from decoding import Engine

Kind = Literal["auto", "judge", "classifier", "prm", "consistency"]
Aggregate = Literal["min", "last", "mean", "product"]
IN_CONTEXT_REFUSED = (
    "reward.path values states with a model of its own, which cannot read the target's stored reply "
    "(task.evaluator=in_context): use task.evaluator=separate with reward.path, or unset reward.path"
)


@dataclass(frozen=True)
class RewardSpec:
    model: ModelSpec  # reward.path, loaded with the target's options (model.device, model.weights...)
    kind: Kind = "auto"
    step_separator: str = "\n\n"
    good_label: str = "+"
    bad_label: str = "-"
    aggregate: Aggregate = "min"
    hint: float = 0.5  # consistency: the share of a path's paragraphs shown (the rest masked)
    completions: int = 1  # consistency: the reward model's completions of each path
    max_tokens: int = 384  # consistency: the longest completion

    @property
    def path(self) -> str:
        return self.model.path

    def __post_init__(self) -> None:
        if not self.step_separator:
            raise ConfigError("reward.step_separator is empty; give the text the reward model ends each step with")
        if self.good_label == self.bad_label:
            raise ConfigError(f"reward.good_label and reward.bad_label are both {self.good_label!r}; give two labels")
        if not 0 <= self.hint < 1:
            raise ConfigError(
                f"reward.hint={self.hint} must be in [0, 1): the share of a path's paragraphs the reward model is "
                "shown before it completes the rest (0: it solves the problem alone)"
            )
        for key in ("completions", "max_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"reward.{key}={getattr(self, key)} must be a positive integer")


@dataclass(frozen=True)
class PathScore:
    value: float
    steps: tuple[float, ...] = ()  # per step (prm)


class ScoringModel:
    """A classifier: `score(question, steps)` runs one forward on the path."""

    def __init__(self, spec: RewardSpec, model: torch.nn.Module, tokenizer: object, device: torch.device) -> None:
        self.spec, self.model, self.tokenizer, self.device = spec, model, tokenizer, device
        self.separator = spell(tokenizer, spec.step_separator, "reward.step_separator", spec.path)

    def score(self, question: str, steps: list[str]) -> PathScore:
        import torch

        ids, _ = path_ids(self.tokenizer, self.separator, question, steps)
        with torch.inference_mode():
            row = self.model(input_ids=torch.tensor([ids], device=self.device)).logits.float()[0]  # (labels,)
            value = torch.sigmoid(row[0]) if row.numel() == 1 else torch.softmax(row, -1)[1]
        return PathScore(float(value))


class ProcessReward:
    """A PRM on an engine of its own: each step's labels after its separator scored as one choice request."""

    def __init__(self, spec: RewardSpec, engine: Engine) -> None:
        self.spec, self.engine = spec, engine
        tokenizer = engine.tokenizer
        self.separator = spell(tokenizer, spec.step_separator, "reward.step_separator", spec.path)
        for key, label in (("reward.good_label", spec.good_label), ("reward.bad_label", spec.bad_label)):
            n = len(spell(tokenizer, label, key, spec.path))
            if n != 1:
                raise ConfigError(
                    f"{key} is {n} tokens in reward.path={spec.path}'s tokenizer; a PRM's label is one token: give "
                    "the label it was trained with"
                )

    async def score(self, question: str, steps: list[str]) -> tuple[PathScore, DecodeStats]:
        """The path's score, and what scoring it cost the PRM's engine."""
        ids, ends = path_ids(self.engine.tokenizer, self.separator, question, steps)
        labels = (self.spec.good_label, self.spec.bad_label)
        done = await self.engine.agenerate([GenRequest(tuple(ids[: e + 1]), choices=labels) for e in ends])
        per_step = []
        for result in done.results:
            good, bad = result.choice_logprobs or (0.0, 0.0)
            per_step.append(1 / (1 + math.exp(bad - good)))  # P(good) / (P(good) + P(bad))
        return PathScore(aggregate(per_step, self.spec.aggregate), tuple(per_step)), done.stats


@dataclass(frozen=True)
class Discriminator:
    """reward.kind=consistency: the reward model's engine, completing paths from their shown paragraphs
    (decoded as the target samples, gen.*, so its completions are draws, not one greedy guess)."""

    spec: RewardSpec
    engine: Engine

    def shown(self, steps: list[str], answered: bool = True) -> list[str]:
        """The paragraphs of the path `steps` the reward model is shown: of a path with an answer, the
        first reward.hint share, rounded down (a best-of-N solution is one step of several paragraphs);
        of one without, all of them (it is completed, nothing of it masked)."""
        every = [p.strip() for step in steps for p in step.split("\n\n") if p.strip()]
        return every[: math.floor(len(every) * self.spec.hint)] if answered else every


def path_ids(tokenizer: object, separator: list[int], question: str, steps: list[str]) -> tuple[list[int], list[int]]:
    """The path's token ids (the question, then each step, each followed by the separator, pieces
    tokenized apart) and, per step, the position of its separator's last token."""
    ids = list(tokenizer.encode(question, add_special_tokens=True))  # type: ignore[attr-defined]
    ids += separator
    ends = []
    for step in steps:
        ids += tokenizer.encode(step, add_special_tokens=False)  # type: ignore[attr-defined]
        ids += separator
        ends.append(len(ids) - 1)
    return ids, ends


def aggregate(scores: list[float], how: str) -> float:
    if how == "min":
        return min(scores)
    if how == "last":
        return scores[-1]
    if how == "mean":
        return sum(scores) / len(scores)
    return math.prod(scores)


def spell(tokenizer: object, text: str, key: str, path: str) -> list[int]:
    """`text`'s token ids; a ConfigError where the tokenizer cannot spell it (its ids decode to
    something else: characters it lacks)."""
    ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    if not ids or tokenizer.decode(ids) != text:  # type: ignore[attr-defined]
        raise ConfigError(
            f"{key}={text!r} is not in reward.path={path}'s tokenizer (it reads back as "
            f"{tokenizer.decode(ids)!r}); give the separator or label the reward model was trained with"  # type: ignore[attr-defined]
        )
    return list(ids)


def resolve_kind(spec: RewardSpec) -> Kind:
    """`auto`: a classifier where the checkpoint's config names a sequence-classification head, else a judge."""
    if spec.kind != "auto":
        return spec.kind
    config = Path(spec.path).expanduser() / "config.json"
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return "judge"  # a GGUF file or a hub id: loaded (and checked) as a causal LM
    return "classifier" if any("ForSequenceClassification" in a for a in architectures) else "judge"


def load_reward(spec: RewardSpec) -> Engine | ScoringModel | ProcessReward | Discriminator:
    """The reward model: an engine of its own for a judge, a PRM or a discriminator, a scoring model on
    the target's device for a classifier."""
    import torch

    from decoding import DecoderConfig, Engine, load_model, resolve_device

    kind = resolve_kind(spec)
    if kind in ("judge", "prm", "consistency"):
        # Decoded autoregressively (a judge's replies are the reward model's own, whatever the target's
        # decoder); a PRM's rows are choices, scored in the forwards of that engine.
        engine = Engine(load_model(spec.model), DecoderConfig(name="ar"))
        if kind == "consistency":
            return Discriminator(spec, engine)
        return engine if kind == "judge" else ProcessReward(replace(spec, kind=kind), engine)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    device = resolve_device(spec.model.device, "reward")
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.path)
        net = AutoModelForSequenceClassification.from_pretrained(spec.path, dtype=torch.float32).to(device).eval()
    except (OSError, ValueError) as e:
        raise BackendError(
            f"reward.path={spec.path!r} could not be loaded as a {kind} ({str(e).splitlines()[0][:160]}); give a "
            "local checkpoint directory of that kind"
        ) from e
    if kind == "classifier" and net.config.num_labels not in (1, 2):
        raise ConfigError(
            f"reward.path={spec.path} has a classification head of {net.config.num_labels} labels; a reward model "
            "scores with one logit or two labels (bad, good)"
        )
    return ScoringModel(replace(spec, kind=kind), net, tokenizer, device)
