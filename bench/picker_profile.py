"""A live profile of the picker for ``inferlb bench picker --profile SECONDS``: py-spy samples the
picker's processes while wrk drives its ``direct_response`` listener, and each sample of an event-loop
thread (``MainThread``) is given to a part of the code.

A sample goes to the first frame, from its leaf, that lies in one of this project's packages
(``ext_proc/transport/h2/conn.py``...); a sample with no such frame goes to the library of its leaf
(``grpc``, ``asyncio``...). Frames from the process's entry down to the event loop's ``run`` are
cut off first (``inferlb/cli.py`` starts the loop; what the loop runs is what counts). A sample
whose innermost frame is the loop's own is "the event loop's own frame": uvloop's C code (its
callbacks, epoll, socket calls, the kernel's side of them) or a wait py-spy did not see as idle;
the two cannot be told apart from the stack, so :func:`table` leaves these samples out of the
shares it gives the parts, and the time outside Python frames is spread over them. py-spy pauses
the process for each sample (its default; ``--nonblocking`` lost about a third of the samples
here) and leaves out the samples of threads it sees idle.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

#: One line of py-spy's ``--format raw --threads`` output: ``thread (TID): NAME;frame;...;leaf COUNT``.
_LINE = re.compile(r"^thread \(\d+\): (?P<thread>[^;]*);(?P<stack>.*) (?P<count>\d+)$")
#: A frame: ``function (path:line)``.
_FRAME = re.compile(r"^(?P<func>.*) \((?P<path>[^()]*?):\d+\)$")
_OURS = ("ext_proc", "xds_server", "inferlb", "bench", "sim")
#: The directory holding this project's packages (a checkout's root, or site-packages).
_ROOT = Path(__file__).resolve().parent.parent
_LOOP_ENTRY = "event loop's own frame (uvloop in C, or waiting: py-spy cannot tell)"
#: The files whose frames start the event loop: the frames above them are the process's entry.
_LOOP_RUNNERS = ("asyncio/runners.py", "uvloop/__init__.py", "asyncio/base_events.py")


def _ours(path: str, root: Path = _ROOT) -> str | None:
    """``ext_proc/handler.py`` for a path inside one of this project's packages under ``root``, else None."""
    p = Path(path)
    if not p.is_relative_to(root):
        return None
    rel = p.relative_to(root)
    return rel.as_posix() if rel.parts and rel.parts[0] in _OURS else None


def _library(path: str) -> str:
    """The top-level library of a path outside this project: ``grpc``, ``asyncio``, ``uvloop``..."""
    parts = Path(path).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1].removesuffix(".py")
    for i, p in enumerate(parts):
        if re.fullmatch(r"python3\.\d+", p) and i + 1 < len(parts):
            return parts[i + 1].removesuffix(".py")
    return Path(path).name


def parts(raw: Iterable[str], thread: str = "MainThread") -> Counter[str]:
    """Samples per part from py-spy's raw output (``--format raw --threads --full-filenames``).

    Only the samples of threads named ``thread`` are counted (the event loop runs on the main
    thread). Returns ``{part: samples}`` where a part is a file of ours (``ext_proc/picker.py``),
    ``"library: NAME"`` for a sample with no frame of ours, or the loop's own C time (see the module
    docstring). Lines that are not py-spy samples are ignored.
    """
    out: Counter[str] = Counter()
    for line in raw:
        m = _LINE.match(line.strip())
        if m is None or m["thread"] != thread:
            continue
        frames = [f for f in (_FRAME.match(s) for s in m["stack"].split(";")) if f is not None]
        entry = max((i for i, f in enumerate(frames) if f["path"].endswith(_LOOP_RUNNERS)), default=-1)
        ran = frames[entry + 1:]  # what the event loop was running (the process's entry frames cut off)
        part = next((p for f in reversed(ran) if (p := _ours(f["path"])) is not None), None)
        if part is None:
            part = f"library: {_library(ran[-1]['path'])}" if ran else _LOOP_ENTRY
        out[part] += int(m["count"])
    return out


def record(pids: list[int], seconds: float, out_dir: Path, rate_hz: int = 250) -> list[subprocess.Popen]:
    """Start one ``py-spy record`` per pid for ``seconds`` (raw output ``out_dir/PID.raw``); the
    caller drives the load and waits on the returned processes.

    Raises:
        RuntimeError: py-spy is not installed (``pip install 'inferlb[bench]'``).
    """
    beside = Path(sys.executable).parent / "py-spy"  # a virtual environment's scripts, not always on PATH
    exe = str(beside) if beside.exists() else shutil.which("py-spy")
    if exe is None:
        raise RuntimeError("--profile needs py-spy (pip install 'inferlb[bench]' installs it)")
    return [subprocess.Popen([exe, "record", "--format", "raw", "--threads", "--full-filenames",
                              "--rate", str(rate_hz), "--duration", str(max(1, round(seconds))),
                              "--pid", str(pid), "--output", str(out_dir / f"{pid}.raw")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for pid in pids]


def collect(spies: list[subprocess.Popen], out_dir: Path, pids: list[int]) -> Counter[str]:
    """Wait for the py-spy processes of :func:`record` and add up their samples per part.

    Raises:
        RuntimeError: a py-spy run failed (its stderr is in the message; ptrace may be refused).
    """
    total: Counter[str] = Counter()
    for spy, pid in zip(spies, pids, strict=True):
        _, err = spy.communicate(timeout=120)
        raw = out_dir / f"{pid}.raw"
        if spy.returncode != 0 or not raw.exists():
            raise RuntimeError(f"py-spy on pid {pid} failed (rc {spy.returncode}): {err.strip()[-500:]}")
        total += parts(raw.read_text().splitlines())
    return total


def table(samples: Counter[str], us_per_decision: float) -> list[dict[str, float | str | None]]:
    """Rows ``{part, samples, share (0–1), us_per_decision}``, largest first. ``share`` is of the
    samples that ran Python code (the loop's own frame left out, see the module docstring); a part's
    µs are its share of ``us_per_decision`` (the picker's CPU per decision measured without py-spy).
    The loop's own frame is the last row, with share and µs None."""
    loop = samples.get(_LOOP_ENTRY, 0)
    n = sum(samples.values()) - loop or 1
    rows: list[dict[str, float | str | None]] = [
        {"part": p, "samples": c, "share": c / n, "us_per_decision": c / n * us_per_decision}
        for p, c in samples.most_common() if p != _LOOP_ENTRY]
    if loop:
        rows.append({"part": _LOOP_ENTRY, "samples": loop, "share": None, "us_per_decision": None})
    return rows
