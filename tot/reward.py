"""A reward model beside the target (`reward.path`): what values states and solutions in place of the
target's own evaluator, for BFS (beam search with a step scorer), DVTS, MCTS and weighted votes.

Three kinds (`reward.kind`):
- `judge`: a causal LM answering the task's evaluator prompt, decoded on an engine of its own (the
  project's, `ar`); its reply is read by the task's `parse_value`, so values keep the task's scale.
- `classifier`: a sequence-classification checkpoint (an outcome reward model) scoring the question and
  the path's steps, each followed by `reward.step_separator`: sigmoid of its one logit, or the second
  label's probability of two (bad, good). Values in [0, 1].
- `prm`: a process reward model read as Math-Shepherd and RLHFlow's PRMs are: a causal LM whose next
  token after each step's separator is `reward.good_label` or `reward.bad_label`; a step's score is
  P(good) / (P(good) + P(bad)) there, and the path's is their `reward.aggregate` (min, last, mean or
  product). Values in [0, 1].

The question and steps are tokenized piece by piece and joined, so every separator keeps its own
tokens wherever it falls; a separator or label the tokenizer cannot spell is refused at load time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from decoding import BackendError, ConfigError, DecoderConfig, Engine, ModelSpec, load_model, resolve_device

Kind = Literal["auto", "judge", "classifier", "prm"]
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

    @property
    def path(self) -> str:
        return self.model.path

    def __post_init__(self) -> None:
        if not self.step_separator:
            raise ConfigError("reward.step_separator is empty; give the text the reward model ends each step with")
        if self.good_label == self.bad_label:
            raise ConfigError(f"reward.good_label and reward.bad_label are both {self.good_label!r}; give two labels")


@dataclass(frozen=True)
class PathScore:
    value: float
    steps: tuple[float, ...] = ()  # per step (prm)


class ScoringModel:
    """A classifier or PRM: `score(question, steps)` runs one forward on the path."""

    def __init__(self, spec: RewardSpec, model: torch.nn.Module, tokenizer: object, device: torch.device) -> None:
        self.spec, self.model, self.tokenizer, self.device = spec, model, tokenizer, device
        self.separator = spell(tokenizer, spec.step_separator, "reward.step_separator", spec.path)
        self.labels: tuple[int, int] | None = None
        if spec.kind == "prm":
            good = spell(tokenizer, spec.good_label, "reward.good_label", spec.path)
            bad = spell(tokenizer, spec.bad_label, "reward.bad_label", spec.path)
            for key, ids in (("reward.good_label", good), ("reward.bad_label", bad)):
                if len(ids) != 1:
                    raise ConfigError(
                        f"{key} is {len(ids)} tokens in reward.path={spec.path}'s tokenizer; a PRM's label is one "
                        "token: give the label it was trained with"
                    )
            self.labels = (good[0], bad[0])

    def _ids(self, question: str, steps: list[str]) -> tuple[torch.Tensor, list[int]]:
        """The path's token ids and, per step, the position of its separator's last token."""
        ids = list(self.tokenizer.encode(question, add_special_tokens=True))  # type: ignore[attr-defined]
        ids += self.separator
        ends = []
        for step in steps:
            ids += self.tokenizer.encode(step, add_special_tokens=False)  # type: ignore[attr-defined]
            ids += self.separator
            ends.append(len(ids) - 1)
        return torch.tensor([ids], device=self.device), ends

    @torch.inference_mode()
    def score(self, question: str, steps: list[str]) -> PathScore:
        ids, ends = self._ids(question, steps)
        logits = self.model(input_ids=ids).logits.float()
        if self.labels is None:  # a classification head: (1, labels)
            row = logits[0]
            value = torch.sigmoid(row[0]) if row.numel() == 1 else torch.softmax(row, -1)[1]
            return PathScore(float(value))
        good, bad = self.labels
        pair = logits[0, ends][:, [good, bad]]
        per_step = torch.softmax(pair, -1)[:, 0].tolist()
        return PathScore(aggregate(per_step, self.spec.aggregate), tuple(per_step))


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


def resolve_kind(spec: RewardSpec) -> str:
    """`auto`: a classifier where the checkpoint's config names a sequence-classification head, else a judge."""
    if spec.kind != "auto":
        return spec.kind
    config = Path(spec.path).expanduser() / "config.json"
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return "judge"  # a GGUF file or a hub id: loaded (and checked) as a causal LM
    return "classifier" if any("ForSequenceClassification" in a for a in architectures) else "judge"


def load_reward(spec: RewardSpec) -> Engine | ScoringModel:
    """The reward model: an engine of its own for a judge, a scoring model on the target's device otherwise."""
    kind = resolve_kind(spec)
    if kind == "judge":
        # A judge decodes autoregressively: its replies are the reward model's own, whatever the target's decoder.
        return Engine(load_model(spec.model), DecoderConfig(name="ar"))
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    device = resolve_device(spec.model.device, "reward")
    loader = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.path)
        net = loader.from_pretrained(spec.path, dtype=torch.float32).to(device).eval()
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
