"""`python -m tot.bench`: decoders compared on the same ToT problems, in one process (Hydra).

Every decoder gets its own engine on the same loaded model(s) and searches `run.concurrency`
problems at once (a variant may set its own, e.g. bench.variants='{ar_1: {decoder: ar,
run.concurrency: 1}}'), after a warm-up call per engine. So that machine drift hits all alike, with
`bench.lockstep` (auto: on the CPU) every in-process entry runs at once, the engines taking turns
forward by forward and each timed by its own steps; else the entries take turns on the problems,
one batch of their own concurrency at a time, in turn and in reverse turn (`turn_order`), timed by the
wall clock. Reported per decoder: time (whole run, and engine time per phase), tokens, tokens/s,
speedup over `hf` and `ar`, acceptance length, target forwards per token, rows per forward (how full the
target's batches were), prompt tokens computed against requested (what prefix sharing saved), target
busy fraction and the peak KV-cache memory. At temperature 0, and at any temperature under a matched
`verify.rule` (the default), every decoder's trees must equal `hf`'s under the same rule and
evaluator (the lossless invariant; where no `hf` entry runs, the first `ar` entry's): a difference is
printed and the command exits with status 1. `server` (decoder=server, the `server.*` options) runs
the search on a serving engine beside the in-process decoders, e.g. llama.cpp's server on the same
GGUF file: its outputs follow the server's own numeric path, so it is left out of that check, and
its forwards and acceptance are unknown (printed as -). Writes
bench.json, bench.md and, when matplotlib is installed, bench.png into the run directory.
`bench.scaling=true` instead draws the scaling curve (tot/scaling.py): accuracy against wall time and
tokens, acceptance length and speed over `ar` for `bench.scaling_decoders`, as each search of
`bench.searches` grows its budget N (`bench.budgets`), at each of `bench.temperatures`:
scaling.json, scaling.md and scaling.png. `bench.variants` adds runs of one decoder with
other options (tree policies, rules) under their own names, e.g. bench.variants='{sd_pct: {decoder:
sd, draft_tree.tree_policy: pct}}'.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from decoding import (
    DECODERS,
    BackendError,
    ConfigError,
    DecoderConfig,
    DecodeStats,
    GenRequest,
    Group,
    OutputError,
    ServerEngine,
    as_float,
    as_int,
    as_list,
    choices,
    collector_off,
)
from decoding.base.cli import Refused, fail, hydra_command
from tasks.base import DataError, FullTask, Problem, Values
from tot.compare import first_difference
from tot.runs.config import RunConfig
from tot.runs.lock import run_lock
from tot.runs.output import pyplot, save_figure, write_atomic
from tot.scaling import plot_scaling, scaling, scaling_table
from tot.search.base import PHASES, GenerationEngine, Search, Solution, run_sync
from tot.search.reward import load_reward
from tot.search.tree import ReasoningTree

# The runtime (torch, transformers: seconds) is imported where a run needs it, once the options hold.
if TYPE_CHECKING:
    from decoding import Engine, LoadedModel

# The run's options as OmegaConf.to_container gives them for a DictConfig: resolved, keyed by name.
Container = dict[str, Any]
# A bench's result and its per-decoder rows: JSON-shaped, as bench.json holds them.
Result = dict[str, Any]
Row = dict[str, Any]


@dataclass
class Tally:
    """One decoder's totals over the problems."""

    time_s: float = 0.0  # the wall clock's (entries in turns) or its engine's steps' (lockstep)
    phase_engine_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    phase_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    phase_prompt: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    phase_prompt_computed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    decode: DecodeStats = field(default_factory=DecodeStats)
    trees: dict[str, ReasoningTree] = field(default_factory=dict)
    correct: int = 0
    peak_device_bytes: int = 0  # CUDA only: the most memory allocated while this decoder ran
    metrics: dict[str, list[float]] = field(default_factory=dict)  # the task's scores per problem


