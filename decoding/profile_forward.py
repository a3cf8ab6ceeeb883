"""`python -m decoding.profile_forward`: what one verification forward costs on this machine (Hydra).

Times one target forward that scores a draft tree of T tokens for each of B rows after a committed
context, for every (T, B) asked, as the decoders call it (ModelRunner over a row KV cache), and
prints ms per forward with the ratio to T=1, B=1 and the step planner's fitted cost (its profile
of this machine, decoding/speculation/cost.py, made now if it is not cached); then, with `split=true`,
where each forward's time goes (linears, attention, LM head, the rest, read from torch.profiler). On a
CPU each cell's floor is a timed read of the weights, and 1 x 1 is also timed right after each of 30
such reads: its share of the memory's rate where that rate moves between runs.
Tree-shape and schedule choices (Sequoia's hardware-aware budget, PCT's s_d / s_t, SEED's verify
batch) read these measured costs rather than typed-in ones. `out=PATH` also writes the rows as JSON.
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from decoding.base.cli import fail, hydra_command
from decoding.base.errors import BackendError, ConfigError
from decoding.base.options import as_int
from decoding.runtime import kernels
from decoding.runtime.models import cache_root, load_model
from decoding.runtime.pretrained import pretrained
from decoding.runtime.quant import INT8_FORMATS, Int4Linear, Q8Linear, takes_int8, use_k_block
from decoding.runtime.runner import ModelRunner
from decoding.runtime.spec import ModelSpec
from decoding.runtime.time_split import PARTS, gpu_busy, time_split
from decoding.speculation.cost import ForwardCost, forward_cost
from decoding.speculation.timing import filled, timed_ms, verification

# One timed forward's measures (JSON-shaped: the rows `out=PATH` writes).
Row = dict[str, Any]


@dataclass(frozen=True)
class ProfileConfig:
    model: ModelSpec
    tree_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context: int
    repeats: int
    out: str | None
    split: bool = True
    siblings: int = 1
    shared: int = 0
    k_blocks: tuple[int, ...] = ()  # int8 activations' inputs per scale on K-quant layers to compare (32, 256)

    def __post_init__(self) -> None:
        for key, values in (("tree_sizes", self.tree_sizes), ("batch_sizes", self.batch_sizes)):
            if not values or any(v < 1 for v in values):
                raise ConfigError(f"{key}={list(values)} must be a non-empty list of positive integers")
        if not isinstance(self.split, bool):
            raise ConfigError(f"split={self.split!r} must be true or false")
        if any(k not in INT8_FORMATS.values() for k in self.k_blocks):
            raise ConfigError(
                f"k_blocks={list(self.k_blocks)} must list {' or '.join(map(str, INT8_FORMATS.values()))}"
            )
        if self.context < 1 or self.repeats < 1:
            raise ConfigError(f"context={self.context} and repeats={self.repeats} must be positive integers")
        if self.siblings < 1 or not 0 <= self.shared <= self.context:
            raise ConfigError(
                f"siblings={self.siblings} must be at least 1 and shared={self.shared} between 0 and "
                f"context={self.context}"
            )

    @classmethod
    def from_omegaconf(cls, cfg: DictConfig) -> ProfileConfig:
        c = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's is a dict
        return cls(
            model=ModelSpec.from_config(c["model"]),
            tree_sizes=tuple(as_int("tree_sizes", v) for v in _list("tree_sizes", c["tree_sizes"])),
            batch_sizes=tuple(as_int("batch_sizes", v) for v in _list("batch_sizes", c["batch_sizes"])),
            context=as_int("context", c["context"]),
            repeats=as_int("repeats", c["repeats"]),
            out=c.get("out"),
            split=c.get("split", True),
            siblings=as_int("siblings", c.get("siblings", 1)),
            shared=as_int("shared", c.get("shared", 0)),
            k_blocks=tuple(as_int("k_blocks", v) for v in _list("k_blocks", c.get("k_blocks") or [])),
        )

    @property
    def reads(self) -> tuple[str, ...]:
        """How the rows read their context: per row; with siblings also shared by each group, and from
        rows of their own holding copies (model.paged_kv=false's cache)."""
        return ("copies", "per row", "shared") if self.siblings > 1 and self.shared else ("per row",)


def _list(key: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{key}={value!r} must be a list such as [1,4,16,64]")
    return value


def compare_k_blocks(cfg: ProfileConfig, model: torch.nn.Module) -> list[Row]:
    """Each cell's forward with the int8 kernel's K-quant layers at each of `cfg.k_blocks` inputs per
    activation scale (the model, then copies of it, `quant.use_k_block`), the formats alternated within
    each of `repeats` rounds so that the machine's drift falls on both: ms per format, median and least."""
    runners: dict[int, ModelRunner] = {}
    for k_block in cfg.k_blocks:
        copy_ = copy.deepcopy(model) if runners else model
        use_k_block(copy_, k_block)
        runners[k_block] = ModelRunner(copy_)
    prompts = {k: filled(r, cfg.context) for k, r in runners.items()}
    rows: list[Row] = []
    for batch in cfg.batch_sizes:
        for size in cfg.tree_sizes:
            steps = {k: verification(r, cfg.context, size, batch, 1, 0, prompts[k]) for k, r in runners.items()}
            times: dict[int, list[float]] = {k: [] for k in runners}
            for i in range(cfg.repeats):
                for k in list(runners)[:: 1 if i % 2 == 0 else -1]:
                    times[k] += timed_ms(steps[k], 1)
            row: Row = {"batch": batch, "tree_tokens": size, "context": cfg.context, "reads": "per row"}
            row["ms_by_k_block"] = {k: statistics.median(t) for k, t in times.items()}
            row["ms_min_by_k_block"] = {k: min(t) for k, t in times.items()}
            rows.append(row)
    return rows


def k_block_cell(row: Row) -> str:
    """ms of each format (median, least) and the first's over the last (median)."""
    ms, least = row["ms_by_k_block"], row["ms_min_by_k_block"]
    first, last = ms[next(iter(ms))], ms[list(ms)[-1]]
    return " / ".join(f"{ms[k]:.1f} ({least[k]:.1f})" for k in ms) + f" ms, {first / last:.2f}x"


def _repeated(step: Callable[[], object], n: int) -> list[object]:
    return [step() for _ in range(n)]


def profile(cfg: ProfileConfig, target: ModelRunner, copies: ModelRunner | None = None) -> list[Row]:
    """Each cell's forward timed; `copies`: the same model with rows of their own, for the "copies" reads."""
    rows: list[Row] = []
    prompts = {id(r): filled(r, cfg.context) for r in (target, copies) if r is not None}  # computed once
    for batch in cfg.batch_sizes:
        for size in cfg.tree_sizes:
            for reads in cfg.reads:  # in lockstep: a shared forward beside the same forward read per row
                if reads == "copies" and copies is None:
                    continue
                siblings = cfg.siblings if reads == "shared" else 1
                runner = copies if reads == "copies" and copies is not None else target
                step = verification(runner, cfg.context, size, batch, siblings, cfg.shared, prompts[id(runner)])
                times = timed_ms(step, cfg.repeats, target.device)
                row: Row = {"batch": batch, "tree_tokens": size, "ms": statistics.median(times), "ms_min": min(times)}
                row |= {"context": cfg.context, "reads": reads}
                if cfg.split and target.device.type == "cuda":
                    row["gpu_busy"] = gpu_busy(functools.partial(_repeated, step, cfg.repeats))[1]
                elif cfg.split:
                    row["split"] = time_split(target.model, step, cfg.repeats, row["ms"])
                rows.append(row)
    one = (1, 1, "per row")
    base = next((r["ms"] for r in rows if (r["batch"], r["tree_tokens"], r["reads"]) == one), rows[0]["ms"])
    for r in rows:
        r["relative"] = r["ms"] / base
    return rows


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a large device-to-device copy moves (read plus written): what memory-bound
    work can reach on this GPU, measured rather than taken from a datasheet."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device).normal_()  # 1 GiB
    dst = torch.empty_like(src)
    ms = statistics.median(timed_ms(lambda: dst.copy_(src), 10, device))
    return 2 * src.numel() * src.element_size() / (ms / 1000)


PAIRS = 30  # forwards of 1 x 1 timed each right after a read of the weights


def weights_read(tensors: list[torch.Tensor]) -> tuple[Callable[[], object], int]:
    """A read of `tensors` on the CPU's threads (each reduced to its largest 32-bit word: a pass the
    memory bounds, not the arithmetic), and the bytes it reads."""
    words = [
        t.reshape(-1).view(torch.uint8)[: t.numel() * t.element_size() // 4 * 4].view(torch.int32) for t in tensors
    ]
    return (lambda: [w.amax() for w in words if w.numel()]), sum(w.numel() * 4 for w in words)


def read_bandwidth(tensors: list[torch.Tensor]) -> float:
    """Bytes per second a timed read of `tensors` moves, median of 5 after a warm-up: the rate a forward
    that reads them whole can reach at best."""
    read, nbytes = weights_read(tensors)
    return nbytes / (statistics.median(timed_ms(read, 5)) / 1000)


def forward_over_read(step: Callable[[], object], tensors: list[torch.Tensor], pairs: int) -> float:
    """A forward's time over a read of the weights it reads whole, the two timed back to back `pairs`
    times (median of the ratios): its share of the memory's rate where that rate moves between runs
    (a machine shared with others), which a floor read once, apart from the forwards, does not catch."""
    read, _ = weights_read(tensors)
    read()  # warm-ups
    step()
    ratios = []
    for _ in range(pairs):
        r = _once(read)
        ratios.append(_once(step) / r)
    return statistics.median(ratios)


def _once(call: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def forward_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What a forward reads whole: each parameter and buffer once (shared storage once), except the
    input embedding's table where no head multiplies by it (a forward reads one row a token), an int8
    head's kept matrix (quant.Q8Linear: EDD's, not the forward's) and a 4-bit layer's unpacked codes
    (quant.Int4Linear: what `dequantized` reads; the kernels read the packed ones)."""
    lm = pretrained(model)
    head = lm.get_output_embeddings()
    table = cast(torch.Tensor, lm.get_input_embeddings().weight)
    skip = {id(head.weight)} if isinstance(head, Q8Linear) else set()
    skip |= {id(m.codes) for m in model.modules() if isinstance(m, Int4Linear)}  # dequantized()'s copy
    if not (isinstance(head, torch.nn.Linear) and head.weight.data_ptr() == table.data_ptr()):
        skip.add(id(table))
    seen: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in skip and t.numel() and t.is_contiguous():
            seen.setdefault(t.data_ptr(), t)
    return list(seen.values())


def add_floor(rows: list[Row], model: torch.nn.Module, bandwidth: float) -> None:
    """The least time a forward can take here: reading what it reads whole once (`forward_tensors`)
    and each row's cached keys and values over the context, at `bandwidth`."""
    weights = sum(t.numel() * t.element_size() for t in forward_tensors(model))
    c = pretrained(model).config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_position = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * next(model.parameters()).element_size()
    for r in rows:
        r["floor_ms"] = 1000 * (weights + r["batch"] * r["context"] * per_position) / bandwidth


def table(rows: list[Row], cell: Callable[[Row], str] | None = None) -> str:
    """Batch by tree tokens, each cell `cell(row)` (default: ms, ratio to 1 x 1, fitted, floor)."""
    sizes = sorted({r["tree_tokens"] for r in rows})
    lines = ["| batch | " + " | ".join(f"T={t}" for t in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for batch in sorted({r["batch"] for r in rows}):
        for reads in dict.fromkeys(r["reads"] for r in rows):
            cells = {r["tree_tokens"]: r for r in rows if r["batch"] == batch and r["reads"] == reads}
            label = f"{batch}" if reads == "per row" else f"{batch}, {reads}"
            lines.append(f"| {label} | " + " | ".join((cell or _cell)(cells[t]) for t in sizes) + " |")
    return "\n".join(lines)


def sharing_table(rows: list[Row], siblings: int, shared: int) -> str:
    """Each forward with its siblings' shared context read once beside the same forward read per row
    (paged, each row its own blocks) and from rows of their own holding copies (where measured)."""
    lines = [
        f"\nrows in groups of {siblings} sharing their first {shared} positions: read once per group, beside "
        "read per row and from rows of their own holding copies (the same forward, timed in lockstep)",
        "| batch x T | copies ms | per row ms | shared ms | speed-up on copies | attention copies / per row / "
        "shared ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["reads"] != "shared":
            continue
        same = {b["reads"]: b for b in rows if (b["batch"], b["tree_tokens"]) == (r["batch"], r["tree_tokens"])}
        cells = [same.get(k) for k in ("copies", "per row", "shared")]
        ms = [f"{c['ms']:.1f}" if c else "-" for c in cells]
        attn = [f"{c['ms'] * c['split']['attention']:.1f}" if c and "split" in c else "-" for c in cells]
        base = cells[0] or cells[1]
        assert base is not None
        speed_up = base["ms"] / r["ms"]
        lines.append(f"| {r['batch']} x {r['tree_tokens']} | {' | '.join(ms)} | {speed_up:.2f}x | {' / '.join(attn)} |")
    return "\n".join(lines)


def _cell(row: Row) -> str:
    fitted = f", fitted {row['fitted_ms']:.1f}" if "fitted_ms" in row else ""
    floor = f", floor {row['floor_ms']:.2f}" if "floor_ms" in row else ""
    return f"{row['ms']:.2f} ms ({row['relative']:.2f}x{fitted}{floor})"


def add_fitted(rows: list[Row], cost: ForwardCost) -> None:
    """The step planner's cost model (decoding/speculation/cost.py) beside each measured forward."""
    for r in rows:
        b, t = r["batch"], r["tree_tokens"]
        r["fitted_ms"] = float(cost.ms(b, b * t, t, r["context"])) / cost.correction


def split_table(rows: list[Row]) -> str:
    """ms per forward in each part: the profiled fractions applied to the unprofiled median."""
    lines = ["| batch x T | ms | " + " | ".join(PARTS) + " |", "|---" * (len(PARTS) + 2) + "|"]
    for r in rows:
        parts = " | ".join(f"{r['ms'] * r['split'][p]:.1f} ({100 * r['split'][p]:.0f}%)" for p in PARTS)
        reads = "" if r["reads"] == "per row" else f", {r['reads']}"
        lines.append(f"| {r['batch']} x {r['tree_tokens']}{reads} | {r['ms']:.1f} | {parts} |")
    return "\n".join(lines)


def int4_macs_per_token(model: torch.nn.Module) -> int:
    """Multiply-adds a token costs in the model's 4-bit layers (GGUF weights)."""
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Int4Linear))


def print_int4_rate(rows: list[Row], model: torch.nn.Module, about: dict[str, Any]) -> None:
    """The 4-bit layers' multiply-adds a second in each forward ("linears" holds only them in a GGUF
    model: its LM head is counted apart), and with int8 activations what a tight loop of the kernel's
    integer instructions reaches here, so the kernel's rate reads as a share of it."""
    macs = int4_macs_per_token(model)
    rows = [r for r in rows if r["split"]["linears"] > 0]
    if not macs or not rows:
        return
    for r in rows:
        r["int4_gmacs"] = macs * r["batch"] * r["tree_tokens"] / (r["ms"] * r["split"]["linears"] / 1000) / 1e9
    line = "4-bit layers, G multiply-adds a second: " + ", ".join(
        f"{r['batch']} x {r['tree_tokens']} {r['int4_gmacs']:.1f}" for r in rows
    )
    if any(getattr(m, "activations", "") == "int8" for m in model.modules()):
        k = kernels.load()
        peak, tiles = k.q4_int8_peak(20_000_000) / 1e9, k.q4_int8_tile_peak(1_000_000) / 1e9
        about["int8_peak_gmacs"], about["int8_path"] = peak, k.q4_int8_path()
        best = max(r["int4_gmacs"] for r in rows)
        line += f"; a tight loop of its vector integer dot products {peak:.1f}, so {100 * best / peak:.0f}% at best"
        if tiles:  # AMX: rows in tiles of 16 run on the tile unit, the rest on the vector dot products
            about["int8_tile_peak_gmacs"] = tiles
            line += f"; of its tile dot products ({k.q4_int8_path()}) {tiles:.1f}, so {100 * best / tiles:.0f}%"
    print(line)


@hydra_command("profile_forward", groups=("model",))
def main(cfg: DictConfig) -> None:
    try:
        pcfg = ProfileConfig.from_omegaconf(cfg)
        loaded = load_model(pcfg.model)
        if pcfg.k_blocks and not any(takes_int8(m, alone=True) for m in loaded.model.modules()):
            raise ConfigError(
                f"k_blocks={list(pcfg.k_blocks)} compares the int8 kernel's activation formats, and this model has no "
                "int8 layer: give a GGUF model on the CPU with model.activations=int8"
            )
    except (ConfigError, BackendError) as e:
        fail(str(e).splitlines()[0])
    if pcfg.k_blocks:
        print(
            f"verification forward, {loaded.source} on {loaded.device} ({torch.get_num_threads()} threads), context "
            f"{pcfg.context} tokens, {pcfg.repeats} alternated rounds: ms (least) with K-quant layers' activations a "
            f"scale per {' / '.join(map(str, pcfg.k_blocks))} inputs, and the first's time over the last's"
        )
        rows = compare_k_blocks(pcfg, loaded.model)
        print(table(rows, k_block_cell))
        if pcfg.out:
            Path(pcfg.out).write_text(json.dumps({"model": loaded.source, "rows": rows}, indent=2, default=str) + "\n")
        return
    target = ModelRunner(loaded.model, static=loaded.static, strict_graphs=loaded.strict_graphs)
    print(
        f"verification forward, {loaded.source} on {loaded.device} ({torch.get_num_threads()} threads), "
        f"context {pcfg.context} tokens, median of {pcfg.repeats}; T = tree tokens per row incl. the root"
    )
    copies = None
    if target.pool is not None and len(pcfg.reads) > 1:
        copies = ModelRunner(loaded.model, static=loaded.static, strict_graphs=loaded.strict_graphs, paged=False)
    rows = profile(pcfg, target, copies)
    cost = forward_cost(target, cache_root())
    add_fitted(rows, cost)
    about: dict[str, Any] = {"model": loaded.source, "device": str(loaded.device), "torch": torch.__version__}
    if loaded.device.type == "cuda":
        bandwidth = copy_bandwidth(loaded.device)
        add_floor(rows, target.model, bandwidth)
        about |= {"gpu": torch.cuda.get_device_name(loaded.device), "cuda": torch.version.cuda}
        about["copy_bandwidth_gb_s"] = bandwidth / 1e9
    else:
        tensors = forward_tensors(target.model)
        bandwidth = read_bandwidth(tensors)
        add_floor(rows, target.model, bandwidth)
        about["read_bandwidth_gb_s"] = bandwidth / 1e9
        about["read_mb"] = sum(t.numel() * t.element_size() for t in tensors) / 1e6
        one = verification(target, pcfg.context, 1, 1, 1, 0, filled(target, pcfg.context))
        about["one_over_read"] = forward_over_read(one, tensors, PAIRS)
    if target.static is not None:
        g = target.static.stats
        about["graphs"] = {"spec": repr(target.static.spec), **vars(g)}
        print(
            f"bucketed forwards ({'CUDA graphs' if target.static.spec.capture else 'eager'}): {g.captured} graphs "
            f"captured in {g.capture_s:.1f} s, {g.replayed} replays, {g.eager} eager, {g.unbucketed} past the buckets"
        )
    print(table(rows))
    print(f"fitted: the step planner's cost model ({cost.source})")
    if "copy_bandwidth_gb_s" in about:
        print(
            f"floor: the weights and each row's cached context read once at {about['copy_bandwidth_gb_s']:.0f} GB/s "
            f"(a device-to-device copy on {about['gpu']}, read + written)"
        )
    if "read_bandwidth_gb_s" in about:
        print(
            f"floor: the {about['read_mb']:.0f} MB a forward reads whole (forward_tensors) and each row's cached "
            f"context read once at {about['read_bandwidth_gb_s']:.1f} GB/s (a timed read of those weights on "
            f"{torch.get_num_threads()} threads)"
        )
        ratio = about["one_over_read"]
        print(
            f"1 x 1 against that read, each timed right after it ({PAIRS} pairs, median): {ratio:.3f}x, "
            f"{100 / ratio:.0f}% of the memory's rate (where the rate moves between runs, the floor above can miss it)"
        )
    if pcfg.split and loaded.device.type == "cuda":
        print("\nthe share of each forward's wall time the GPU runs kernels (torch.profiler; the rest is the host)")
        print(table(rows, lambda r: f"{100 * r['gpu_busy']:.0f}%"))
    elif pcfg.split:
        print("\nwhere the time goes (ms, torch.profiler's shares of the median above)")
        print(split_table(rows))
        print_int4_rate(rows, target.model, about)
    if len(pcfg.reads) > 1:
        print(sharing_table(rows, pcfg.siblings, pcfg.shared))
    if pcfg.out:
        Path(pcfg.out).write_text(json.dumps({**about, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
