"""`python -m decoding.train_edd`: train the EDD draft decoder of a target model (Hydra, conf/train_edd.yaml).

1. Corpus: ToT-BFS rollouts (n thoughts per state, the best kept) of the tasks' problems, decoded by the
   target itself with the project's Engine (decoder ar); every prompt plus its continuation is one
   text. Written per chunk of problems to <work_dir>/corpus-<hash>.jsonl, so a rerun reuses it.
2. Features: for each text (its last `train.seq_len` tokens) the target's hidden states after layer
   `edd.layer` (the soft prompt) and its final hidden states (the LM head of which gives the target's
   distribution, for the KL), cached to <work_dir>/features-<hash>.pt.
3. Training (paper section 3.1): the EDD reads [H; T] under the dual-block mask with a block length
   drawn uniformly from [train.min_block, train.max_block] each step, and minimises KL(P_target ||
   P_edd) at every token; AdamW, warmup then cosine decay; a held-out split of the problems gives the
   held-out KL (and top-1 agreement with the target) every `train.eval_every` steps; a checkpoint
   every `train.checkpoint_every` steps, resumed on a rerun.
4. The trained EDD goes to <model cache>/edd/<model.path>/ (or `out`), where draft.path=edd finds it,
   with the corpus's tokens ranked by frequency (draft.vocab drafts over the most frequent ones).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from decoding.cli import check_overrides, fail, quiet_transformers
from decoding.config import as_float, as_int
from decoding.edd import EddConfig, EddModel, dual_block_mask, edd_dir, kl_to_target, save_edd, vocab_ranking
from decoding.engine import Engine
from decoding.errors import BackendError, ConfigError
from decoding.models import LoadedModel, ModelSpec, load_model
from decoding.target import decoder_layers
from decoding.types import GenRequest
from tasks import TASKS, DataError, DataSpec, Problem, Task, make_task

log = logging.getLogger(__name__)
DISTINCT_TAIL = 32  # texts whose windows agree but for the last this many tokens are kept once
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
class TrainSettings:
    seq_len: int = 128
    batch_size: int = 4
    steps: int = 250
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup: int = 20
    min_block: int = 2
    max_block: int = 8
    eval_block: int = 4
    eval_every: int = 50
    checkpoint_every: int = 50
    heldout: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("seq_len", "batch_size", "steps", "min_block", "max_block", "eval_block", "eval_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be a positive integer")
        if self.checkpoint_every < 1:
            raise ConfigError(f"train.checkpoint_every={self.checkpoint_every} must be a positive integer")
        if self.min_block > self.max_block:
            raise ConfigError(
                f"train.min_block={self.min_block} exceeds train.max_block={self.max_block}; block lengths "
                "are drawn from [min_block, max_block]"
            )
        if self.lr <= 0:
            raise ConfigError(f"train.lr={self.lr} must be positive")
        if not 0 < self.heldout < 1:
            raise ConfigError(f"train.heldout={self.heldout} must be a fraction in (0, 1) of the problems")


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
        model = ModelSpec(**{k: str(v) for k, v in c["model"].items() if k != "name" and v is not None})
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
                    depth=as_int(f"corpus.{name}.depth", s.get("depth", TASKS[name]().depth)),
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
        t = c["train"]
        defaults = TrainSettings()
        ints = ("seq_len", "batch_size", "steps", "warmup", "min_block", "max_block", "eval_block", "eval_every")
        ints += ("checkpoint_every", "seed")
        known = {f for f in asdict(defaults)}
        for key in t:
            if key not in known:
                raise ConfigError(f"train.{key} is not a training option; see conf/train_edd.yaml")
        train = TrainSettings(
            **{k: as_int(f"train.{k}", t[k]) for k in ints if k in t},
            **{k: as_float(f"train.{k}", t[k]) for k in ("lr", "weight_decay", "heldout") if k in t},
        )
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
        if temperature < 0:
            raise ConfigError(f"corpus.temperature={temperature} is negative; use 0 for greedy decoding")
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


# --- 2. features --------------------------------------------------------------------------------


@dataclass
class Example:
    group: str  # the problem it came from (the held-out split is by problem)
    ids: torch.Tensor  # [n]
    hidden: torch.Tensor  # [n, H] the soft prompt (float16)
    final: torch.Tensor  # [n, H] the target's final hidden states, before its LM head (float16)


@torch.inference_mode()
def target_features(model: torch.nn.Module, layer: int, ids: list[list[int]]) -> list[tuple[torch.Tensor, ...]]:
    """(hidden after `layer`, final normed hidden) of each token sequence, batched with right padding."""
    device = next(model.parameters()).device
    width = max(len(x) for x in ids)
    tokens = torch.zeros(len(ids), width, dtype=torch.long)
    attention = torch.zeros(len(ids), width, dtype=torch.long)
    for b, x in enumerate(ids):
        tokens[b, : len(x)] = torch.tensor(x)
        attention[b, : len(x)] = 1
    captured = []
    hook = decoder_layers(model)[layer].register_forward_hook(
        lambda m, a, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        final = model.get_decoder()(input_ids=tokens.to(device), attention_mask=attention.to(device)).last_hidden_state
    finally:
        hook.remove()
    return [(captured[0][b, : len(x)], final[b, : len(x)]) for b, x in enumerate(ids)]


def build_features(cfg: TrainConfig, target: LoadedModel, docs: list[dict], progress: bool = True) -> list[Example]:
    path = cfg.work_dir / f"features-{cfg.features_key()}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        return [Example(**e) for e in saved]
    n = cfg.train.seq_len
    windows, seen = [], set()
    for d in docs:
        ids = d["ids"][-n:]
        # Samples of one prompt with short replies (an action, a label) share nearly their whole
        # window: one of them is enough.
        key = tuple(ids[: len(ids) - DISTINCT_TAIL])
        if len(ids) >= 2 and key not in seen:
            seen.add(key)
            windows.append((d["id"].rsplit("/", 1)[0], ids))
    order = sorted(range(len(windows)), key=lambda i: len(windows[i][1]))
    examples: list[Example | None] = [None] * len(windows)
    batch = 8
    for start in tqdm(range(0, len(order), batch), desc="features", unit="batch", disable=not progress):
        idx = order[start : start + batch]
        feats = target_features(target.model, cfg.layer, [windows[i][1] for i in idx])
        for i, (h, f) in zip(idx, feats):
            group, ids = windows[i]
            examples[i] = Example(group, torch.tensor(ids), h.to(torch.float16).cpu(), f.to(torch.float16).cpu())
    out = [e for e in examples if e is not None]
    tmp = path.with_suffix(".tmp")
    torch.save([asdict(e) for e in out], tmp)
    tmp.replace(path)
    return out


def split(examples: list[Example], heldout: float) -> tuple[list[Example], list[Example]]:
    """Held-out examples are those of a fixed fraction of the problems (by a hash of the problem id)."""
    groups = sorted({e.group for e in examples}, key=lambda g: zlib.crc32(g.encode()))
    n_held = max(1, round(heldout * len(groups))) if len(groups) > 1 else 0
    held = set(groups[:n_held])
    return [e for e in examples if e.group not in held], [e for e in examples if e.group in held]


# --- 3. training --------------------------------------------------------------------------------


def batch_loss(edd: EddModel, batch: list[Example], block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean KL(P_target || P_edd), top-1 agreement) over a batch's tokens under the dual-block mask."""
    n = max(len(e.ids) for e in batch)
    hidden_size = edd.lm_config.hidden_size
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    hidden = torch.zeros(len(batch), n, hidden_size)
    final = torch.zeros(len(batch), n, hidden_size)
    valid = torch.zeros(len(batch), n, dtype=torch.bool)
    for b, e in enumerate(batch):
        k = len(e.ids)
        ids[b, :k], hidden[b, :k], final[b, :k], valid[b, :k] = e.ids, e.hidden.float(), e.final.float(), True
    device, dtype = edd.device, edd.dtype
    embeds = torch.cat([hidden.to(device, dtype), edd.embed(ids)], 1)
    visible = dual_block_mask(n, block_len).to(device)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    positions = torch.cat([torch.arange(n), torch.arange(n)])[None].to(device)
    logits = edd(embeds, mask[None, None], positions, logits_at=torch.arange(n, 2 * n))
    with torch.no_grad():
        target_logits = edd.head(final.to(device, dtype))
    valid = valid.to(device)
    loss = kl_to_target(logits, target_logits, valid)
    agree = ((logits.argmax(-1) == target_logits.argmax(-1)) & valid).sum() / valid.sum()
    return loss, agree.detach()