def decoder_configs(
    container: Container, names: list[str], has_draft: bool, variants: dict[str, object] | None = None
) -> tuple[dict[str, DecoderConfig], list[str]]:
    """Each named decoder's config from the run's options, then each of `bench.variants` (a name ->
    one decoder with some of its options changed); those needing a missing draft model are skipped."""
    configs: dict[str, DecoderConfig] = {}
    skipped: list[str] = []
    for name in names:
        if name not in choices():
            raise ConfigError(f"bench.decoders has {name!r}, which is not one of {', '.join(choices())}")
        if name in DECODERS and DECODERS[name].draft_model == "required" and not has_draft:
            skipped.append(name)
            continue
        configs[name] = DecoderConfig.from_container({**container, "decoder": {"name": name}})
    for name, overrides in (variants or {}).items():
        if name in names:
            raise ConfigError(f"bench.variants.{name} is also in bench.decoders; give the variant another name")
        c = variant_container(container, name, overrides)
        kind = DECODERS.get(c["decoder"]["name"])
        if kind is not None and kind.draft_model == "required" and not has_draft:
            skipped.append(name)
            continue
        try:
            configs[name] = DecoderConfig.from_container(c)
        except (ConfigError, BackendError) as e:
            raise ConfigError(f"bench.variants.{name}: {e}") from None
    return configs, skipped


# What every decoder of one bench shares (the problems, sampling, models): a variant may not change it.
SHARED = ("task", "search", "data", "gen", "model", "draft", "bench")
# Shared-group keys a variant may still set: they change how a decoder uses the loaded models, not the models.
PER_DECODER = ("draft.vocab", "task.evaluator")


def variant_container(container: Container, name: str, overrides: object) -> Container:
    """The run's options with one variant's overrides applied: a list such as [decoder=sd,
    draft_tree.tree_policy=pct] (values parsed as YAML) or a mapping {decoder: sd, draft_tree.tree_policy: pct}."""
    if isinstance(overrides, dict):
        items = [(str(k), v) for k, v in overrides.items()]
    elif isinstance(overrides, list) and all(isinstance(o, str) and "=" in o for o in overrides):
        items = [(k.strip(), yaml.safe_load(v)) for k, _, v in (o.partition("=") for o in overrides)]
    else:
        raise ConfigError(
            f"bench.variants.{name}={overrides!r} must be a list of overrides such as "
            "['decoder=sd','draft_tree.tree_policy=pct'] or a mapping such as "
            "{decoder: sd, draft_tree.tree_policy: pct}"
        )
    if "decoder" not in dict(items):
        raise ConfigError(f"bench.variants.{name} does not say which decoder it runs; add decoder=<one of bench's>")
    cfg = OmegaConf.create(copy.deepcopy(container))
    absent = object()
    for key, value in items:
        key = "decoder.name" if key == "decoder" else key
        if key.split(".")[0] in SHARED and key not in PER_DECODER:
            raise ConfigError(
                f"bench.variants.{name} sets {key}: every decoder of a bench shares {', '.join(SHARED)} "
                f"(but for {', '.join(PER_DECODER)})"
            )
        if OmegaConf.select(cfg, key, default=absent) is absent:
            raise ConfigError(f"bench.variants.{name} sets {key}, which is not a config key")
        OmegaConf.update(cfg, key, value, merge=False)
    return cast(Container, OmegaConf.to_container(cfg))  # cfg was created from a dict: a DictConfig


