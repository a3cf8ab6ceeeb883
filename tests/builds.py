"""The project's kernels compiled again without this machine's wider instructions, to compare bits
across builds: the portable loop (no AVX2, no FMA: std::fma in software) and AVX2 alone (no VNNI,
AVX-512 or AMX)."""

from __future__ import annotations

import platform
from pathlib import Path
from types import ModuleType

from decoding.runtime import kernels

X86 = platform.machine().lower() in ("x86_64", "amd64")  # the builds' flags are x86's
BUILDS = {
    "portable": ["-march=x86-64", "-mno-avx2", "-mno-fma"],
    "avx2": ["-march=haswell"],
}


def other_build(name: str, build: str, text: str) -> ModuleType:
    """Extension `name`_`build` from the C++ `text` (which includes the kernels' sources by path and
    binds what it compares), compiled with `BUILDS[build]`. The source is written where the build lies,
    only when it changes: torch's ninja then rebuilds only when a file it includes does, not at every
    run (25 s of compiling a build)."""
    from torch.utils import cpp_extension

    full = f"{name}_{build}"
    source = Path(cpp_extension._get_build_directory(full, verbose=False)) / f"{build}.cpp"
    if not source.is_file() or source.read_text() != text:
        source.write_text(text)
    module: ModuleType = cpp_extension.load(
        name=full,
        sources=[str(source)],
        extra_cflags=["-O2", *BUILDS[build], "-ffp-contract=off", "-fopenmp"],
        extra_include_paths=[str(kernels.CSRC)],
        extra_ldflags=["-fopenmp"],
    )
    return module
