"""The cyclic garbage collector kept off what lives for a whole run.

A loaded model, its tokenizer and the libraries behind them are about 900k Python objects, and every
full collection walks them all: about 0.16 s each on a 2-core EPYC, 2-3% of a 4-problem ToT run (and
in `tot.bench`'s lockstep a pause charged to whichever engine's step it fell in). `collector_off()` moves what
exists when it is entered out of the collector's sight while decoding runs (`gc.freeze`) and back when
it ends, so what the run dropped is collected as usual afterwards (a test process loads many models).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_off() -> Iterator[None]:
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
