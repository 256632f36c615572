"""``mooncake``: block-hash traces, the form public production traces are released in (no text).

Source of the format: Mooncake's traces (kvcache-ai/Mooncake, ``FAST25-release/traces``; the
paper "Mooncake: A KVCache-centric Architecture for Serving LLM Chatbot", FAST 2025): one JSON
object per line with ``timestamp`` (ms from the trace's start), ``input_length`` and
``output_length`` (tokens) and ``hash_ids``: one id per 512-token block of the prompt, equal ids
meaning the same block *and everything before it* (a prefix), the last block possibly partial.

Replayed here: each distinct hash id becomes 512 seeded token ids (and their text), made once and
shared by every prompt that has it, so two requests share exactly the prefix blocks their ids
share; a partial last block takes the first tokens of its block. Arrival times are scaled to
the point's QPS as a JSONL trace's are (:func:`bench.lab.workloads.trace.scaled`), and the
cluster's size is the scenario's (``--engines``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.lab.policy import Message, Prompt
from bench.lab.workloads.base import Draft, Sizing
from bench.lab.workloads.tokens import Synth
from bench.lab.workloads.trace import TraceError, json_object, replay

__all__ = ["BLOCK_TOKENS", "MooncakeTrace"]

#: Tokens per hash id in Mooncake's traces.
BLOCK_TOKENS = 512


@dataclass
class MooncakeTrace:
    """A Mooncake-format block-hash trace.

    Attributes:
        path: the JSONL file.
        seed: the seed of the blocks' token ids.

    Raises:
        TraceError: (on first use) a line without a valid ``timestamp``, ``input_length``,
            ``output_length`` or ``hash_ids`` (naming the file, the line and the field).
    """

    path: Path
    seed: int = 4
    name: str = "mooncake"
    _rows: list[tuple[float, Draft]] | None = field(default=None, repr=False)
    _blocks: dict[int, Message] = field(default_factory=dict, repr=False)

    def _block(self, hash_id: int, tokens: int) -> Message:
        """Block ``hash_id``'s message, cut to ``tokens`` (a prompt's partial last block)."""
        whole = self._blocks.get(hash_id)
        if whole is None:
            whole = self._blocks[hash_id] = Synth(self.seed * 1_000_003 + hash_id).message(None, BLOCK_TOKENS)
        if tokens >= BLOCK_TOKENS:
            return whole
        return Message(None, whole.text[:4 * tokens], whole.tokens[:tokens])

    def rows(self) -> list[tuple[float, Draft]]:
        """Every request (trace time in s, draft), sorted by time (read once)."""
        if self._rows is None:
            rows = []
            with open(self.path, "rb") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        rows.append(self._row(line, f"{self.path}:{n}"))
            rows.sort(key=lambda r: r[0])
            self._rows = rows
        return self._rows

    def _row(self, line: bytes, where: str) -> tuple[float, Draft]:
        doc = json_object(line, where)
        ts, n_in, n_out, ids = (doc.get(k) for k in ("timestamp", "input_length", "output_length", "hash_ids"))
        if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < 0:
            raise TraceError(f"{where}: field 'timestamp' must be a number >= 0 (ms), got {ts!r}")
        for key, value in (("input_length", n_in), ("output_length", n_out)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TraceError(f"{where}: field '{key}' must be an integer >= 1, got {value!r}")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TraceError(f"{where}: field 'hash_ids' must be a non-empty list of integers")
        if not (len(ids) - 1) * BLOCK_TOKENS < n_in <= len(ids) * BLOCK_TOKENS:  # type: ignore[operator]
            raise TraceError(f"{where}: {len(ids)} hash_ids of {BLOCK_TOKENS} tokens cannot hold input_length "
                             f"{n_in}")
        last = n_in - (len(ids) - 1) * BLOCK_TOKENS  # type: ignore[operator]
        blocks = tuple(self._block(h, BLOCK_TOKENS if i < len(ids) - 1 else last) for i, h in enumerate(ids))
        return ts / 1000.0, Draft(Prompt(blocks), n_out, n_out)  # type: ignore[arg-type]

    def arrivals(self, qps: float, duration_s: float, sizing: Sizing, rng: random.Random
                 ) -> Iterator[tuple[float, Draft]]:
        return replay(self.rows(), qps, duration_s)
