"""Freeing a round's per-endpoint objects in pieces, so that no thread holds the GIL for long doing it.

At 60 000 endpoints a round's verdicts are ~300 000 objects; the last reference to their list going
away frees them all in one C call (31 ms measured, ``bench/scale_bench.py``'s fleet), with the GIL
held: the event loop (ADS streams, the picker, the admin API) cannot run meanwhile, whichever thread
drops it. :func:`drop` frees them a piece at a time instead (the GIL can change hands between pieces).
What is freed stays in the process until :func:`trim_heap` gives it back.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

#: Items freed per piece (~0.5 ms of the GIL for a round's verdicts).
PIECE = 1024
#: ``sys.getrefcount`` of a list only its caller holds: the caller's name, :func:`drop`'s
#: parameter and ``getrefcount``'s own argument.
_ONLY_THE_CALLER = 3


def drop(items: list) -> bool:
    """Empty ``items`` (its elements freed :data:`PIECE` at a time) if the caller holds the last
    reference to it; otherwise leave it alone (whoever holds it still uses it, and frees it later).

    Call it on a local name, e.g. ``old, self.weights = self.weights, new; drop(old)``. Returns whether
    it emptied the list. CPython: relies on reference counts.
    """
    if sys.getrefcount(items) > _ONLY_THE_CALLER:
        return False
    while items:
        del items[-PIECE:]
    return True


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
        return libc.malloc_trim  # glibc only (musl and macOS have none)
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Give the C heap's free pages back to the operating system (glibc's ``malloc_trim(0)``);
    returns False where the C library has no such call (nothing done).

    A round's large buffers (lists, numpy columns and bytes of 60 000 endpoints, ~0.5 MB each) come
    from the C heap, and glibc keeps the pages once they are freed: at 60 000 endpoints ~100 MB of a
    control plane's RSS was free heap after a few rounds (``bench/scale_bench.py``: 566 MB, 470 MB
    right after one trim, which took 10 ms). Call it from a worker thread after a round: ctypes
    releases the GIL for the call, but it holds the heap's lock, so other threads' ``malloc`` waits.
    """
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
