"""The project's CPU kernels (decoding/runtime/csrc): the invariant attention, the Llama decoder layers,
the row-invariant bfloat16 linear and a top-k over rows, one extension module compiled on first use
with the machine's C++ compiler (about 75 s on 2 cores, cached by torch under TORCH_EXTENSIONS_DIR, a
folder per checkout)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import sysconfig
import time
from pathlib import Path
from types import ModuleType

import torch

from decoding.base.errors import BackendError

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES: tuple[str, ...] = ("activation.cpp", "attention.cpp", "layers.cpp", "matmul.cpp", "norm.cpp", "q4_int8.cpp")
SOURCES += ("module.cpp",)
# Built into the same module but left out of `source_digest`: they compute no forward, so a shipped
# numerics record or cost profile stays valid whatever they change (they register torch.ops of their own).
SAMPLING_SOURCES = ("gumbel.cpp", "argmax.cpp", "topk.cpp", "draw_top.cpp")
# -ffp-contract=off: the only fused multiply-adds are the explicit ones (attention.cpp's header);
# -fno-trapping-math lets floor and selects vectorize; on x86, -mprefer-vector-width=512: GCC's loops
# use the 512-bit registers where the CPU has them (it tunes Intel's AVX-512 cores to 256 bits, which
# halved attention's lanes and spilled its accumulators). None changes a value: no loop's lanes run
# across a floating-point reduction, which GCC does not reorder without -ffast-math.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]
if platform.machine().lower() in ("x86_64", "amd64"):
    FLAGS.insert(2, "-mprefer-vector-width=512")


@functools.cache
def load() -> ModuleType:
    """The compiled extension (built once per machine, torch version and source)."""
    from torch.utils import cpp_extension

    # torch runs `ninja` from PATH; the pip-installed one lies beside this interpreter, which a
    # script run as .venv/bin/python does not have on PATH.
    scripts = sysconfig.get_path("scripts")
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    name = module_name()
    clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
    t0 = time.perf_counter()
    try:
        module: ModuleType = cpp_extension.load(
            name=name,
            sources=[str(CSRC / s) for s in SOURCES + SAMPLING_SOURCES],
            extra_cflags=FLAGS,
            extra_include_paths=[str(CSRC)],
            extra_ldflags=["-fopenmp"],
        )
    except (RuntimeError, OSError, ImportError) as e:
        raise BackendError(
            f"model.attention=invariant and model.linear=rows need a C++ compiler to build {CSRC} "
            f"({str(e).splitlines()[0][:160]}); install g++ (Debian: apt install g++) or use "
            "model.attention=sdpa model.linear=aten"
        ) from e
    log.info("CPU kernels ready in %.1fs", time.perf_counter() - t0)
    return module


def module_name() -> str:
    """The extension's name, and so its build folder, one per checkout: the build files name the
    sources by path, so two checkouts sharing one folder would each rebuild all of it on every
    alternation."""
    return "tot_kernels_" + hashlib.sha256(str(CSRC.resolve()).encode()).hexdigest()[:8]


@functools.cache
def source_digest() -> str:
    """A digest of the kernels' code and flags: what a measured cost or numerics record of them is
    valid for. Comment lines are left out: a comment changes no arithmetic."""
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for name in (*SOURCES, "kernels.h"):
        code = [line for line in (CSRC / name).read_text().splitlines() if not line.lstrip().startswith("//")]
        digest.update("\n".join(code).encode())
    return digest.hexdigest()[:12]


STALE_LOCK_S = 15 * 60  # a build takes under 2 minutes; a lock this old was left by a killed one


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the build lock a killed build left (Ctrl-C during the first build): torch's waiter
    polls for it to go and would wait forever. Whether one was removed."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age < max_age_s:
        return False
    log.warning("removing %s, left %.0f minutes ago by a build that did not finish", lock, age / 60)
    lock.unlink(missing_ok=True)
    return True


def built() -> ModuleType | None:
    """The extension if this process has loaded it already (the CPU model's layers did), else None:
    code with a torch fallback uses it without ever starting a build."""
    return load() if load.cache_info().currsize else None


@functools.cache
def cpu_model() -> str:
    """The CPU's model name and torch's vector capability: what a measured CPU cost is of (machines of
    one kind differ by up to 2x, and a cache folder may outlive the machine)."""
    name = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    return f"{name} {torch.backends.cpu.get_cpu_capability()} x{os.cpu_count()}"
