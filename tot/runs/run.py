"""Solve a task's problems with a search over an engine, writing results as each problem finishes."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from decoding import (
    ConfigError,
    DecoderConfig,
    Engine,
    Group,
    ServerEngine,
    collector_off,
    host_line,
    install_on_first_use,
    int8_lacks,
    load_draft,
    load_model,
    load_tokenizer,
)
from tasks import DataError, FullTask, Problem, Values, make_task
from tot.runs.config import RunConfig
from tot.runs.folder import Configuration, open_folder, record
from tot.runs.lock import run_lock
from tot.runs.output import make_dirs, write_atomic
from tot.runs.results import ResultStore, TreeFiles, answer_fields, summarize
from tot.runs.saved import ShowError, read_tree, save_tree
from tot.search import SEARCHES
from tot.search.base import GenerationEngine, Reward, Search, request_seed, run_sync
from tot.search.reward import load_reward

log = logging.getLogger(__name__)


def run(cfg: RunConfig, out_dir: Path, engine: GenerationEngine | None = None, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) every selected problem into out_dir and return the summary; the folder is
    this run's alone while it runs (tot/runs/lock.py)."""
    make_dirs(out_dir)
    with run_lock(out_dir):
        return _run(cfg, out_dir, engine, progress)


def _run(cfg: RunConfig, out_dir: Path, engine: GenerationEngine | None, progress: bool) -> dict[str, Any]:
    task = build_task(cfg)
    problems = task.load(cfg.data)
    check_selection(cfg, problems)
    folder, store = open_run(cfg, out_dir)
    record(out_dir, folder)
    if store.results.torn_line is not None:
        log.warning(
            "%s:%d is a record cut short (a run stopped while writing it): ignored, and that problem solved again",
            store.path,
            store.results.torn_line,
        )
    rule = sampling_rule(cfg)
    check_rule(store.records, rule, out_dir)
    done = solved(store, {p.id for p in problems})
    todo = [p for p in problems if p.id not in done]
    if done:
        log.info("resuming in %s: %d of %d problems already done", out_dir, len(problems) - len(todo), len(problems))
    header = {
        "task": cfg.task,
        "search": cfg.search,
        "decoder": cfg.decoder.name,
        "model": cfg.model.path,
        "activations": folder.settings.get("model.activations"),  # what `auto` chose (None: a server's model)
        "concurrency": cfg.concurrency,
        "fingerprint": folder.fingerprint,  # configuration.json holds its settings
        # The config as the run read it (its source is configuration.json's business).
        "config": config_record(cfg),
    }
    if todo:
        engine = engine or make_engine(cfg)
        if isinstance(engine, Engine) and engine.loaded.float_layers:
            header["float_layers"] = engine.loaded.float_layers  # what int8 could not take, named in the summary
        judge = make_judge(cfg, engine)
        search = make_search(cfg, task, load_reward(cfg.reward) if cfg.reward else None)
        bar = tqdm(total=len(todo), desc=f"{cfg.task}/{cfg.decoder.name}", unit="problem", disable=not progress)
        clock = [time.perf_counter()]  # when the latest problem finished (or the run started)

        async def solve(problem: Problem) -> None:
            t0 = time.perf_counter()
            sol = await search.solve(problem, engine)
            metrics = await score(cfg, task, problem, sol.answer, judge)
            now = time.perf_counter()
            phases = {k: v.to_dict() for k, v in sol.phases.items()}
            save_tree(sol.tree, store.tree_path(problem.id))
            store.append(
                {
                    "id": problem.id,
                    "question": problem.question,
                    **answer_fields(task, problem, sol.steps),
                    "gold": problem.gold,
                    "metrics": metrics,
                    "rule": rule,
                    "configuration": folder.fingerprint,
                    "tokens": sum(p["tokens"] for p in phases.values()),
                    "wall_s": now - t0,  # this problem's latency (problems in flight overlap)
                    # The run's wall time since the previous problem finished: these add up to the
                    # run's wall time, whatever the concurrency.
                    "wall_share_s": now - clock[0],
                    "phases": phases,
                    # search.stop: the samples drawn of the budget's (best-of-N's n)
                    **({"budget": sol.budget} if sol.budget else {}),
                    # Where memory stood when the problem finished: over a run, the curves of the
                    # stored prefixes, the KV pool and resident memory (decoding/runtime/memory.py).
                    **({"memory": engine.memory()} if isinstance(engine, Engine) else {}),
                }
            )
            clock[0] = now
            summary = summarize(store.records, header)  # every problem of the folder, whatever the selection
            if isinstance(engine, Engine):
                summary["memory"] = engine.memory()
            write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2))
            bar.update()
            bar.set_postfix(acc=f"{summary['accuracy']:.2f}", tok_s=f"{summary['tokens_per_s']:.1f}")

        try:
            with collector_off():  # the loaded model's objects out of the collector's full passes
                run_sync(solve_all(todo, solve, cfg.concurrency))
        finally:
            bar.close()  # before any error line is printed
    summary = summarize(store.records, header)
    if isinstance(engine, Engine):
        summary["memory"] = engine.memory()  # where the memory went: decoding/runtime/memory.py
    if not store.path.exists():
        write_atomic(store.path, "")  # an empty shard's: tot.collect counts a run's problems from it
    write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def check_selection(cfg: RunConfig, problems: list[Problem]) -> None:
    """No problem selected is bad input (DataSpec.select names the offset), but for a shard that
    a sweep with more shards than problems leaves empty: that one says so and runs nothing."""
    data = cfg.data
    if problems:
        return
    if data.num_shards == 1:
        raise DataError(
            f"task={cfg.task} selects no problem (data.path={data.path}, data.offset={data.offset}, "
            f"data.limit={data.limit}); give a selection that holds problems"
        )
    log.warning(
        "data.shard=%d of data.num_shards=%d gets no problem (the selection has fewer problems than shards): "
        "nothing to solve here, summary.json written all the same",
        data.shard,
        data.num_shards,
    )


