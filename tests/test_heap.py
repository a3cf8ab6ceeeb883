"""The collector kept off the run's long-lived objects while decoding runs (decoding/speculation/heap.py)."""

from __future__ import annotations

import gc
import weakref

from decoding.speculation.heap import frozen


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_what_lives_when_entered_is_frozen_and_given_back_after():
    gc.collect()
    old = Node()
    gone = weakref.ref(old)
    with frozen():
        assert gc.get_freeze_count() > 0
        del old
        gc.collect()
        assert gone() is not None  # out of the collector's sight while the run goes on
        new = weakref.ref(Node())
        gc.collect()
        assert new() is None  # what the run itself makes and drops is collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None  # after the run, collected like everything else
