"""Giving a round's freed memory back to the operating system (:func:`trim_heap`).

A round at 60 000 endpoints makes large buffers (numpy columns, lists and bytes of 60 000 entries,
~0.5 MB each) from the C heap; glibc keeps their pages once they are freed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


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