def bench(
    cfg: RunConfig,
    configs: dict[str, DecoderConfig],
    target: LoadedModel,
    draft: LoadedModel | None,
    progress: bool = True,
    concurrency: dict[str, int] | None = None,
    evaluator: dict[str, str] | None = None,
    lockstep: bool = False,
) -> Result:
    """Every decoder on the same problems; `concurrency`: problems in flight per decoder (default
    the run's `run.concurrency` for all); `evaluator`: an entry's own task.evaluator; `lockstep`:
    the in-process entries all at once, their engines taking turns forward by forward, each timed
    by its own steps (else the entries take turns by batches of problems, timed by the wall clock)."""
    from decoding import peak_rss_mb
    from tot.runs.run import build_task, make_judge, make_search

    task = build_task(cfg)
    problems = task.load(cfg.data)
    evaluated = {name: (evaluator or {}).get(name, task.evaluator) for name in configs}
    # An entry's search differs from the run's in how its evaluator is asked alone.
    reward = load_reward(cfg.reward) if cfg.reward else None  # reward.path: one model for every entry
    values = Values.of(task)
    searches = {
        name: make_search(cfg, task, reward, replace(values, in_context=e == "in_context"))
        for name, e in evaluated.items()
    }
    at_once = {name: (concurrency or {}).get(name, cfg.concurrency) for name in configs}
    engines = {name: bench_engine(c, target, draft) for name, c in configs.items()}
    # task.judge.path, as tot.runs.run scores with it; loaded once (else each decoder's engine is its own judge).
    judge = None if cfg.judge is None else make_judge(cfg, next(iter(engines.values())))
    for engine in engines.values():  # warm-up: first-call allocations and kernel choices (a server: its check)
        run_sync(engine.agenerate([GenRequest("Say hello.", max_new_tokens=8, group=Group("warm-up"))]))
    tallies = {name: Tally() for name in engines}
    solutions: dict[str, dict[str, Solution]] = {name: {} for name in engines}
    # Server entries decode in another process: timed by the wall clock, in turns after the others.
    in_process = {n: e for n, e in engines.items() if lockstep and not isinstance(e, ServerEngine)}
    together = list(in_process)
    bar = tqdm(total=len(problems) * len(engines), desc=f"bench {cfg.task}", unit="run", disable=not progress)
    with bar, collector_off():  # the loaded model's objects out of the collector's full passes
        if together:
            _bench_lockstep(problems, in_process, at_once, searches, solutions, tallies, bar)
        for name, chunk in turn_order([n for n in engines if n not in together], problems, at_once):
            _bench_chunk(chunk, engines[name], at_once[name], searches[name], solutions[name], tallies[name], bar)
    for name, tally in tallies.items():
        _tally(tally, problems, solutions[name], task, cfg, judge or engines[name])
    rows = {
        name: {
            **_row(name, t, engines[name]),
            "concurrency": at_once[name],
            "evaluator": evaluated[name],
            # What time_s is: the entry's engine's own steps (lockstep) or the wall clock (in turns).
            "clock": "steps" if name in together else "wall",
        }
        for name, t in tallies.items()
    }
    # What an entry is compared under: its evaluator and, at temperature > 0, its sampling rule.
    setting: dict[str, tuple[str, str]] = {
        n: (evaluated[n], "greedy" if cfg.gen.temperature == 0 else c.verify.rule) for n, c in configs.items()
    }
    for name, r in rows.items():
        r["rule"] = setting[name][1]
        for base in ("hf", "ar"):
            ref = _baseline(rows, configs, setting, name, base)
            if ref is not None:
                r[f"speedup_vs_{base}"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref["tokens_per_s"] else 0
    # At temperature 0, and at any temperature under a matched rule, every tree must be hf's. A server
    # computes on its own numeric path (another kernel, another file format): its outputs differ and
    # are not compared. Each entry is held to an `hf` entry under the same evaluator and rule.
    greedy = cfg.gen.temperature == 0 and cfg.gen.eval_temperature == 0
    same_path = [n for n, c in configs.items() if c.server is None and (greedy or c.verify.rule != "rejection")]
    # (evaluator, rule) -> the first hf entry under them; where no hf entry ran (a long sweep leaves
    # the slowest out), the first ar entry: every entry must still build the trees ar built.
    references: dict[tuple[str, str], str] = {}
    for base in ("hf", "ar"):
        for n in same_path:
            if configs[n].name == base:
                references.setdefault(setting[n], n)
    compared = [n for n in same_path if setting[n] in references]
    checked = [n for n in compared if configs[references[setting[n]]].name == "hf"]
    mismatches: list[str] = []
    for name in compared:
        reference = references[setting[name]]
        for pid, tree in tallies[name].trees.items():
            where = first_difference(tallies[reference].trees[pid], tree)
            if where:
                mismatches.append(f"{name} on {pid} (against {reference}): {where}")
    return {
        "task": cfg.task,
        "model": cfg.model.path,
        "problems": [p.id for p in problems],
        "temperature": cfg.gen.temperature,
        "lossless_checked": sorted(checked) == sorted(configs),
        "identity_checked": checked,  # the decoders whose trees were compared with hf's
        "compared_with_ar": [n for n in compared if n not in checked],  # where no hf entry ran
        "servers": [n for n, c in configs.items() if c.server is not None],  # outputs of their own
        "mismatches": mismatches,
        # All decoders share one process (and the model's weights), so host memory is one figure.
        "process_peak_rss_mb": peak_rss_mb(),
        "decoders": rows,
    }


def _baseline(
    rows: dict[str, Row], configs: dict[str, DecoderConfig], setting: dict[str, tuple[str, str]], name: str, base: str
) -> Row | None:
    """The entry `name` is compared with: the first `base` entry under the same evaluator and rule,
    at the same concurrency where there is one (`hf` decodes one sequence at a time, so any serves)."""
    like = [n for n, c in configs.items() if c.name == base and setting[n] == setting[name]]
    same = [n for n in like if rows[n]["concurrency"] == rows[name]["concurrency"]]
    pick = (same or like)[:1]
    return rows[pick[0]] if pick else None


def bench_engine(c: DecoderConfig, target: LoadedModel, draft: LoadedModel | None) -> Engine | ServerEngine:
    """An in-process engine on the loaded model(s), or a client of the server named by `server.*`
    (prompts built with the loaded model's tokenizer: the server must serve that model)."""
    from decoding import Engine

    if c.server is not None:
        return ServerEngine(c.server, target.tokenizer, target.use_chat_template)
    return Engine(target, c, draft if c.draft else None)


def turn_order(names: list[str], problems: list[Problem], at_once: dict[str, int]) -> list[tuple[str, list[Problem]]]:
    """The order the entries run in: turns, each giving every entry with problems left its next
    `at_once[name]` of them (one batch at its own concurrency), the entries in turn and in reverse
    turn on every other turn. Entries compared with each other share a concurrency, so they
    alternate as finely as their batches allow, and the reversal evens out their mean place in
    time: a machine that drifts over a run slows each of them alike."""
    plan: list[tuple[str, list[Problem]]] = []
    done = dict.fromkeys(names, 0)
    r = 0
    while any(done[n] < len(problems) for n in names):
        for name in names if r % 2 == 0 else reversed(names):
            if done[name] < len(problems):
                plan.append((name, problems[done[name] : done[name] + at_once[name]]))
                done[name] += at_once[name]
        r += 1
    return plan


def _bench_chunk(
    chunk: list[Problem],
    engine: Engine | ServerEngine,
    at_once: int,
    search: Search,
    solutions: dict[str, Solution],
    tally: Tally,
    bar: tqdm,
) -> None:
    """Some problems through one entry, `at_once` of them at a time, timed by the wall clock."""
    import torch

    # The device whose peak memory is measured: None for a server, or for a target off CUDA.
    cuda = None if isinstance(engine, ServerEngine) or engine.target.device.type != "cuda" else engine.target.device
    if cuda is not None:
        torch.cuda.reset_peak_memory_stats(cuda)

    t0 = time.perf_counter()
    run_sync(_searched(chunk, engine, at_once, search, solutions, bar))
    tally.time_s += time.perf_counter() - t0
    if cuda is not None:
        tally.peak_device_bytes = max(tally.peak_device_bytes, torch.cuda.max_memory_allocated(cuda))


async def _searched(
    problems: list[Problem],
    engine: Engine | ServerEngine,
    at_once: int,
    search: Search,
    solutions: dict[str, Solution],
    bar: tqdm,
) -> None:
    """One entry's search of `problems`, `at_once` of them in flight, each solution kept as it ends."""
    from tot.runs.run import solve_all

    async def solve(problem: Problem) -> None:
        solutions[problem.id] = await search.solve(problem, engine)
        bar.update()

    await solve_all(problems, solve, at_once)


def _bench_lockstep(
    problems: list[Problem],
    engines: dict[str, Engine],
    at_once: dict[str, int],
    searches: dict[str, Search],
    solutions: dict[str, dict[str, Solution]],
    tallies: dict[str, Tally],
    bar: tqdm,
) -> None:
    """Every entry's search at once in one event loop: the engines take turns forward by forward
    (each steps between its callers' turns), so whatever the machine does over the run it does to
    every entry alike; each entry is timed by its own engine's steps (`Engine.step_s`)."""
    import torch

    from tot.runs.run import gather_all

    start = {name: engine.step_s for name, engine in engines.items()}
    devices = {e.target.device for e in engines.values() if e.target.device.type == "cuda"}
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)

    run_sync(gather_all([_searched(problems, engines[n], at_once[n], searches[n], solutions[n], bar) for n in engines]))
    for name, engine in engines.items():
        tallies[name].time_s += engine.step_s - start[name]
        if engine.target.device.type == "cuda":  # all entries at once: the run's peak
            tallies[name].peak_device_bytes = torch.cuda.max_memory_allocated(engine.target.device)


