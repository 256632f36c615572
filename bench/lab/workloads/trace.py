"""``trace``: any JSONL file of requests, replayed through the lab (format in docs/benchmarks.md).

One JSON object per line:

- ``t`` (number, required): arrival time, seconds from the trace's start;
- the prompt, exactly one of: ``messages`` (OpenAI chat messages, ``[{"role", "content"}]``),
  ``prompt`` (a completion prompt, text) or ``prompt_token_ids`` (a list of token ids, ints);
- ``output_tokens`` (int >= 1, required): tokens the engine generates;
- optional: ``max_tokens`` (the body's output hint; default ``output_tokens``), ``headers`` (an
  object of header name -> string value: a session, a version), ``model``, ``user``,
  ``memory_mib`` (a ``job`` request's declared GPU memory, MiB).

Texts are tokenized with the engines' tokenizer, each distinct text once; a prompt given as token
ids gets a text of four characters per id (:func:`~bench.lab.workloads.tokens.render`). The QPS of
a point replays the trace faster or slower: arrival times are scaled by (the trace's own mean rate
/ the point's QPS); ``qps`` 0 or None keeps the trace's own times. The trace is cut at the point's
duration.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from bench.lab.policy import Message, Prompt
from bench.lab.workloads.base import Draft, Sizing
from bench.lab.workloads.tokens import Tokenizer, render

__all__ = ["JsonlTrace", "TraceError", "json_object", "natural_rate", "replay", "scaled"]


class TraceError(ValueError):
    """A trace line is not a valid request (the message names the file, the line and the field)."""


def natural_rate(times: list[float]) -> float:
    """A trace's own mean arrival rate (requests per s over its span; 1.0 for a trace too short to tell)."""
    if len(times) < 2 or times[-1] <= times[0]:
        return 1.0
    return (len(times) - 1) / (times[-1] - times[0])


def scaled(times: list[float], qps: float | None) -> tuple[float, float]:
    """``(start, factor)``: arrival ``t`` of a trace replays at ``(t - start) x factor`` so that its
    mean rate is ``qps`` (None or 0: the trace's own times, from its first arrival)."""
    start = times[0] if times else 0.0
    if not qps:
        return start, 1.0
    return start, natural_rate(times) / qps


def json_object(line: bytes, where: str) -> dict:
    """One trace line's JSON object.

    Raises:
        TraceError: not JSON, or not an object (naming ``where``: the file and the line).
    """
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError as err:
        raise TraceError(f"{where}: not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise TraceError(f"{where}: a line must be a JSON object")
    return doc


def replay(rows: list[tuple[float, Draft]], qps: float | None, duration_s: float) -> Iterator[tuple[float, Draft]]:
    """A sorted trace's requests at the times :func:`scaled` gives them, up to ``duration_s``."""
    start, factor = scaled([t for t, _ in rows], qps)
    for t, draft in rows:
        at = (t - start) * factor
        if at >= duration_s:
            return
        yield at, draft


@dataclass
class JsonlTrace:
    """A JSONL request trace.

    Attributes:
        path: the file.

    Raises:
        TraceError: (on first use) a line that is not JSON or lacks a valid field, naming both.
    """

    path: Path
    name: str = "trace"
    _rows: list[tuple[float, Draft]] | None = field(default=None, repr=False)

    def rows(self) -> list[tuple[float, Draft]]:
        """Every request of the file with its trace time, sorted by time (read once)."""
        if self._rows is None:
            tok = Tokenizer()
            rows = []
            with open(self.path, "rb") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        rows.append(self._row(line, n, tok))
            rows.sort(key=lambda r: r[0])
            self._rows = rows
        return self._rows

    def _row(self, line: bytes, n: int, tok: Tokenizer) -> tuple[float, Draft]:
        where = f"{self.path}:{n}"
        doc = json_object(line, where)
        t = doc.get("t")
        if not isinstance(t, int | float) or isinstance(t, bool) or t < 0:
            raise TraceError(f"{where}: field 't' must be a number >= 0 (seconds), got {t!r}")
        out = doc.get("output_tokens")
        if not isinstance(out, int) or isinstance(out, bool) or out < 1:
            raise TraceError(f"{where}: field 'output_tokens' must be an integer >= 1, got {out!r}")
        given = [k for k in ("messages", "prompt", "prompt_token_ids") if k in doc]
        if len(given) != 1:
            raise TraceError(f"{where}: exactly one of 'messages', 'prompt', 'prompt_token_ids' is needed, got {given}")
        if "messages" in doc:
            msgs = doc["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs):
                raise TraceError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} strings")
            prompt = Prompt(tuple(tok.message(m["role"], m["content"]) for m in msgs))
        elif "prompt" in doc:
            if not isinstance(doc["prompt"], str) or not doc["prompt"]:
                raise TraceError(f"{where}: field 'prompt' must be a non-empty string")
            prompt = Prompt((tok.message(None, doc["prompt"]),))
        else:
            ids = doc["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in ids):
                raise TraceError(f"{where}: field 'prompt_token_ids' must be a non-empty list of token ids (ints >= 0)")
            prompt = Prompt((Message(None, render(np.asarray(ids, dtype=np.int64)), tuple(ids)),))
        headers = doc.get("headers") or {}
        if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
            raise TraceError(f"{where}: field 'headers' must be an object of string values")
        memory = doc.get("memory_mib")
        if memory is not None and (not isinstance(memory, int | float) or memory < 0):
            raise TraceError(f"{where}: field 'memory_mib' must be a number >= 0, got {memory!r}")
        max_tokens = doc.get("max_tokens", out)
        return float(t), Draft(prompt, out, max_tokens if isinstance(max_tokens, int) else out,
                               tuple((k.lower(), v.encode()) for k, v in headers.items()),
                               doc.get("model") if isinstance(doc.get("model"), str) else None,
                               doc.get("user") if isinstance(doc.get("user"), str) else None,
                               None if memory is None else float(memory))

    def arrivals(self, qps: float, duration_s: float, sizing: Sizing, rng: random.Random
                 ) -> Iterator[tuple[float, Draft]]:
        return replay(self.rows(), qps, duration_s)

