"""What a step costs on the running machine, as the step planner asks it (decoding/schedules/planner.py).

A target forward's time is a function of the rows it scores, the tokens it computes and the context
they attend to. `ForwardCost` is a table measured on the loaded model, its device and thread count
(`profile`: rows x tokens per row at one context, one point at a longer context for the attention
term), interpolated between its points and extended linearly past them, cached per model / device /
threads / weights under the project's cache folder, and corrected online by the ratio of each
forward's measured time to its prediction. Where the forward computes only real tokens
(`ModelRunner.ragged`) it costs the tokens the rows hold, attention included; otherwise every row
is padded to the widest row, and the table is read at rows x width.

The work around the forward (logits processing, sampling, the planner itself) is `Overhead`: a
least-squares line in rows, fitted online from each step's own times, plus a measured share per kept
draft node (`node_ms`). Drafting is charged per drafted row by the planner itself.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from decoding.base.errors import ConfigError
from decoding.runtime import kernels
from decoding.runtime.kv_cache import SHARED_BLOCK, KVCache
from decoding.runtime.runner import ModelRunner
from decoding.speculation.timing import filled, timed_ms, verification

log = logging.getLogger(__name__)

VERSION = 1  # of the cached profile's format and grid
GRID_ROWS = (1, 4, 16, 64)
GRID_TOKENS = (1, 2, 4, 8, 16)  # per row, the root included
CONTEXT = 256  # committed tokens before the scored ones (a ToT prompt is about this long)
LONG_CONTEXT = 1024
MAX_POINT_MS = 300.0  # a profile point predicted slower than this is extrapolated, not measured


def _extend(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear through (xs, ys) (xs increasing), continued linearly past both ends."""
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)  # the segment [i - 1, i], or an end's
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def _extend_each(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """`_extend` at each of x's values (the same segment and arithmetic, elementwise)."""
    if len(xs) == 1:
        return np.full(np.shape(x), float(ys[0]))
    hi = np.minimum(np.maximum(xs.searchsorted(x, side="right"), 1), len(xs) - 1)  # np.clip: 10 us a call
    lo = hi - 1
    out: np.ndarray = ys[lo] + (ys[hi] - ys[lo]) * (x - xs[lo]) / (xs[hi] - xs[lo])
    return out


@dataclass
class ForwardCost:
    """Milliseconds of one target forward: `points[r]` = [(tokens computed, ms)] at `r` rows and
    `context`; `context_ms` = ms per (token x 1000 context positions) past `context`; `shared_saving`:
    the share of that cost a position read from a sibling's row saves (siblings reading their shared
    prompt once, csrc/attention.cpp; 0 where the forward reads every row's own)."""

    points: dict[int, list[tuple[int, float]]]
    context: int = CONTEXT
    context_ms: float = 0.0
    ragged: bool = True
    shared_saving: float = 0.0
    correction: float = 1.0  # measured / predicted, a running average over the run's forwards
    source: str = "profile"

    def __post_init__(self) -> None:
        if not self.points or any(not p for p in self.points.values()):
            raise ValueError("a forward cost needs at least one measured point per row count")
        # Plain floats: the planner asks a few points every step, where numpy's per-call cost was
        # most of the answer's (0.15 ms a step).
        self._rows = [float(r) for r in sorted(self.points)]
        self._curves = [
            ([float(n) for n, _ in sorted(self.points[r])], [ms for _, ms in sorted(self.points[r])])
            for r in sorted(self.points)
        ]
        self._arrays = [(np.array(xs), np.array(ys, dtype=float)) for xs, ys in self._curves]  # for `ms_each`

    def _table(self, rows: int, tokens: Any, extend: Callable[..., Any], curves: Sequence[Any]) -> Any:
        """The profile's ms at `rows` rows computing `tokens` tokens in all: between the two profiled
        row counts around `rows`, each read at the same total tokens (log-interpolated in rows). A
        forward's linear layers cost its tokens whatever rows hold them; rows add their attention and
        bookkeeping. Read at the same tokens *per row* instead, 8 rows x 4 tokens was predicted 84 ms
        against 66 measured (the 16-row curve at 64 tokens, the 4-row one at 16). `tokens` a number read
        by `_extend` on plain lists, or an array read at each of its values by `_extend_each` (`ms_each`)."""
        if len(self._rows) == 1:
            return extend(np.maximum(tokens / rows, 1.0) * self._rows[0], *curves[0]) * (rows / self._rows[0])
        i = min(max(bisect.bisect_left(self._rows, rows) - 1, 0), len(self._rows) - 2)
        r0, r1 = self._rows[i], self._rows[i + 1]
        at0 = extend(tokens, *curves[i])
        at1 = extend(tokens, *curves[i + 1])  # below its first point: extended linearly
        if rows > self._rows[-1]:  # more rows than profiled: linear in rows from the last two
            return at1 + (at1 - at0) * (rows - r1) / (r1 - r0)
        w = (math.log(max(rows, r0)) - math.log(r0)) / (math.log(r1) - math.log(r0))
        return (1 - w) * at0 + w * at1

    def ms(self, rows: int, tokens: float, width: float, context: float) -> float:
        """Predicted ms of a forward of `rows` rows holding `tokens` real tokens in all, the widest
        `width`, attending to `context` committed positions on average."""
        computed = tokens if self.ragged else rows * width
        # A ragged forward's attention skips the pads' queries too (decoding/runtime/csrc/attention.cpp).
        attend = self.context_ms * computed * max(0.0, context - self.context) / 1000
        table: float = self._table(rows, computed, _extend, self._curves)
        return self.correction * max(table + attend, 0.0)

    def ms_each(self, rows: int, tokens: np.ndarray, widths: np.ndarray, context: float) -> np.ndarray:
        """`ms` for each (tokens, width) pair, the planner's candidate plans of one step, in one pass
        of array arithmetic: the same operations in the same order as `ms`, so the same values (a
        call per plan cost 0.2 ms of a step's 16 candidates)."""
        computed = np.asarray(tokens, dtype=float) if self.ragged else rows * np.asarray(widths, dtype=float)
        attend = self.context_ms * computed * max(0.0, context - self.context) / 1000
        table: np.ndarray = self._table(rows, computed, _extend_each, self._arrays)
        return self.correction * np.maximum(table + attend, 0.0)

    def observe(self, predicted_ms: float, measured_ms: float, weight: float = 0.05) -> None:
        """Correct the table by a running average of measured / predicted (bounded: one odd forward,
        a page fault or another process, must not swing the plan)."""
        if predicted_ms > 0 and measured_ms > 0:
            ratio = measured_ms / (predicted_ms / self.correction)
            self.correction = min(max((1 - weight) * self.correction + weight * ratio, 0.25), 4.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "points": {str(r): p for r, p in self.points.items()},
            "context": self.context,
            "context_ms": self.context_ms,
            "ragged": self.ragged,
            "shared_saving": self.shared_saving,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str) -> ForwardCost:
        points = {int(r): [(int(n), float(ms)) for n, ms in p] for r, p in data["points"].items()}
        context, context_ms, ragged = int(data["context"]), float(data["context_ms"]), bool(data["ragged"])
        saving = float(data.get("shared_saving", 0.0))  # (profiles written before it was measured: none)
        return cls(points, context, context_ms, ragged, saving, source=source)

    @classmethod
    def load(cls, path: Path) -> ForwardCost:
        """A profile written by `profile` (or by `python -m decoding.profile_forward out=...` on another
        machine: its rows are read as batch x tree_tokens)."""
        try:
            data = json.loads(Path(path).read_text())
            if "points" in data:
                return cls.from_json(data, str(path))
            points: dict[int, list[tuple[int, float]]] = {}
            for row in data["rows"]:
                b, t = int(row["batch"]), int(row["tree_tokens"])
                points.setdefault(b, []).append((b * t, float(row.get("ms_min", row["ms"]))))
            points = {b: _monotone(p) for b, p in points.items()}
            context = int(data["rows"][0].get("context", CONTEXT))
            return cls(points, context, 0.0, ragged=False, source=str(path))
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise ConfigError(
                f"verify.cost={path} is not a forward-cost profile ({type(e).__name__}: {str(e)[:80]}); "
                "write one with python -m decoding.profile_forward out=..., or set verify.cost=null"
            ) from e


def _monotone(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """More tokens never cost less: a point a burst of load slowed is lowered to the ones after it."""
    points = sorted(points)
    ms = np.minimum.accumulate(np.array([p[1] for p in points])[::-1])[::-1]
    return [(n, float(m)) for (n, _), m in zip(points, ms)]


def _time_point(target: ModelRunner, rows: int, per_row: int, prompt: KVCache, repeats: int, shared: int = 0) -> float:
    """ms of a forward over rows holding `prompt`'s positions (the fastest of the repeats: another
    process's burst only ever slows one down); with `shared`, its rows siblings reading their first
    `shared` positions once."""
    context = int(prompt.lens[0])
    step = verification(target, context, per_row, rows, rows if shared else 1, shared, prompt)
    return min(timed_ms(step, repeats, target.device))


def profile(target: ModelRunner, repeats: int = 3) -> ForwardCost:
    """Time the grid (rows x tokens per row) on `target`; points predicted slower than MAX_POINT_MS
    are left to the linear extension of the faster ones, so a slow machine profiles in seconds. Each
    context's prompt is computed once and copied into every point's rows (recomputed per point, the
    256-token prompts were most of a 1.5B's profile on 2 cores). The runner's peaks stay what its
    requests reached: a profile's 64-row forwards counted there made a ToT run's peak KV 15x its own."""
    peaks = target.peak_cache_bytes, target.peak_shared_blocks
    try:
        return _profile(target, repeats)
    finally:
        target.peak_cache_bytes, target.peak_shared_blocks = peaks


def _profile(target: ModelRunner, repeats: int) -> ForwardCost:
    points: dict[int, list[tuple[int, float]]] = {}
    # At most the grid and two long-context points; a slow machine stops early (the bar then ends there).
    bar = tqdm(total=len(GRID_ROWS) * len(GRID_TOKENS) + 2, desc="profiling the forward", unit="point", leave=False)
    prompt = filled(target, CONTEXT)
    for rows in GRID_ROWS:
        if points:  # a row count whose one-token forward would be too slow is extended from the others
            last = max(points)
            if points[last][0][1] * rows / last > MAX_POINT_MS and len(points) >= 2:
                break
        mine: list[tuple[int, float]] = []
        for per_row in GRID_TOKENS:
            n = rows * per_row
            if len(mine) >= 2:
                guess = _extend(n, [float(p[0]) for p in mine], [p[1] for p in mine])
                if guess > MAX_POINT_MS:
                    break
            mine.append((n, _time_point(target, rows, per_row, prompt, repeats)))
            bar.update()
        points[rows] = _monotone(mine)
    short = points[GRID_ROWS[1]][0][1] if GRID_ROWS[1] in points else points[1][0][1]
    rows = GRID_ROWS[1] if GRID_ROWS[1] in points else 1
    long_prompt = filled(target, LONG_CONTEXT)
    long = _time_point(target, rows, 1, long_prompt, repeats)
    bar.update()
    per = max(0.0, (long - short) / (rows * (LONG_CONTEXT - CONTEXT) / 1000))
    saving = 0.0
    if target.layers is not None and target.static is None and rows > 1 and per > 0:  # the kernel that shares
        shared = _time_point(target, rows, 1, long_prompt, repeats, shared=LONG_CONTEXT)
        from_sibling = (rows - 1) * (LONG_CONTEXT // SHARED_BLOCK * SHARED_BLOCK)  # positions, all rows
        saving = min(max((long - shared) / (per * from_sibling / 1000), 0.0), 1.0)
        bar.update()
    bar.close()
    log.info("the forward profiled at %d points in %.0f s", bar.n, bar.format_dict["elapsed"])
    return ForwardCost(points, CONTEXT, per, target.ragged, saving)


def cost_key(target: ModelRunner) -> str:
    """What a profile is valid for: the model's shape and weights format, device, CPU, threads, layout."""
    c = target.config
    # The weight format shows in the linear layers' classes (nn.Linear, Int4Linear, PrepackedLinear).
    linears = sorted({type(m).__name__ for m in target.model.modules() if "Linear" in type(m).__name__})
    # What a 4-bit layer multiplies its input as (model.activations): another kernel, another cost.
    # (with int8, its inputs per activation scale on a K-quant too: quant.INT8_FORMATS)
    quantized = [m for m in target.model.modules() if hasattr(m, "activations")]
    linears += sorted({f"{m.activations} activations {getattr(m, 'k_block', '')}" for m in quantized})
    linears += sorted({type(m).__name__ for m in target.model.modules() if "Norm" in type(m).__name__})
    parts = [
        str(getattr(c, "_name_or_path", "")),
        str(getattr(c, "hidden_size", "")),
        str(getattr(c, "num_hidden_layers", "")),
        str(getattr(c, "vocab_size", "")),
        str(target.dtype),
        ",".join(linears),
        str(target.device),
        torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "",
        str(torch.get_num_threads()),
        str(target.ragged),
        # Graphs and their buckets change what a forward of each shape costs (padding, launches).
        repr(None if target.static is None else target.static.spec),
        torch.__version__,
        str(VERSION),
        # The CPU forward runs the project's kernels: another version of them, another cost.
        kernels.source_digest() if target.device.type == "cpu" else "",
        kernels.cpu_model() if target.device.type == "cpu" else "",  # a cache outlives its machine
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def forward_cost(target: ModelRunner, cache_dir: Path | None, path: str | None = None) -> ForwardCost:
    """The loaded model's forward cost: from `path` when given, else the cached profile for this
    model / device / threads, else profiled now (a few seconds) and cached."""
    if path:
        return ForwardCost.load(Path(path))
    file = None if cache_dir is None else cache_dir / "cost" / f"{cost_key(target)}.json"
    if file is not None and file.exists():
        try:
            return ForwardCost.from_json(json.loads(file.read_text()), str(file))
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable forward-cost profile %s: profiling again", file)
    log.info("profiling the target forward for the step planner (once per model, device, CPU and threads)")
    cost = profile(target)
    if file is not None:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cost.to_json(), indent=1) + "\n")
            tmp.replace(file)
            cost.source = str(file)
        except OSError as e:  # a read-only cache folder: the profile is only this run's
            log.warning("could not cache the forward-cost profile in %s (%s)", file.parent, e)
    return cost


@dataclass
class Overhead:
    """ms of a step's work around the target forward: a + b * rows, by recursive least squares with
    forgetting over the run's steps (a prior until the first steps come), plus `node_ms` per kept
    draft node. A node's share (its logits row processed and walked) is measured, not fitted: under
    a steep curve the steps that keep nodes are rare, a per-node term fitted from them is whatever
    their noise makes it, and one that overshoots keeps them rare (it read 1.5 ms against a
    measured 0.1 and no node was kept again)."""

    a: float = 0.2  # ms a step
    b: float = 0.05  # ms a row
    node_ms: float = 0.05
    forget: float = 0.98
    # The estimate's covariance [[p00, p01], [p01, p11]] (plain floats: a 2 x 2 update every step).
    p00: float = 10.0
    p01: float = 0.0
    p11: float = 10.0

    def ms(self, rows: int, nodes: np.ndarray | int) -> np.ndarray | float:
        return max(self.a + self.b * rows, 0.0) + self.node_ms * nodes

    def observe(self, rows: int, nodes: int, measured_ms: float) -> None:
        px0, px1 = self.p00 + self.p01 * rows, self.p01 + self.p11 * rows  # P x for x = (1, rows)
        denom = self.forget + px0 + rows * px1
        k0, k1 = px0 / denom, px1 / denom
        err = measured_ms - self.node_ms * nodes - (self.a + self.b * rows)
        self.a, self.b = self.a + k0 * err, self.b + k1 * err
        self.p00 = (self.p00 - k0 * px0) / self.forget
        self.p01 = (self.p01 - k0 * px1) / self.forget
        self.p11 = (self.p11 - k1 * px1) / self.forget
        # Forgetting grows the covariance along directions the steps do not vary (a run of one-row
        # steps says nothing of the slope): bounded, so one unusual step cannot swing the fit.
        trace = self.p00 + self.p11
        if trace > 20.0:
            self.p00, self.p01, self.p11 = (v * 20.0 / trace for v in (self.p00, self.p01, self.p11))

    def as_dict(self) -> dict[str, float]:
        return {"ms": self.a, "ms_per_row": self.b, "ms_per_node": self.node_ms}


def node_ms(target: ModelRunner, repeats: int = 5) -> float:
    """ms a kept draft node adds around the forward: one more row of logits processed as a sampled
    row's are (temperature, softmax) and its token picked, timed on the target's device."""
    vocab = int(target.config.vocab_size)
    logits = torch.randn(9, vocab, device=target.device)

    def rows(n: int) -> Callable[[], object]:
        return lambda: (logits[:n] / 0.7).softmax(-1).argmax(-1).tolist()

    one, nine = (min(timed_ms(rows(n), repeats, target.device)) for n in (1, 9))
    return max(0.0, (nine - one) / 8)