def _tally(
    tally: Tally,
    problems: list[Problem],
    solutions: dict[str, Solution],
    task: FullTask,
    cfg: RunConfig,
    judge: GenerationEngine,
) -> None:
    """An entry's totals from its solutions, scored after its clock stopped (a judge's calls are
    not part of building the tree)."""
    from tot.runs.run import score

    for problem in problems:
        sol = solutions[problem.id]
        for phase, stats in sol.phases.items():
            tally.phase_engine_s[phase] += stats.engine_s
            tally.phase_tokens[phase] += stats.decode.generated_tokens
            tally.phase_prompt[phase] += stats.decode.prompt_tokens
            tally.phase_prompt_computed[phase] += stats.decode.prompt_tokens_computed
            tally.decode += stats.decode
        tally.trees[problem.id] = sol.tree
        tally.correct += bool(task.is_correct(problem, sol.answer))
        for key, value in run_sync(score(cfg, task, problem, sol.answer, judge)).items():
            tally.metrics.setdefault(key, []).append(value)


def lockstep_option(container: Container) -> bool | None:
    """bench.lockstep, checked before the model loads: True, False or None for auto (on where forwards
    run on the CPU, where machine drift between entries is as large as the differences measured; off
    on a GPU, where each entry's peak device memory is measured alone)."""
    value = container["bench"].get("lockstep", "auto")
    if value == "auto":
        return None
    if isinstance(value, bool):
        return value
    raise ConfigError(f"bench.lockstep={value!r} must be auto, true or false")


