"""The collector kept off the run's long-lived objects while decoding runs (decoding/runtime/collector.py)."""

from __future__ import annotations

import gc
import weakref

from decoding.runtime.collector import collector_off


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_what_lives_when_entered_is_frozen_and_given_back_after():
    gc.collect()
    old = Node()
    gone = weakref.ref(old)
    with collector_off():
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