def open_run(cfg: RunConfig, out_dir: Path) -> tuple[Configuration, ResultStore]:
    """The folder's configuration (this run's, checked against what the folder holds) and its
    results; nothing written but a folder's first record of its configuration from .hydra/."""
    if not cfg.source:
        raise ConfigError("this RunConfig has no settings to record; build it with RunConfig.from_omegaconf")
    return open_folder(out_dir, Configuration.of(cfg.source))


def solved(store: ResultStore, selected: set[str]) -> set[str]:
    """The selected problems with a record and a readable tree: one whose tree cannot be read is
    solved again."""
    done = set()
    files = TreeFiles.of(store.out_dir, [r["id"] for r in store.records])
    for rec in store.records:
        if rec["id"] not in selected:
            continue
        path = files.find(rec["id"])  # a folder written before tree_name: its trees' names of then
        problem = unreadable(path or store.tree_path(rec["id"]))
        if problem is None:
            done.add(rec["id"])
        else:
            log.warning("problem %s is solved again: %s", rec["id"], problem)
    return done


def unreadable(path: Path) -> str | None:
    """Why a saved tree cannot be read, or None where it can."""
    if not path.is_file():
        return f"{path} does not exist"
    try:
        read_tree(path)
    except ShowError as e:
        return str(e)
    return None


def sampling_rule(cfg: RunConfig) -> str:
    """How the run's samples were decided: which reference its tokens equal (verify.rule), "greedy"
    where nothing is sampled, "server" where a server samples by its own rules."""
    if cfg.gen.temperature == 0 and cfg.gen.eval_temperature == 0:
        return "greedy"
    return "server" if cfg.decoder.server is not None else cfg.decoder.verify.rule


def check_rule(records: list[dict[str, Any]], rule: str, out_dir: Path) -> None:
    """A run resumes only under the rule its finished problems were sampled with: another rule
    gives other samples, and the run's trees would mix two samplers. (Records written before rules
    were recorded sampled by torch.multinomial: match_multinomial.)"""
    before = {r.get("rule", "match_multinomial") for r in records} - {"greedy"}
    if rule != "greedy" and before and before != {rule}:
        raise ConfigError(
            f"{out_dir} holds problems sampled under verify.rule={', '.join(sorted(before))}; this run samples "
            f"under {rule}: rerun with verify.rule={sorted(before)[0]} to resume, or give this run its own "
            "folder with hydra.run.dir=..."
        )


async def solve_all(problems: list[Problem], solve: Callable[[Problem], Awaitable[None]], concurrency: int) -> None:
    """`solve` every problem, at most `concurrency` at once, started in order: a problem's requests
    share the engine's forwards with those of the others in flight."""
    slots = asyncio.Semaphore(concurrency)

    async def one(problem: Problem) -> None:
        async with slots:
            await solve(problem)

    await gather_all([one(p) for p in problems])