def concurrencies(container: Container, names: list[str]) -> dict[str, int]:
    """Problems in flight per bench entry: `run.concurrency`, or a variant's own."""
    out: dict[str, int] = {}
    for name, c in _entry_containers(container, names).items():
        out[name] = as_int("run.concurrency", c["run"]["concurrency"])
        if out[name] < 1:
            raise ConfigError(f"run.concurrency={out[name]} (for {name}) must be a positive integer")
    return out


def evaluators(container: Container, names: list[str]) -> dict[str, str]:
    """Each bench entry's `task.evaluator` (a variant may set its own: separate or in_context)."""
    return {
        name: str(c["task"].get("evaluator", "separate")) for name, c in _entry_containers(container, names).items()
    }


def _entry_containers(container: Container, names: list[str]) -> dict[str, Container]:
    variants = container["bench"].get("variants") or {}
    return {n: variant_container(container, n, variants[n]) if n in variants else container for n in names}


def _row(name: str, t: Tally, engine: Engine | ServerEngine) -> Row:
    tokens = t.decode.generated_tokens
    # A server does not say how it decoded: its forwards and acceptance are unknown (null).
    own = not isinstance(engine, ServerEngine)
    return {
        "decoder": name,
        "problems_correct": t.correct,
        "metrics": {k: sum(v) / len(v) for k, v in t.metrics.items()},
        "tokens": tokens,
        "time_s": t.time_s,
        "tokens_per_s": tokens / t.time_s if t.time_s else 0.0,
        "phases": {
            p: {
                "engine_s": t.phase_engine_s[p],
                "tokens": t.phase_tokens[p],
                "tokens_per_s": t.phase_tokens[p] / t.phase_engine_s[p] if t.phase_engine_s[p] else 0.0,
                "prompt_tokens": t.phase_prompt[p],
                "prompt_tokens_computed": t.phase_prompt_computed[p],
            }
            for p in PHASES
        },
        "acceptance_length": t.decode.acceptance_length if own else None,
        # Of the accepted draft tokens, the share the suffix drafter proposed (decoder=suffix, stand.suffix).
        "suffix_share": (t.decode.suffix_accepted_tokens / t.decode.accepted_tokens)
        if own and t.decode.suffix_accepted_tokens
        else None,
        "forwards_per_token": t.decode.forwards_per_token if own else None,
        "rows_per_forward": t.decode.rows_per_forward if own else None,
        "context_shared_fraction": t.decode.schedule.context_shared_fraction if own else None,
        "prompt_tokens": t.decode.prompt_tokens,
        "prompt_tokens_computed": t.decode.prompt_tokens_computed,
        "target_busy_fraction": t.decode.target_busy_fraction if own else None,
        # A decode step: its verification forward and the host's work around it, by stage (ms a step).
        **(t.decode.schedule.host_summary() if own else {}),
        # The step planner (verify.plan=goodput): draft nodes it gave a verified row, and its verification
        # steps' predicted against measured time (null where no plan ran: ar, a fixed plan, a server).
        "plan_nodes_per_row": t.decode.schedule.planned_nodes_per_row
        if own and t.decode.schedule.planned_rows
        else None,
        "plan_predicted_s": t.decode.schedule.predicted_step_s if own and t.decode.schedule.planned_rows else None,
        "plan_measured_s": t.decode.schedule.planned_step_s if own and t.decode.schedule.planned_rows else None,
        "peak_kv_mb": engine.peak_cache_bytes() / 2**20,
        "peak_device_mb": t.peak_device_bytes / 2**20,
        # Stored prefixes (every engine on the model together, against their one cap), the KV pool,
        # resident memory: decoding/runtime/memory.py. Null for a server (its memory is its own).
        "memory": engine.memory() if not isinstance(engine, ServerEngine) else None,
    }


