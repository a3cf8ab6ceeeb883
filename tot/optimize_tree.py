"""`python -m tot.optimize_tree`: STAND's data-driven draft tree, made from ToT runs (Hydra).

Runs the ToT search with `decoder=stand` on a large initial tree (the 625-node tree of STAND's
appendix by default) over calibration problems, counts how often each tree node lies on an
accepted path, keeps the `optimize.nodes` best as a connected tree and writes it as JSON together
with how it was made. Load it with `stand.tree=PATH`.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from decoding.cli import check_overrides, fail, quiet_transformers
from decoding.config import as_int
from decoding.errors import BackendError
from decoding.stand import NGramDrafter, StaticTree, prune
from tasks.base import DataError
from tot.config import ConfigError, RunConfig
from tot.run import make_engine, run, summary_line


def optimize(cfg: RunConfig, nodes: int, out: Path, run_dir: Path, progress: bool = True) -> dict:
    if cfg.decoder.name != "stand":
        raise ConfigError(f"decoder={cfg.decoder.name}: tree optimisation counts accepted nodes of decoder=stand")
    engine = make_engine(cfg)
    drafter = engine.decoder.drafter
    assert isinstance(drafter, NGramDrafter)
    summary = run(cfg, run_dir, engine=engine, progress=progress)
    if not drafter.node_hits:
        raise ConfigError(
            f"no draft was accepted over {summary['n_problems']} problems (already done in {run_dir}?); "
            "use a new hydra.run.dir or more problems (data.limit)"
        )
    meta = {
        "made_by": "python -m tot.optimize_tree",
        "date": datetime.date.today().isoformat(),
        "initial_tree": cfg.decoder.stand.tree,
        "initial_nodes": len(drafter.tree),
        "nodes": nodes,
        "model": cfg.model.path,
        "task": cfg.task,
        "data": {"path": cfg.data.path, "offset": cfg.data.offset, "limit": cfg.data.limit},
        "temperature": cfg.gen.temperature,
        "search": {"n_thoughts": cfg.bfs.n_thoughts, "breadth": cfg.bfs.breadth, "depth": cfg.depth},
        "acceptance_length": summary["acceptance_length"],
        "hits": {str(i): h for i, h in sorted(drafter.node_hits.items())},
    }
    tree = prune(drafter.tree, drafter.node_hits, nodes, meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    tree.save(out)
    return summary | {"tree": str(out), "tree_nodes": len(tree)}


def reprune(source: Path, nodes: int, out: Path) -> StaticTree:
    """Cut a tree this command wrote to another size from the hit counts recorded in it, without
    decoding again (how the shipped default was sized for this machine's measured costs)."""
    made = StaticTree.load(str(source))
    meta = dict(made.meta)
    if "hits" not in meta or "initial_tree" not in meta:
        raise ConfigError(f"optimize.from_hits={source} has no recorded hits; give a tree written by this command")
    initial = StaticTree.load(meta["initial_tree"])
    hits = {int(k): int(v) for k, v in meta["hits"].items()}
    meta["nodes"] = nodes
    meta["repruned_from"] = str(source)
    tree = prune(initial, hits, nodes, meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    tree.save(out)
    return tree


@hydra.main(config_path="pkg://conf", config_name="optimize_tree", version_base="1.3")
def main(cfg: DictConfig) -> None:
    quiet_transformers()
    try:
        run_cfg = RunConfig.from_omegaconf(cfg)
        opt = OmegaConf.to_container(cfg.optimize, resolve=True)
        nodes = as_int("optimize.nodes", opt["nodes"])
        if nodes < 1:
            raise ConfigError(f"optimize.nodes={nodes} must be a positive integer")
        out = Path(str(opt["out"]))
        if opt.get("from_hits"):
            tree = reprune(Path(str(opt["from_hits"])), nodes, out)
            print(f"tree of {len(tree)} nodes written to {out}")
            return
        summary = optimize(run_cfg, nodes, out, Path(HydraConfig.get().runtime.output_dir))
    except (ConfigError, DataError, BackendError) as e:
        fail(str(e).splitlines()[0])
    print(summary_line(summary))
    print(f"tree of {summary['tree_nodes']} nodes written to {summary['tree']}")


def cli() -> None:
    check_overrides(sys.argv[1:], "optimize_tree", ("task", "search", "decoder", "model"))
    main()


if __name__ == "__main__":
    cli()
