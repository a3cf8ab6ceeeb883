"""`python -m tuning.train_edd`: train the EDD draft decoder of a target model (Hydra, conf/train_edd.yaml).

1. Corpus: ToT-BFS rollouts (n thoughts per state, the best kept) of the tasks' problems, decoded by the
   target itself with the project's Engine (decoder ar); every prompt plus its continuation is one
   text. Written per chunk of problems to <work_dir>/corpus-<hash>.jsonl, so a rerun reuses it.
2-4. Features, training and saving: decoding/edd/train.py. The trained EDD goes to
   <model cache>/edd/<model.path>/ (or `out`), where draft.path=edd finds it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from decoding.api.engine import Engine
from decoding.base.cli import fail, hydra_command
from decoding.base.errors import BackendError, ConfigError
from decoding.base.options import as_float, as_int, from_dict
from decoding.base.values import GenRequest, check_sampling
from decoding.edd.model import edd_dir, vocab_ranking
from decoding.edd.train import TrainSettings, build_features, train
from decoding.runtime.models import ModelSpec, load_model
from decoding.runtime.runner import decoder_layers
from tasks import TASKS, DataError, DataSpec, Problem, Task, make_task

log = logging.getLogger(__name__)
# Per-source keys that are not options of the task object itself.
SOURCE_KEYS = ("path", "offset", "limit", "depth", "max_thought_tokens", "max_eval_tokens")


@dataclass(frozen=True)
class Source:
    """The problems of one task whose rollouts go into the corpus."""

    task: str
    depth: int
    data: DataSpec
    max_thought_tokens: int
    max_eval_tokens: int
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSpec
    sources: tuple[Source, ...]
    n_thoughts: int
    temperature: float
    problems_per_call: int
    corpus_seed: int
    layer: int
    init_layer: int | None
    train: TrainSettings
    out: Path
    work_dir: Path

    @classmethod
    def from_omegaconf(cls, cfg: DictConfig) -> TrainConfig:
        c = OmegaConf.to_container(cfg, resolve=True)
        model = ModelSpec.from_config(c["model"])
        corpus = c["corpus"]
        tasks = corpus.get("tasks") or []
        if not isinstance(tasks, list) or not tasks:
            raise ConfigError(f"corpus.tasks={tasks!r} must list tasks, e.g. [gsm8k,creative_writing,blocksworld]")
        sources = []
        for name in tasks:
            if name not in TASKS:
                raise ConfigError(f"corpus.tasks: {name!r} is not one of {', '.join(TASKS)}")
            s = corpus.get(name) or {}
            limit = s.get("limit")
            sources.append(
                Source(
                    task=name,
                    depth=as_int(f"corpus.{name}.depth", s.get("depth", TASKS[name].build().depth)),
                    data=DataSpec(
                        path=s.get("path"),
                        limit=None if limit is None else as_int(f"corpus.{name}.limit", limit),
                        offset=as_int(f"corpus.{name}.offset", s.get("offset", 0)),
                    ),
                    max_thought_tokens=as_int(f"corpus.{name}.max_thought_tokens", s.get("max_thought_tokens", 128)),
                    max_eval_tokens=as_int(f"corpus.{name}.max_eval_tokens", s.get("max_eval_tokens", 64)),
                    options={k: v for k, v in s.items() if k not in SOURCE_KEYS},
                )
            )
        train = from_dict(TrainSettings, c["train"], "train")
        edd = c["edd"]
        layer = as_int("edd.layer", edd["layer"])
        init_layer = None if edd.get("init_layer") is None else as_int("edd.init_layer", edd["init_layer"])
        out = Path(str(c["out"])).expanduser() if c.get("out") else edd_dir(model.path, model.cache_dir or None)
        work = Path(str(c["work_dir"])).expanduser() if c.get("work_dir") else out.with_name(out.name + ".work")
        n_thoughts = as_int("corpus.n_thoughts", corpus["n_thoughts"])
        per_call = as_int("corpus.problems_per_call", corpus["problems_per_call"])
        temperature = as_float("corpus.temperature", corpus["temperature"])
        if n_thoughts < 1 or per_call < 1:
            raise ConfigError("corpus.n_thoughts and corpus.problems_per_call must be positive integers")
        check_sampling({"corpus.temperature": ("temperature", temperature)})  # the request's own rule
        return cls(
            model=model,
            sources=tuple(sources),
            n_thoughts=n_thoughts,
            temperature=temperature,
            problems_per_call=per_call,
            corpus_seed=as_int("corpus.seed", corpus["seed"]),
            layer=layer,
            init_layer=init_layer,
            train=train,
            out=out,
            work_dir=work,
        )

    def corpus_key(self) -> str:
        parts = [self.model.path, self.sources, self.n_thoughts, self.temperature, self.corpus_seed]
        return _digest(parts)

    def features_key(self) -> str:
        return _digest([self.corpus_key(), self.train.seq_len, self.layer])

    def run_key(self) -> str:
        return _digest([self.features_key(), self.init_layer, asdict(self.train)])


def _digest(parts: object) -> str:
    return hashlib.sha1(json.dumps(parts, default=str, sort_keys=True).encode()).hexdigest()[:10]


# --- 1. corpus ----------------------------------------------------------------------------------


def build_corpus(cfg: TrainConfig, engine: Engine, progress: bool = True) -> list[dict]:
    """Every rollout text of every source; chunks already in the corpus file are not decoded again."""
    path = cfg.work_dir / f"corpus-{cfg.corpus_key()}.jsonl"
    docs, done = _read_corpus(path)
    plan = []
    for source in cfg.sources:
        task = make_task(source.task, source.depth, source.options)
        problems = task.load(source.data)
        for start in range(0, len(problems), cfg.problems_per_call):
            chunk = f"{source.task}/{start}"
            if chunk not in done:
                plan.append((source, task, chunk, problems[start : start + cfg.problems_per_call]))
    path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(plan, desc="corpus", unit="chunk", disable=not progress)
    for source, task, chunk, problems in bar:
        new = [{"chunk": chunk, **d} for d in rollout(task, source, problems, engine, cfg)]
        with path.open("a", encoding="utf-8") as f:
            for d in new:
                f.write(json.dumps(d) + "\n")
        docs += new
        bar.set_postfix(texts=len(docs), tokens=sum(len(d["ids"]) for d in docs))
    return docs


def _read_corpus(path: Path) -> tuple[list[dict], set[str]]:
    """The texts of completed chunks (a chunk is written in one go; a line cut by a kill is dropped)."""
    if not path.exists():
        return [], set()
    docs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            docs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    ends = {d["chunk"] for d in docs if d.get("last")}
    docs = [d for d in docs if d["chunk"] in ends]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return docs, ends


def rollout(task: Task, source: Source, problems: list[Problem], engine: Engine, cfg: TrainConfig) -> list[dict]:
    """ToT-BFS with breadth 1 over several problems in lockstep (every problem's requests of a step in
    one engine call): n thoughts per state, each valued by the evaluator, the best one kept."""
    docs: list[dict] = []
    paths: dict[str, list[str]] = {p.id: [] for p in problems}
    live = list(problems)
    while live:
        requests, owners = [], []
        for p in live:
            prompt = task.generator_prompt(p, paths[p.id])
            for j in range(cfg.n_thoughts):
                seed = _seed(cfg, p, [*paths[p.id], j])
                requests.append(_request(prompt, source.max_thought_tokens, cfg.temperature, seed))
                owners.append(p)
        outs = _generate(engine, requests, docs, [f"{p.id}/gen" for p in owners])
        children = [paths[p.id] + [task.parse_thought(p, paths[p.id], o.text)] for p, o in zip(owners, outs)]
        evals = [
            _request(task.evaluator_prompt(p, steps), source.max_eval_tokens, cfg.temperature, _seed(cfg, p, steps))
            for p, steps in zip(owners, children)
        ]
        values = [task.parse_value(o.text) for o in _generate(engine, evals, docs, [f"{p.id}/eval" for p in owners])]
        for p in live:
            mine = [(v, s) for q, v, s in zip(owners, values, children) if q is p]
            paths[p.id] = max(mine, key=lambda vs: vs[0])[1]  # the first of the best, as BFS keeps it
        live = [p for p in live if len(paths[p.id]) < task.depth and not task.is_terminal(p, paths[p.id])]
    if docs:
        docs[-1]["last"] = True
    return docs


def _seed(cfg: TrainConfig, problem: Problem, where: list) -> int:
    return zlib.crc32(json.dumps([cfg.corpus_seed, problem.id, where]).encode())


def _request(prompt: object, max_new_tokens: int, temperature: float, seed: int) -> GenRequest:
    return GenRequest(
        prompt.text,  # type: ignore[attr-defined]
        prefix=prompt.prefix,  # type: ignore[attr-defined]
        stop=prompt.stop,  # type: ignore[attr-defined]
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
    )


def _generate(engine: Engine, requests: list[GenRequest], docs: list[dict], names: list[str]) -> list:
    outs = engine.generate(requests)
    for r, o, name in zip(requests, outs, names):
        prompt = engine.encode(r.prompt, r.prefix)
        docs.append({"id": name, "prompt_len": len(prompt), "ids": prompt + list(o.token_ids)})
    return outs


def run(cfg: TrainConfig, progress: bool = True) -> dict:
    t0 = time.perf_counter()
    target = load_model(cfg.model)
    for p in target.model.parameters():
        p.requires_grad_(False)
    n_layers = len(decoder_layers(target.model))
    if not -n_layers <= cfg.layer < n_layers:
        raise ConfigError(
            f"edd.layer={cfg.layer} is outside the target's {n_layers} layers (-{n_layers}..{n_layers - 1})"
        )
    docs = build_corpus(cfg, Engine(target, "ar"), progress)
    tqdm.write(
        f"corpus: {len(docs)} texts, {sum(len(d['ids']) for d in docs)} tokens "
        f"({sum(len(d['ids']) - d['prompt_len'] for d in docs)} generated)"
    )
    examples = build_features(cfg, target, docs, progress)
    vocab_size = int(target.model.get_output_embeddings().weight.shape[0])
    summary = train(cfg, target, examples, progress, vocab_ranking([d["ids"] for d in docs], vocab_size))
    summary["total_s"] = time.perf_counter() - t0
    return summary


@hydra_command("train_edd", groups=("model",))
def main(cfg: DictConfig) -> None:
    try:
        tcfg = TrainConfig.from_omegaconf(cfg)
        summary = run(tcfg)
    except (ConfigError, BackendError, DataError) as e:
        fail(str(e).splitlines()[0])
    first, last = summary["heldout_kl_first"], summary["heldout_kl"]
    print(
        f"EDD for {tcfg.model.path}: {summary['steps']} steps on {summary['train_texts']} texts "
        f"({summary['train_tokens']} tokens), held-out KL {first:.4f} -> {last:.4f}, "
        f"top-1 agreement {summary['heldout_top1']:.3f}; saved to {tcfg.out}"
    )


if __name__ == "__main__":
    main()