def table(result: Result) -> str:
    head = (
        "| decoder | problems at once | solved | tokens | time (s) | tokens/s | vs hf | vs ar | acceptance length "
        "| accepted drafts from the suffix drafter | target forwards / token | rows / forward "
        "| prompt tokens computed / requested (thoughts, evaluations) "
        "| target busy | host / forward ms a step "
        "| thought gen. tok/s | evaluation tok/s | plan: draft nodes / row | plan: step s predicted / measured "
        "| peak KV (MB) | stored prefixes, all entries (MB, evictions) |"
    )
    lines = [head, "|" + "---|" * 21]
    n = len(result["problems"])
    for r in result["decoders"].values():
        ph = r["phases"]
        lines.append(
            f"| `{r['decoder']}`{_setting(r)} | {r.get('concurrency', 1)} "
            f"| {r['problems_correct']}/{n} | {r['tokens']} "
            f"| {r['time_s']:.1f} "
            f"| {r['tokens_per_s']:.1f} "
            f"| {_ratio(r, 'hf')} | {_ratio(r, 'ar')} | {_num(r['acceptance_length'], '.2f')} "
            f"| {_num(r.get('suffix_share'), '.0%')} | {_num(r['forwards_per_token'], '.3f')} "
            f"| {_num(r['rows_per_forward'], '.2f')} "
            f"| {_prompts(ph['generate'])}, {_prompts(ph['evaluate'])} "
            f"| {_num(r['target_busy_fraction'], '.2f')} | {_step_ms(r)} | {ph['generate']['tokens_per_s']:.1f} "
            f"| {ph['evaluate']['tokens_per_s']:.1f} | {_num(r.get('plan_nodes_per_row'), '.2f')} "
            f"| {_plan_time(r)} | {r['peak_kv_mb']:.0f} | {_store(r.get('memory'))} |"
        )
    clocks = {r.get("clock", "wall") for r in result["decoders"].values()}
    if "steps" in clocks:
        lines.append(
            "\nThe in-process entries ran at once, their engines taking turns forward by forward; each one's "
            "time is its engine's own steps"
            + (" (server entries: wall clock, after them)." if "wall" in clocks else ".")
        )
    for name in result.get("servers", []):
        lines.append(
            f"\n`{name}`: outputs follow the server's own numeric path (another kernel and weight format), so "
            "they are not compared with `hf`'s; its forwards and acceptance are not reported (-)."
        )
    return "\n".join(lines)


