"""Where a forward's time goes (linears, attention, LM head, the rest), and how much of a GPU run's
wall time the GPU spends running kernels, read from torch.profiler."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

from decoding.runtime.pretrained import pretrained

T = TypeVar("T")

PARTS = ("linears", "attention", "lm_head", "other")
# Operators whose own time is a projection's matrix product (int4 kernel, dense, oneDNN and rows paths).
LINEAR_OPS = {
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::mkldnn_linear",
    "tot::rows_linear",
    "tot::q4_int8_linear",
    "tot::q8_int8_linear",
}
# The attention kernels: the invariant one (decoding/runtime/csrc) or torch's fused one, with callees.
ATTENTION_OPS = {"tot::attend", "aten::scaled_dot_product_attention"}
HEAD = "tot::lm_head"


def time_split(model: torch.nn.Module, step: Callable[[], object], repeats: int, plain_ms: float) -> dict[str, float]:
    """Fractions of a call of `step` (a forward of `model`, `plain_ms` long when not profiled) spent in
    each of PARTS, from `repeats` profiled calls.

    The LM head is marked by a profiler range around `model`'s output embedding while profiling;
    the matrix products inside it are taken out of `linears`. Attention is the invariant kernel or torch's
    scaled_dot_product_attention with what it calls (eager attention's matmuls count as linears).
    `other` is what `plain_ms` leaves: the profiler's own cost (a few microseconds an op, a thousand ops
    a forward) lands between the ops, so the profiled wall time would count it as the forward's.
    """
    head = pretrained(model).get_output_embeddings()
    ranges: list[record_function] = []

    def enter(*_: object) -> None:
        ranges.append(record_function(HEAD))
        ranges[-1].__enter__()

    def leave(*_: object) -> None:
        ranges.pop().__exit__(None, None, None)

    hooks = [head.register_forward_pre_hook(enter), head.register_forward_hook(leave)]
    try:
        step()  # warm-up outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                step()
    finally:
        for h in hooks:
            h.remove()
    us = {part: 0.0 for part in PARTS}
    for event in prof.key_averages():
        if event.key in LINEAR_OPS:
            us["linears"] += event.self_cpu_time_total
        elif event.key in ATTENTION_OPS:
            us["attention"] += event.cpu_time_total if event.key.startswith("aten::") else event.self_cpu_time_total
        elif event.key == HEAD:
            us["lm_head"] += event.cpu_time_total
    # The head's own matrix product was counted in `linears` too (its casts and copies were not).
    head_products = sum(
        e.self_cpu_time_total for h in prof.events() if h.name == HEAD for e in _below(h) if e.name in LINEAR_OPS
    )
    us["linears"] = max(0.0, us["linears"] - head_products)
    measured = sum(us.values())
    total = max(plain_ms * 1000 * repeats, measured)  # a slower profiled pass leaves `other` at 0
    us["other"] = total - measured
    return {part: us[part] / total for part in PARTS}


def _below(event: FunctionEvent) -> list[FunctionEvent]:
    """A profiler event's descendants."""
    out: list[FunctionEvent] = []
    todo = list(event.cpu_children)
    while todo:
        e = todo.pop()
        out.append(e)
        todo += e.cpu_children
    return out


def gpu_busy(step: Callable[[], T]) -> tuple[T, float]:
    """`step()`'s result and the share of its wall time in which the GPU ran kernels; the rest is the
    host's work between them (Python, masks, sampling, copies, synchronisation). The profiler's
    own cost on the host makes the share a lower bound."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        out = step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels_us = sum(event.self_device_time_total for event in prof.key_averages())
    return out, min(1.0, kernels_us / (wall * 1e6))