@torch.no_grad()
def evaluate(edd: EddModel, examples: list[Example], block_len: int, batch_size: int) -> tuple[float, float]:
    """Token-weighted held-out KL and top-1 agreement."""
    total = agree = tokens = 0.0
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        n = sum(len(e.ids) for e in batch)
        loss, acc = batch_loss(edd, batch, block_len)
        total += float(loss.detach()) * n
        agree += float(acc) * n
        tokens += n
    return total / max(tokens, 1), agree / max(tokens, 1)


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup, then cosine decay to a tenth of train.lr."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train(
    cfg: TrainConfig,
    target: LoadedModel,
    examples: list[Example],
    progress: bool = True,
    vocab: torch.Tensor | None = None,
) -> dict:
    """Train (or resume) an EDD and save it to cfg.out with `vocab`, the corpus's token ranking
    (draft.vocab); returns the training summary."""
    s = cfg.train
    torch.manual_seed(s.seed)
    edd = EddModel(EddConfig(cfg.model.path, cfg.layer, s.min_block, s.max_block, cfg.init_layer), target.model).train()
    params = [p for p in edd.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    train_set, held = split(examples, s.heldout)
    if not train_set or not held:
        raise ConfigError(
            f"the corpus has {len(examples)} texts from too few problems to hold some out; add problems "
            "(corpus.<task>.limit) or lower train.heldout"
        )
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    ckpt = cfg.work_dir / f"checkpoint-{cfg.run_key()}.pt"
    step, history = 0, []
    order: list[int] = []  # the rest of this epoch's shuffled training texts
    rng = random.Random(s.seed)
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        edd.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step, history, order = state["step"], state["history"], state["order"]
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        tqdm.write(f"resuming from {ckpt} at step {step}")
    log_line = _reporter(history)
    if step == 0 and not history:
        log_line(0, *evaluate(edd, held, s.eval_block, s.batch_size), None)
    recent: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(total=s.steps, initial=step, desc="train EDD", unit="step", disable=not progress)
    while step < s.steps:
        if len(order) < s.batch_size:
            order += rng.sample(range(len(train_set)), len(train_set))
        batch = [train_set[i] for i in order[: s.batch_size]]
        del order[: s.batch_size]
        block_len = rng.randint(s.min_block, s.max_block)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s)
        loss, _ = batch_loss(edd, batch, block_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        recent.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(kl=f"{sum(recent[-20:]) / len(recent[-20:]):.3f}")
        if step % s.eval_every == 0 or step == s.steps:
            log_line(step, *evaluate(edd, held, s.eval_block, s.batch_size), sum(recent) / len(recent))
            recent = []
        if step % s.checkpoint_every == 0 or step == s.steps:
            state = {
                "model": edd.trained_state(),
                "opt": opt.state_dict(),
                "step": step,
                "history": history,
                "order": order,
                "rng": rng.getstate(),
                "torch_rng": torch.get_rng_state(),
            }
            tmp = ckpt.with_suffix(".tmp")
            torch.save(state, tmp)
            tmp.replace(ckpt)
    bar.close()
    summary = {
        "steps": step,
        "train_texts": len(train_set),
        "heldout_texts": len(held),
        "train_tokens": sum(len(e.ids) for e in train_set),
        "heldout_kl_first": history[0]["heldout_kl"] if history else None,
        "heldout_kl": history[-1]["heldout_kl"] if history else None,
        "heldout_top1": history[-1]["heldout_top1"] if history else None,
        "history": history,
        "train_s_this_run": time.perf_counter() - t0,
        "settings": asdict(s),
    }
    save_edd(edd.eval(), cfg.out, {"training": summary}, vocab)
    return summary


def _reporter(history: list[dict]):
    def report(step: int, kl: float, top1: float, train_kl: float | None) -> None:
        history.append({"step": step, "heldout_kl": kl, "heldout_top1": top1, "train_kl": train_kl})
        extra = "" if train_kl is None else f", train KL {train_kl:.4f}"
        tqdm.write(f"step {step}: held-out KL {kl:.4f}, held-out top-1 agreement {top1:.3f}{extra}")

    return report


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


@hydra.main(config_path="pkg://conf", config_name="train_edd", version_base="1.3")
def main(cfg: DictConfig) -> None:
    quiet_transformers()
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


def cli() -> None:
    check_overrides(sys.argv[1:], "train_edd", ("model",))
    main()


if __name__ == "__main__":
    cli()