def _setting(row: Row) -> str:
    """How an entry valued states and sampled, where not by the defaults (the separate evaluator
    prompt; match_gumbel)."""
    own = [row.get("evaluator", "separate"), row.get("rule", "match_gumbel")]
    shown = [x for x in own if x not in ("separate", "match_gumbel", "greedy")]
    return f" ({', '.join(shown)})" if shown else ""


def _prompts(phase: dict[str, Any]) -> str:
    if "prompt_tokens" not in phase:  # a result written before prompts were counted per phase
        return "-"
    return f"{phase['prompt_tokens_computed']} / {phase['prompt_tokens']}"


def _store(memory: dict[str, Any] | None) -> str:
    if not memory:
        return "-"
    return f"{memory['prefix_store_mb']:.0f} of {memory['prefix_store_cap_mb']:.0f} ({memory['prefix_evictions']})"


def _step_ms(r: Row) -> str:
    if not r.get("steps"):
        return "-"
    return f"{r['host_ms_per_step']:.2f} / {r['forward_ms_per_step']:.2f}"


def _plan_time(row: Row) -> str:
    if row.get("plan_predicted_s") is None:
        return "-"
    return f"{row['plan_predicted_s']:.1f} / {row['plan_measured_s']:.1f}"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(row: Row, base: str) -> str:
    key = f"speedup_vs_{base}"
    return f"{row[key]:.2f}x" if key in row else "-"


