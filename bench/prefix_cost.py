"""What the prefix indexes cost per request, in µs of this process's CPU, on 16 endpoints.

Long prompts, the sizes the picker meets in the field's chat and agent workloads:

- ``approximate``: :class:`~ext_proc.prefix_index.PrefixIndex` (fed by the picker's own routing),
  a 6 000-token chat prompt (24 000 + 4 800 characters); one endpoint holds its blocks, the others
  as many different ones. Timed: the prompt's keys from its body, one longest-prefix match over the
  16, one insert (the pick's own blocks on the holder).
- ``precise``: :class:`~ext_proc.prefix_events.EventIndex` (fed by the engines' KV-cache events), a
  7 200-token prompt (450 keys of 16 tokens) whose first 6 000 tokens four of the 16 hold. Timed: one
  match, a pick's pending keys on a holder (the 75 it lacks) and on another endpoint (all 450).
- ``engine_keys``: the precise index's keys of a 20 KiB chat prompt in blocks of 16 tokens
  (:func:`ext_proc.engine_keys.engine_keys`, compiled, against its Python reference ``engine_keys_py``).

Each operation is run ``calls`` times in a row, ``rounds`` times, timed with
:func:`time.process_time`; printed, one JSON object ``{"<index>/<operation>": µs, ...}`` with the
fastest round's figure (the least disturbed by other jobs). These were timed asserts in the unit
tests until 2026-12-07 (a limit a loaded machine can break); here they are figures to compare, run
from each checkout's root, interleaved:

    python3 -m bench.prefix_cost [--calls 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import time
import timeit
from collections.abc import Callable

from ext_proc import engine_keys
from ext_proc.prefix_events import EventIndex
from ext_proc.prefix_index import PrefixIndex, block_hashes, prompt_bytes

ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(16)]


def _best_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """µs of this process's CPU per call of ``fn``: the fastest of ``rounds`` rounds of ``calls``."""
    return min(timeit.repeat(fn, number=calls, repeat=rounds, timer=time.process_time)) / calls * 1e6


def approximate(calls: int, rounds: int) -> dict[str, float]:
    """The approximate index's keys, match and insert for a 6 000-token chat prompt (µs each)."""
    doc = {"messages": [{"role": "system", "content": "s" * 24_000}, {"role": "user", "content": "q" * 4_800}]}
    data = prompt_bytes(doc)
    keys = block_hashes(data)
    index = PrefixIndex()
    for i, e in enumerate(ENDPOINTS):
        index.insert(e, keys if i == 3 else block_hashes(bytes([i]) * len(data)), 4000)
    if index.matched(keys, ENDPOINTS) != {ENDPOINTS[3]: len(keys)}:
        raise AssertionError("the approximate index did not find the holder")
    return {
        "approximate/keys": _best_us(lambda: block_hashes(prompt_bytes(doc)), calls, rounds),
        "approximate/match": _best_us(lambda: index.matched(keys, ENDPOINTS), calls, rounds),
        "approximate/insert": _best_us(lambda: index.insert(ENDPOINTS[3], keys, 4000), calls, rounds),
    }


def precise(calls: int, rounds: int) -> dict[str, float]:
    """The precise index's match and a pick's pending keys for a 450-key prompt (µs each)."""
    rng = random.Random(7)
    keys = tuple(rng.getrandbits(63) for _ in range(450))
    index = EventIndex(pending_s=2.0, clock=lambda: 0.0)
    for i, e in enumerate(ENDPOINTS):
        index.stored(e, keys[:375] if i < 4 else tuple(rng.getrandbits(63) for _ in range(2000)), None, 30_000)
    if index.matched(keys, ENDPOINTS) != {e: 375 for e in ENDPOINTS[:4]}:
        raise AssertionError("the precise index did not find the four holders")
    return {
        "precise/match": _best_us(lambda: index.matched(keys, ENDPOINTS), calls, rounds),
        "precise/insert_holder": _best_us(lambda: index.insert(ENDPOINTS[0], keys, 30_000), calls, rounds),
        "precise/insert_other": _best_us(lambda: index.insert(ENDPOINTS[5], keys, 30_000), calls, rounds),
    }


def keys_20_kib(calls: int, rounds: int) -> dict[str, float]:
    """The engine-side block keys of a 20 KiB chat prompt, compiled and in Python (µs each)."""
    doc = {"messages": [{"role": "system", "content": "s" * 2000}, {"role": "user", "content": "q" * 18_000}]}
    if engine_keys.engine_keys(doc, 16) != engine_keys.engine_keys_py(doc, 16):
        raise AssertionError("the compiled engine keys differ from the reference")
    return {
        "engine_keys/compiled": _best_us(lambda: engine_keys.engine_keys(doc, 16), calls, rounds),
        "engine_keys/python": _best_us(lambda: engine_keys.engine_keys_py(doc, 16), max(1, calls // 10), rounds),
    }


def main(argv: list[str] | None = None) -> None:
    """Print the figures as one JSON object (see the module's docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per round (default 200)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the fastest is reported (default 5)")
    args = ap.parse_args(argv)
    out = {**approximate(args.calls, args.rounds), **precise(args.calls, args.rounds),
           **keys_20_kib(args.calls, args.rounds)}
    print(json.dumps({k: round(v, 2) for k, v in out.items()}))


if __name__ == "__main__":
    main()
