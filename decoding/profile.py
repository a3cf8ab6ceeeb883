"""`python -m decoding.profile`: what one verification forward costs on this machine (Hydra).

Times one target forward that scores a draft tree of T tokens for each of B rows after a committed
context, for every (T, B) asked, and prints ms per forward with the ratio to T=1, B=1. Tree-shape
and schedule choices (Sequoia's hardware-aware budget, PCT's s_d / s_t, SEED's verify batch) read
these measured costs rather than typed-in ones. `out=PATH` also writes the rows as JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from decoding.cli import check_overrides, fail, quiet_transformers
from decoding.config import as_int
from decoding.draft_tree import DraftTree, k_config_parents
from decoding.errors import BackendError, ConfigError
from decoding.models import ModelSpec, load_model
from decoding.target import Target
from decoding.verify import pack


@dataclass(frozen=True)
class ProfileConfig:
    model: ModelSpec
    tree_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context: int
    repeats: int
    out: str | None

    def __post_init__(self) -> None:
        for key, values in (("tree_sizes", self.tree_sizes), ("batch_sizes", self.batch_sizes)):
            if not values or any(v < 1 for v in values):
                raise ConfigError(f"{key}={list(values)} must be a non-empty list of positive integers")
        if self.context < 1 or self.repeats < 1:
            raise ConfigError(f"context={self.context} and repeats={self.repeats} must be positive integers")

    @classmethod
    def from_omegaconf(cls, cfg: DictConfig) -> ProfileConfig:
        c = OmegaConf.to_container(cfg, resolve=True)
        return cls(
            model=ModelSpec(**{k: str(v) for k, v in c["model"].items() if k != "name" and v is not None}),
            tree_sizes=tuple(as_int("tree_sizes", v) for v in _list("tree_sizes", c["tree_sizes"])),
            batch_sizes=tuple(as_int("batch_sizes", v) for v in _list("batch_sizes", c["batch_sizes"])),
            context=as_int("context", c["context"]),
            repeats=as_int("repeats", c["repeats"]),
            out=c.get("out"),
        )


def _list(key: str, value: object) -> list:
    if not isinstance(value, list):
        raise ConfigError(f"{key}={value!r} must be a list such as [1,4,16,64]")
    return value


def chain_tree(size: int, vocab: int) -> DraftTree:
    """A tree of `size` nodes; its cost depends on the node count, not the shape (the mask is dense)."""
    tree = DraftTree()
    for parent in k_config_parents((1,) * size) if size else []:
        tree.add((1000 + len(tree)) % vocab, parent)
    return tree


def time_forward(target: Target, context: int, tree_size: int, batch: int, repeats: int) -> list[float]:
    """Milliseconds of each of `repeats` verification forwards (after one warm-up)."""
    capacity = context + tree_size + 2
    cache = target.new_cache(batch, capacity)
    vocab = int(target.config.vocab_size)
    prompt = [[(100 + i) % vocab for i in range(context)]] * batch
    fill = pack(prompt, [DraftTree()] * batch)
    target.forward(cache, fill.tokens, fill.see, fill.depth, logits_at=torch.tensor([context - 1]))
    cache.advance(torch.full((batch,), context))
    tree = chain_tree(tree_size - 1, vocab)  # the root (pending token) plus tree_size - 1 drafted nodes
    packed = pack([[7]] * batch, [tree] * batch)
    keep = torch.arange(0, packed.tokens.shape[1])
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        target.forward(cache, packed.tokens, packed.see, packed.depth, logits_at=keep)
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first forward warms up kernels and allocations
            times.append(1000 * (time.perf_counter() - t0))
    return times


def profile(cfg: ProfileConfig, target: Target) -> list[dict]:
    rows = []
    for batch in cfg.batch_sizes:
        for size in cfg.tree_sizes:
            times = time_forward(target, cfg.context, size, batch, cfg.repeats)
            rows.append(
                {
                    "batch": batch,
                    "tree_tokens": size,
                    "ms": statistics.median(times),
                    "ms_min": min(times),
                    "context": cfg.context,
                }
            )
    base = next((r["ms"] for r in rows if r["batch"] == 1 and r["tree_tokens"] == 1), rows[0]["ms"])
    for r in rows:
        r["relative"] = r["ms"] / base
    return rows


def table(rows: list[dict]) -> str:
    sizes = sorted({r["tree_tokens"] for r in rows})
    lines = ["| batch | " + " | ".join(f"T={t}" for t in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for batch in sorted({r["batch"] for r in rows}):
        cells = {r["tree_tokens"]: r for r in rows if r["batch"] == batch}
        lines.append(
            f"| {batch} | " + " | ".join(f"{cells[t]['ms']:.1f} ms ({cells[t]['relative']:.2f}x)" for t in sizes) + " |"
        )
    return "\n".join(lines)


@hydra.main(config_path="pkg://conf", config_name="profile", version_base="1.3")
def main(cfg: DictConfig) -> None:
    quiet_transformers()
    try:
        pcfg = ProfileConfig.from_omegaconf(cfg)
        loaded = load_model(pcfg.model)
    except (ConfigError, BackendError) as e:
        fail(str(e).splitlines()[0])
    target = Target(loaded.model)
    print(
        f"verification forward, {loaded.source} on {loaded.device} ({torch.get_num_threads()} threads), "
        f"context {pcfg.context} tokens, median of {pcfg.repeats}; T = tree tokens per row incl. the root"
    )
    rows = profile(pcfg, target)
    print(table(rows))
    if pcfg.out:
        Path(pcfg.out).write_text(json.dumps({"model": loaded.source, "rows": rows}, indent=2) + "\n")


def cli() -> None:
    check_overrides(sys.argv[1:], "profile", ("model",))
    main()


if __name__ == "__main__":
    cli()
