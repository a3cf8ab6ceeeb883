"""`python -m tuning.calibrate_tree`: a draft tree for a drafter, calibrated by ToT runs on this machine (Hydra).

One command for both ways of shaping a static draft tree; both run ToT over calibration problems
with the drafter wrapped in the calibration recorder (decoding/drafters/recorder.py):

`calibrate.method=sequoia` (Sequoia's hardware-aware tree):
1. Measures the acceptance vector: the drafter drafts a wide static tree (`calibrate.calibration`, a
   k_config shape), and the recorder counts per sibling rank how often the k-th child of a reached
   node was accepted given that the earlier ones were rejected (an empty slot counts as not
   accepted). `calibrate.drafter=stand` drafts with STAND's N-gram pools (`decoder=stand`);
   `model` with the draft model in `draft.path` (`decoder=sd`). The draft time per level too.
2. Measures what a verification forward costs here (the timer of `python -m decoding.profile_forward`;
   or reads `calibrate.profile=PATH`, a `python -m decoding.profile_forward out=PATH` file).
3. Picks the budget and depth that maximise Sequoia's speedup (decoding/trees/sequoia.py: `choose`).

`calibrate.method=prune` (STAND's data-driven tree, STAND only): STAND drafts into the 625-node
initial tree (`calibrate.prune_from`), the recorder counts how often each node was on an accepted
path, and the `calibrate.nodes` most accepted nodes are kept as a connected tree.

The tree is written as JSON ({"parents": [...], "meta": {...how it was made...}}), loadable as
`stand.tree=PATH` and (Sequoia trees) as `draft_tree.tree_policy=sequoia draft_tree.tree=PATH` (or `seed.*`).
`calibrate.from_counts=TREE` re-solves (or re-prunes) from the counts a tree file of this command
recorded, without decoding again (e.g. for another profile, such as a GPU's, or another size).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from decoding.api.engine import Engine
from decoding.base.cli import fail, hydra_command
from decoding.base.errors import BackendError, ConfigError
from decoding.base.options import from_dict
from decoding.drafters.recorder import CalibrationRecorder
from decoding.profile_forward import ProfileConfig, profile
from decoding.runtime.models import LoadedModel
from decoding.speculation.draft_tree import k_config_parents
from decoding.trees.sequoia import Choice, CostCurve, RankCounts, choose, marginal
from decoding.trees.static import StaticTree, prune
from tasks.base import DataError
from tot.runs.config import RunConfig
from tot.runs.run import build_task, make_engine, run, summary_line

DRAFTERS = {"stand": "stand", "model": "sd"}  # calibrate.drafter -> the decoder calibrated


@dataclass(frozen=True)
class CalibrateOptions:
    method: Literal["sequoia", "prune"] = "sequoia"
    drafter: Literal["stand", "model"] = "stand"
    calibration: tuple[int, ...] = (8, 2, 2)
    profile: str | None = None
    tree_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    context: int = 300
    repeats: int = 5
    batch: int = 1
    max_budget: int = 64
    max_depth: int = 8
    nodes: int = 80
    prune_from: str = "initial"
    out: str = "tree.json"
    from_counts: str | None = None

    def __post_init__(self) -> None:
        if not self.calibration or any(k < 1 for k in self.calibration):
            raise ConfigError(
                f"calibrate.calibration={list(self.calibration)} must list positive children counts per depth, "
                "e.g. [8,2,2] (the widest level sets how many sibling ranks are measured)"
            )
        for key in ("context", "repeats", "batch", "max_budget", "max_depth", "nodes"):
            if getattr(self, key) < 1:
                raise ConfigError(f"calibrate.{key}={getattr(self, key)} must be a positive integer")
        if not self.tree_sizes or any(t < 1 for t in self.tree_sizes):
            raise ConfigError(f"calibrate.tree_sizes={list(self.tree_sizes)} must list positive tree sizes")
        if self.method == "prune" and self.drafter != "stand":
            raise ConfigError(
                "calibrate.method=prune prunes STAND's initial tree: set calibrate.drafter=stand "
                "(or calibrate.method=sequoia for a draft model)"
            )


# --- calibration -----------------------------------------------------------------------------------------


def calibration_config(cfg: DictConfig, opts: CalibrateOptions, run_dir: Path) -> DictConfig:
    """The run's config with the drafter's decoder drafting the wide calibration tree."""
    cfg = cfg.copy()
    name = DRAFTERS[opts.drafter]
    OmegaConf.update(cfg, "decoder.name", name)
    # Counts are of the calibration shape's nodes: no step planner choosing which rows draft and
    # which nodes are verified (that would count its choices, not the drafter's acceptance).
    OmegaConf.update(cfg, "verify.plan", "fixed")
    if opts.method == "prune":
        OmegaConf.update(cfg, "stand.tree", opts.prune_from)
    elif name == "stand":
        path = run_dir / "calibration_tree.json"
        run_dir.mkdir(parents=True, exist_ok=True)
        StaticTree(tuple(k_config_parents(opts.calibration)), {"made_by": "sequoia calibration"}).save(path)
        OmegaConf.update(cfg, "stand.tree", str(path))
    else:
        if not OmegaConf.select(cfg, "draft.path"):
            raise ConfigError(
                "calibrate.drafter=model measures a draft model: set draft.path=<model sharing the target's "
                "tokenizer> (or draft.path=self)"
            )
        OmegaConf.update(cfg, "draft_tree.k_config", list(opts.calibration))
        OmegaConf.update(cfg, "draft_tree.tree_policy", "k_config")
        OmegaConf.update(cfg, "draft_tree.multi_candidate", True)
    return cfg


def calibrate(
    run_cfg: RunConfig, engine: Engine, opts: CalibrateOptions, run_dir: Path, progress: bool = True
) -> tuple[CalibrationRecorder, dict]:
    """ToT over the calibration problems with the drafter recorded: (the recorder, the run's summary)."""
    decoder = engine.decoder
    recorder = CalibrationRecorder(decoder.drafter, opts.calibration if opts.method == "sequoia" else None)
    decoder.drafter = recorder
    summary = run(run_cfg, run_dir, engine=engine, progress=progress)
    if not recorder.steps:
        raise ConfigError(
            f"nothing was drafted over {summary['n_problems']} problems (already done in {run_dir}?); "
            "use a new hydra.run.dir or more problems (data.limit)"
        )
    return recorder, summary


# --- costs and the tree ----------------------------------------------------------------------------------


def read_profile(path: str, batch: int) -> tuple[CostCurve, list[dict]]:
    try:
        rows = json.loads(Path(path).read_text())["rows"]
        return CostCurve.from_profile(rows, batch), rows
    except FileNotFoundError:
        raise ConfigError(
            f"calibrate.profile={path} does not exist; write one with python -m decoding.profile_forward out={path}"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"calibrate.profile={path} is not a usable decoding.profile_forward file ({e}); "
            f"rerun python -m decoding.profile_forward batch_sizes=[{batch}] out={path}, or set sequoia.batch"
        ) from None


def measure_profile(
    engine: Engine, opts: CalibrateOptions, run_cfg: RunConfig, run_dir: Path
) -> tuple[CostCurve, list[dict]]:
    pcfg = ProfileConfig(run_cfg.model, opts.tree_sizes, (opts.batch,), opts.context, opts.repeats, None)
    rows = profile(pcfg, engine.target)
    (run_dir / "profile.json").write_text(json.dumps({"model": run_cfg.model.path, "rows": rows}, indent=2) + "\n")
    return CostCurve.from_profile(rows, opts.batch), rows


@dataclass
class Made:
    tree: StaticTree
    choice: Choice
    ar_ms: float | None
    accept: list[float] = field(default_factory=list)


def make_tree(
    counts: RankCounts, draft_ms: float, curve: CostCurve, opts: CalibrateOptions, source: str, meta: dict
) -> Made:
    """Sequoia's hardware-aware tree from measured counts and costs, with how it was made in its meta."""
    accept = counts.accept_vector()
    if not any(accept):
        raise ConfigError("no drafted token was accepted during calibration: there is nothing to build a tree from")
    budget = min(opts.max_budget, curve.tokens[-1] - 1)
    try:
        table = choose(accept, curve, draft_ms, budget, opts.max_depth)
    except ValueError as e:
        raise ConfigError(
            f"calibrate.profile: {e}; measure sizes from 1 (python -m decoding.profile_forward)"
        ) from None
    best = table.best
    ar_ms = curve(1) if curve.covers(1) else None
    ranked: dict[tuple[int, ...], Choice] = {}  # the distinct trees, fastest first
    for c in sorted(table.rows, key=lambda c: -c.tokens_per_ms):
        ranked.setdefault(c.tree.parents, c)
    meta = {
        **meta,
        "accept": [round(a, 6) for a in accept],
        "accept_meaning": "per sibling rank: P(the k-th child is accepted | the earlier ones were rejected)",
        "sequoia_p": [round(p, 6) for p in marginal(accept)],
        "counts": {"tried": counts.tried, "accepted": counts.accepted},
        "budget": best.budget,
        "depth": best.depth,
        "nodes": len(best.tree),
        "tree_depth": best.tree.depth,
        "expected_tokens": round(best.tree.expected_tokens, 6),
        "expected_accepted": round(best.tree.expected_accepted, 6),
        "cost_model": {
            "formula": "maximise G / (depth * draft_ms_per_level + verify_ms(nodes + 1)) (Sequoia section 4.1)",
            "draft_ms_per_level": round(draft_ms, 4),
            "verify": {"source": source, "batch": curve.batch, "tree_tokens": list(curve.tokens), "ms": list(curve.ms)},
            "step_ms": round(best.step_ms, 3),
            "predicted_tokens_per_s": round(1000 * best.tokens_per_ms, 2),
            "predicted_speedup_vs_one_token_steps": None if ar_ms is None else round(best.speedup_vs(ar_ms), 3),
        },
        "best_candidates": [
            {
                "budget": c.budget,
                "depth": c.depth,
                "nodes": len(c.tree),
                "expected_tokens": round(c.tree.expected_tokens, 4),
                "step_ms": round(c.step_ms, 2),
            }
            for c in list(ranked.values())[:8]
        ],
    }
    return Made(StaticTree(best.tree.parents, meta), best, ar_ms, accept)


def from_counts(source: Path, opts: CalibrateOptions) -> Made:
    """Re-solve from what a tree file of this command recorded (no decoding)."""
    meta = dict(StaticTree.load(str(source), key="calibrate.from_counts").meta)
    try:
        counts = RankCounts(list(meta["counts"]["tried"]), list(meta["counts"]["accepted"]))
        draft_ms = float(meta["cost_model"]["draft_ms_per_level"])
        verify = meta["cost_model"]["verify"]
    except (KeyError, TypeError):
        raise ConfigError(
            f"calibrate.from_counts={source} has no recorded counts; give a tree written by this command"
        ) from None
    if opts.profile:
        curve, _ = read_profile(opts.profile, opts.batch)
        where = opts.profile
    else:
        curve = CostCurve(tuple(verify["tree_tokens"]), tuple(verify["ms"]), int(verify["batch"]))
        where = f"{verify['source']} (recorded in {source})"
    keep = {k: v for k, v in meta.items() if k in ("made_by", "drafter", "model", "draft", "task", "data", "search")}
    return make_tree(counts, draft_ms, curve, opts, where, {**keep, "resolved_from": str(source)})


def build(
    cfg: DictConfig,
    run_dir: Path,
    target: LoadedModel | None = None,
    draft: LoadedModel | None = None,
    progress: bool = True,
) -> tuple[Made, dict]:
    """The whole command on a composed config; `target` / `draft`: models already loaded (tests)."""
    opts = read_options(cfg)
    if opts.from_counts:
        return from_counts(Path(opts.from_counts), opts), {}
    run_cfg = RunConfig.from_omegaconf(calibration_config(cfg, opts, run_dir))
    if opts.profile:  # read before any model is loaded: a bad file fails at once
        curve, _ = read_profile(opts.profile, opts.batch)
        source = opts.profile
    if target is None:
        engine = make_engine(run_cfg)
    else:
        engine = Engine(target, run_cfg.decoder, draft if run_cfg.decoder.draft else None)
    if not opts.profile:
        run_dir.mkdir(parents=True, exist_ok=True)
        curve, _ = measure_profile(engine, opts, run_cfg, run_dir)
        source = f"measured here ({run_dir / 'profile.json'}), median of {opts.repeats}, context {opts.context}"
    recorder, summary = calibrate(run_cfg, engine, opts, run_dir, progress)
    dec = run_cfg.decoder
    if run_cfg.gen.temperature == 0 or dec.verify.coupled:  # coupled drafts are chosen, not drawn
        draw = "top"
    else:
        draw = (
            dec.draft_tree.draw
            if opts.drafter == "model"
            else ("without_replacement" if dec.section("stand").stochastic else "top")
        )
    meta = {
        "made_by": "python -m tuning.calibrate_tree calibrate.method=sequoia",
        "date": datetime.date.today().isoformat(),
        "drafter": opts.drafter,
        "decoder": run_cfg.decoder.name,
        "draw": draw,  # how siblings were drawn (decoding/speculation/acceptance.py): the rates hold for this rule
        "rule": dec.verify.rule,
        "model": run_cfg.model.path,
        "draft": None if run_cfg.decoder.draft is None else run_cfg.decoder.draft.path,
        "calibration": list(opts.calibration),
        "calibration_steps": recorder.steps,
        "calibration_acceptance_length": summary["acceptance_length"],
        "task": run_cfg.task,
        "data": {"path": run_cfg.data.path, "offset": run_cfg.data.offset, "limit": run_cfg.data.limit},
        "temperature": run_cfg.gen.temperature,
        "search": search_meta(run_cfg),
    }
    return make_tree(recorder.ranks, recorder.draft_ms_per_level, curve, opts, source, meta), summary


def report(made: Made) -> list[str]:
    meta = made.tree.meta
    cost = meta["cost_model"]
    accept = " ".join(f"{a:.3f}" for a in made.accept)
    lines = [
        f"acceptance by sibling rank (given the earlier ones rejected): {accept} "
        f"({meta['counts']['tried'][0]} trials at rank 1)",
        f"verification cost at batch {cost['verify']['batch']}: "
        + ", ".join(f"T={t} {ms:.1f} ms" for t, ms in zip(cost["verify"]["tree_tokens"], cost["verify"]["ms"])),
        f"chosen: budget {meta['budget']}, depth {meta['depth']} -> {meta['nodes']} nodes, depth "
        f"{meta['tree_depth']}, expected {meta['expected_tokens']:.3f} tokens per step; "
        f"{cost['step_ms']:.1f} ms per step ({cost['draft_ms_per_level']:.2f} ms per draft level) = "
        f"{cost['predicted_tokens_per_s']:.1f} tok/s predicted"
        + (
            ""
            if cost["predicted_speedup_vs_one_token_steps"] is None
            else f", {cost['predicted_speedup_vs_one_token_steps']:.2f}x one-token steps"
        ),
    ]
    return lines


def read_options(cfg: DictConfig) -> CalibrateOptions:
    return from_dict(CalibrateOptions, OmegaConf.to_container(cfg.calibrate, resolve=True), "calibrate")


def build_pruned(
    cfg: DictConfig, run_dir: Path, target: LoadedModel | None = None, progress: bool = True
) -> tuple[StaticTree, dict]:
    """`calibrate.method=prune` on a composed config: STAND's data-driven tree (`target`: loaded already)."""
    opts = read_options(cfg)
    if opts.from_counts:
        return reprune(Path(opts.from_counts), opts.nodes), {}
    run_cfg = RunConfig.from_omegaconf(calibration_config(cfg, opts, run_dir))
    engine = make_engine(run_cfg) if target is None else Engine(target, run_cfg.decoder)
    recorder, summary = calibrate(run_cfg, engine, opts, run_dir, progress)
    if not recorder.hits:
        raise ConfigError(
            f"no draft was accepted over {summary['n_problems']} problems (already done in {run_dir}?); "
            "use a new hydra.run.dir or more problems (data.limit)"
        )
    shape = StaticTree.load(opts.prune_from, key="calibrate.prune_from")
    meta = {
        "made_by": "python -m tuning.calibrate_tree calibrate.method=prune",
        "date": datetime.date.today().isoformat(),
        "initial_tree": opts.prune_from,
        "initial_nodes": len(shape),
        "nodes": opts.nodes,
        "model": run_cfg.model.path,
        "task": run_cfg.task,
        "data": {"path": run_cfg.data.path, "offset": run_cfg.data.offset, "limit": run_cfg.data.limit},
        "temperature": run_cfg.gen.temperature,
        "search": search_meta(run_cfg),
        "acceptance_length": summary["acceptance_length"],
        "hits": {str(i): h for i, h in sorted(recorder.hits.items())},
    }
    return prune(shape, recorder.hits, opts.nodes, meta), summary


def reprune(source: Path, nodes: int) -> StaticTree:
    """Cut a tree this command pruned to another size from the hit counts recorded in it, without
    decoding again (how the shipped default was sized for this machine's measured costs)."""
    meta = dict(StaticTree.load(str(source), key="calibrate.from_counts").meta)
    if "hits" not in meta or "initial_tree" not in meta:
        raise ConfigError(f"calibrate.from_counts={source} has no recorded hits; give a tree pruned by this command")
    hits = {int(k): int(v) for k, v in meta["hits"].items()}
    return prune(
        StaticTree.load(meta["initial_tree"]), hits, nodes, {**meta, "nodes": nodes, "repruned_from": str(source)}
    )


@hydra_command("calibrate_tree", groups=("task", "search", "decoder", "model"))
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        if read_options(cfg).method == "prune":
            tree, summary = build_pruned(cfg, run_dir)
            lines = []
        else:
            made, summary = build(cfg, run_dir)
            tree, lines = made.tree, report(made)
        out = Path(str(cfg.calibrate.out))
        out.parent.mkdir(parents=True, exist_ok=True)
        tree.save(out)
    except (ConfigError, DataError, BackendError) as e:
        fail(str(e).splitlines()[0])
    if summary:
        print("calibration: " + summary_line(summary))
    for line in lines:
        print(line)
    print(
        f"tree of {len(tree)} nodes written to {out} "
        f"(stand.tree={out}, or draft_tree.tree_policy=sequoia draft_tree.tree={out})"
    )


if __name__ == "__main__":
    main()


def search_meta(run_cfg: RunConfig) -> dict[str, int]:
    """The search a tree was calibrated under, for its meta (the depth as the task resolved it)."""
    return {"name": run_cfg.search, **asdict(run_cfg.search_settings), "depth": build_task(run_cfg).depth}