def plot(result: Result, path: Path) -> bool:
    """Tokens/s and acceptance length per decoder as a PNG; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    rows = list(result["decoders"].values())
    names = [r["decoder"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].bar(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("tokens / s (whole ToT run)")
    axes[1].bar(names, [r["acceptance_length"] or 0 for r in rows], color="tab:orange")
    axes[1].set_ylabel("acceptance length (tokens / verification)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{result['task']}, {len(result['problems'])} problems, temperature {result['temperature']}")
    fig.tight_layout()
    save_figure(fig, path)
    return True


def check_options(cfg: DictConfig, run_dir: Path) -> None:
    """The run's options checked before Hydra starts and the runtime loads, so a bad value stops in
    about a second (the bench's own, read with the model loaded, in `bench_command`)."""
    try:
        RunConfig.from_omegaconf(cfg)
    except (ConfigError, BackendError) as e:
        raise Refused(str(e).splitlines()[0]) from None


@hydra_command("bench", groups=("task", "search", "decoder", "model"), before=check_options)
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    try:
        with run_lock(out):
            mismatches = bench_command(cfg, out)
    except (ConfigError, DataError, BackendError, OutputError) as e:
        fail(str(e).splitlines()[0])
    if mismatches:
        for m in mismatches:
            print(f"LOSSLESS CHECK FAILED: {m}", file=sys.stderr)
        sys.exit(1)


def bench_command(cfg: DictConfig, out: Path) -> list[str]:
    """The whole command in its locked folder: runs the entries, prints and writes the table, and
    returns the lossless check's mismatches. The table is printed before it is written, so a write
    that fails loses nothing the run measured."""
    from decoding import load_draft, load_model

    run_cfg = RunConfig.from_omegaconf(cfg)
    container = cast(Container, OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's is a dict
    bench_options = container["bench"]
    scale = bool(bench_options.get("scaling"))
    field = "scaling_decoders" if scale else "decoders"
    key = f"bench.{field}"
    names = [str(n) for n in as_list(key, bench_options[field], "[ar,seed_stand]")]
    has_draft = bool((container.get("draft") or {}).get("path"))
    if scale:
        budgets = [as_int("bench.budgets", n) for n in as_list("bench.budgets", bench_options["budgets"])]
        temperatures = [
            as_float("bench.temperatures", t)
            for t in as_list("bench.temperatures", bench_options["temperatures"], "[0,0.7]")
        ]
    configs, skipped = decoder_configs(container, names, has_draft, bench_options.get("variants") or {})
    if not configs:  # before the model loads: a table of nothing would say every decoder was checked
        verb = "needs" if len(skipped) == 1 else "need"
        why = f"{', '.join(skipped)} {verb} a draft model: set draft.path=..., or name" if skipped else "name"
        raise ConfigError(f"{key}={names} leaves nothing to run; {why} decoders to compare, such as {key}=[hf,ar]")
    lockstep = lockstep_option(container)
    target = load_model(run_cfg.model)
    draft_spec = next((c.draft for c in configs.values() if c.draft), None)
    draft = load_draft(draft_spec, target) if draft_spec else None
    if scale:
        rows, mismatches = scaling(
            run_cfg,
            lambda cell: bench(cell, configs, target, draft),
            budgets,
            temperatures,
            container["bench"].get("searches"),
            lambda rows: write_atomic(out / "scaling.json", json.dumps(rows, indent=2) + "\n"),
        )
        text = scaling_table(rows)
        print(text)
        write_atomic(out / "scaling.json", json.dumps(rows, indent=2) + "\n")
        write_atomic(out / "scaling.md", text + "\n")
        if plot_scaling(rows, out / "scaling.png"):
            print(f"plot: {out / 'scaling.png'}")
        print(f"written to {out}")
        return mismatches
    names = list(configs)
    result = bench(
        run_cfg,
        configs,
        target,
        draft,
        concurrency=concurrencies(container, names),
        evaluator=evaluators(container, names),
        lockstep=target.device.type == "cpu" if lockstep is None else lockstep,
    )
    result["skipped"] = skipped
    text = table(result)
    print(text)
    for r in result["decoders"].values():
        if r["metrics"]:
            print(f"{r['decoder']} scores: " + ", ".join(f"{k} {v:.3f}" for k, v in r["metrics"].items()))
    print(f"process peak memory {result['process_peak_rss_mb']:.0f} MB (all decoders, one process)")
    if skipped:
        print(f"skipped {', '.join(skipped)}: they need a draft model (draft.path=...)")
    write_atomic(out / "bench.json", json.dumps(result, indent=2) + "\n")
    write_atomic(out / "bench.md", text + "\n")
    if plot(result, out / "bench.png"):
        print(f"plot: {out / 'bench.png'}")
    print(f"written to {out}")
    found: list[str] = result["mismatches"]  # bench() builds it as such
    return found


if __name__ == "__main__":
    main()
