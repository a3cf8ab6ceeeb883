"""The run configuration, checked once at load time with messages that say what to change."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from decoding import (
    FOLLOW_UPS_REFUSED,
    ConfigError,
    DecoderConfig,
    ModelSpec,
    as_float,
    as_int,
    check_sampling,
    from_dict,
    unknown,
)
from tasks import TASKS, DataSpec
from tasks.base import Completes
from tot.search import SEARCHES
from tot.search.base import GenSettings
from tot.search.best_of_n import BestOfNSettings
from tot.search.reward import IN_CONTEXT_REFUSED, RewardSpec
from tot.search.vote import PLAIN_VOTE, VoteRule

# Keys of `task:` that are not options of the task object itself.
TASK_RUN_KEYS = ("name", "depth", "judge", "temperature", "max_thought_tokens", "max_eval_tokens")

__all__ = ["ConfigError", "RunConfig"]


@dataclass(frozen=True)
class RunConfig:
    task: str
    depth: int | None  # None: the task's own default
    search: str
    search_settings: Any  # the search's settings (its plug-in's options), read from `search.*`
    decoder: DecoderConfig
    model: ModelSpec
    data: DataSpec
    gen: GenSettings
    seed: int
    task_options: dict[str, Any] = field(default_factory=dict)  # task.<key> options of the task itself
    judge: ModelSpec | None = None  # task.judge.path: a separate model scores final answers
    concurrency: int = 1  # run.concurrency: problems searched at once over the one engine
    reward: RewardSpec | None = None  # reward.path: a reward model values states in place of the evaluator
    vote: VoteRule = PLAIN_VOTE  # vote.*: what a ballot of the problem's vote weighs, which ones count
    # The resolved config this was read from (hydra's own keys left out): what a run folder records
    # as its configuration (tot/runs/folder.py). A copy made with dataclasses.replace keeps the old one.
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise unknown("task", self.task, TASKS)
        if self.search not in SEARCHES:
            raise unknown("search", self.search, SEARCHES)
        options = SEARCHES[self.search].options
        if options is None or not isinstance(self.search_settings, options):
            raise ConfigError(
                f"search={self.search} takes {SEARCHES[self.search].options}, not {self.search_settings!r}"
            )
        if self.depth is not None:
            _positive("task.depth", self.depth)
        _positive("run.concurrency", self.concurrency)
        if self.decoder.server is not None and self.task_options.get("evaluator") == "in_context":
            raise ConfigError(FOLLOW_UPS_REFUSED)
        if self.reward is not None and self.task_options.get("evaluator") == "in_context":
            raise ConfigError(IN_CONTEXT_REFUSED)
        completes = self.reward is not None and self.reward.kind == "consistency"
        build = TASKS[self.task].build
        if completes and not (isinstance(build, type) and issubclass(build, Completes)):
            raise ConfigError(
                f"reward.kind=consistency completes a path through the task's rollout prompt, which task={self.task} "
                "has not: use another reward.kind, or a task with rollouts (gsm8k)"
            )
        unread = isinstance(self.search_settings, BestOfNSettings) and not self.search_settings.scored
        if self.reward is not None and unread:
            raise ConfigError(
                "reward.path values solutions, which best-of-N's search.aggregate=majority never reads (GSM8K's "
                "default search is that vote): give search.aggregate=weighted or best, or search=bfs (or dvts, mcts)"
            )
        if completes and self.search == "best_of_n" and self.task_options.get("solutions") == "mixed":
            raise ConfigError(
                "reward.kind=consistency completes a written solution's masked tail, and task.solutions=mixed writes "
                "every other one as a function: give task.solutions=same"
            )
        _positive("gen.max_thought_tokens", self.gen.max_thought_tokens)
        _positive("gen.max_eval_tokens", self.gen.max_eval_tokens)
        check_sampling(
            {
                "gen.temperature": ("temperature", self.gen.temperature),
                "gen.eval_temperature": ("temperature", self.gen.eval_temperature),
                "gen.top_p": ("top_p", self.gen.top_p),
                "gen.top_k": ("top_k", self.gen.top_k),
            }
        )
        SEARCHES[self.search].check_config(self.search_settings, self.vote, self.task_options)

    @classmethod
    def from_omegaconf(cls, cfg: DictConfig) -> RunConfig:
        try:
            c = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's is a dict
            c.pop("hydra", None)
            data = c["data"]
            return cls(
                task=c["task"]["name"],
                depth=None if c["task"].get("depth") is None else as_int("task.depth", c["task"]["depth"]),
                search=c["search"]["name"],
                search_settings=_search_settings(c["search"]),
                model=ModelSpec.from_config(c["model"]),  # before the decoder's, which loads the drafters (torch)
                decoder=DecoderConfig.from_container(c),
                data=DataSpec(
                    path=data.get("path"),
                    limit=None if data.get("limit") is None else as_int("data.limit", data["limit"]),
                    offset=as_int("data.offset", data.get("offset", 0)),
                    shard=as_int("data.shard", data.get("shard", 0)),
                    num_shards=as_int("data.num_shards", data.get("num_shards", 1)),
                ),
                gen=GenSettings(
                    temperature=as_float("gen.temperature", c["gen"]["temperature"]),
                    top_p=as_float("gen.top_p", c["gen"]["top_p"]),
                    top_k=as_int("gen.top_k", c["gen"]["top_k"]),
                    max_thought_tokens=as_int("gen.max_thought_tokens", c["gen"]["max_thought_tokens"]),
                    max_eval_tokens=as_int("gen.max_eval_tokens", c["gen"]["max_eval_tokens"]),
                    eval_temperature=as_float("gen.eval_temperature", c["gen"]["eval_temperature"]),
                ),
                seed=as_int("gen.seed", c["gen"]["seed"]),
                task_options={k: v for k, v in c["task"].items() if k not in TASK_RUN_KEYS},
                judge=_judge(c),
                concurrency=as_int("run.concurrency", c["run"]["concurrency"]),
                reward=_reward(c),
                vote=from_dict(VoteRule, c.get("vote"), "vote"),
                source=c,
            )
        except KeyError as e:
            raise ConfigError(f"config key {e} is missing; start from conf/config.yaml") from None


def _search_settings(search: dict[str, Any]) -> Any:
    """The chosen search's settings, read from `search.*`."""
    name = search["name"]
    if name not in SEARCHES:
        raise unknown("search", name, SEARCHES)
    return SEARCHES[name].settings(search, "search")


def _reward(c: dict[str, Any]) -> RewardSpec | None:
    """reward.path's model, loaded like the target (model.device, model.weights...), and how to read it."""
    options = dict(c.get("reward") or {})
    path = options.pop("path", None)
    if not path:
        return None
    model = ModelSpec.from_config({**c["model"], "path": str(path)}, "reward")
    return from_dict(RewardSpec, {**options, "model": model}, "reward")


def _judge(c: dict[str, Any]) -> ModelSpec | None:
    """The judge model: task.judge.path, loaded like the target (model.device, model.weights...)."""
    path = (c["task"].get("judge") or {}).get("path")
    if not path:
        return None
    return ModelSpec.from_config({**c["model"], "path": str(path)}, "task.judge")


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{key}={value} must be a positive integer")