async def gather_all(work: list[Coroutine[Any, Any, None]]) -> None:
    """Run them at once; the first failure ends them all: the others stop here, cleanly, before
    it is reported."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def build_task(cfg: RunConfig) -> FullTask:
    return make_task(cfg.task, cfg.depth, cfg.task_options)


def make_search(cfg: RunConfig, task: FullTask, reward: Reward | None = None, values: Values | None = None) -> Search:
    """The run's search over `task`, its states valued as the task's options say (or as `values`)."""
    values = values or Values.of(task)
    build = SEARCHES[cfg.search].build
    search: Search = build(task, values, cfg.search_settings, cfg.gen, cfg.seed, reward, vote=cfg.vote)
    return search


def make_judge(cfg: RunConfig, engine: GenerationEngine) -> GenerationEngine:
    """The model that scores final answers: task.judge.path, else the target (through the run's
    engine: its decoding is lossless, so the judgement is the target's)."""
    if cfg.judge is None:
        return engine
    return Engine(load_model(cfg.judge), DecoderConfig(name="ar"))


async def score(
    cfg: RunConfig, task: FullTask, problem: Problem, answer: str, judge: GenerationEngine
) -> dict[str, float]:
    """The task's code-computed metrics, plus the judge's mean score over task.n_evaluate samples."""
    metrics = task.metrics(problem, answer)
    prompt = task.judge_prompt(problem, answer)
    if prompt is not None:
        requests = [
            cfg.gen.request(
                prompt,
                group=Group(problem.id, "judge"),
                seed=request_seed(cfg.seed, problem.id, "judge", j),
                evaluate=True,
            )
            for j in range(task.n_evaluate)
        ]
        replies = (await judge.agenerate(requests)).results
        metrics[task.judge_metric] = sum(task.parse_value(r.text) for r in replies) / len(replies)
    return metrics


def config_record(cfg: RunConfig) -> dict[str, Any]:
    """The config as the run read it, its search's settings under the search's name (tot.rescore
    reads them there); its source is configuration.json's business."""
    record = {k: v for k, v in asdict(cfg).items() if k not in ("source", "search_settings")}
    out: dict[str, Any] = json.loads(json.dumps({**record, cfg.search: asdict(cfg.search_settings)}, default=str))
    return out


def summary_line(s: dict[str, Any]) -> str:
    metrics = "".join(f", {k} {v:.3f}" for k, v in s.get("metrics", {}).items())
    by = ", ".join(f"{k} {v:.3f}" for k, v in s.get("accuracy_by", {}).items())
    # A server does not report its forwards (decoder=server): no tau or rows to print.
    forwards = (
        f"tau {s['acceptance_length']:.2f}, {s['forwards_per_token']:.3f} target forwards/token, "
        f"{s['rows_per_forward']:.2f} rows/forward, " + (f"{host_line(s)}, " if s.get("steps") else "")
        if s["target_forwards"]
        else ""
    )
    return (
        f"{s['task']} {s['search']} decoder={s['decoder']}: accuracy {s['accuracy']:.3f} "
        f"({s['n_correct']}/{s['n_problems']}{f'; {by}' if by else ''}){metrics}, "
        f"{s['generated_tokens']} tokens in {s['wall_s']:.1f}s "
        f"= {s['tokens_per_s']:.1f} tok/s, {forwards}"
        f"{s['prompt_tokens_computed']}/{s['prompt_tokens']} prompt tokens computed, "
        f"run.concurrency={s.get('concurrency', 1)}"
        + (f", model.activations={s['activations']}" if s.get("activations") else "")
        + (f" ({int8_lacks(s['float_layers'])})" if s.get("float_layers") else "")
        + (f", {s['kv_waits']} sequences waited for KV memory (model.kv_memory)" if s.get("kv_waits") else "")
    )


def make_engine(cfg: RunConfig) -> Engine | ServerEngine:
    """The in-process engine on the loaded model(s), or a client of the server that serves it."""
    if cfg.decoder.server is not None:
        return ServerEngine(cfg.decoder.server, *load_tokenizer(cfg.model))
    for path in (cfg.model.path, cfg.decoder.draft.path if cfg.decoder.draft else None):
        if path:
            install_on_first_use(path)
    target = load_model(cfg.model)
    draft = load_draft(cfg.decoder.draft, target) if cfg.decoder.draft else None
    return Engine(target, cfg.decoder, draft)
