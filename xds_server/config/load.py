"""YAML text or file -> validated :class:`~xds_server.config.model.Config`.

Every error names the field (a dotted path such as ``services[0].versions[1].endpoints[2].address``)
and, when the config came from a file, the line of that field, so an operator can find it at once.
A bad config is refused at startup; nothing is half-applied. Deprecated spellings are rewritten
here, each with one warning line that names the old and the new field. A key given twice in one
mapping is refused (YAML 1.2 says keys are unique; PyYAML would keep the last one silently), as are
a file that is not UTF-8 text and one nested too deeply to read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from xds_server.config.model import LOOP_ALIASES, Config, FieldProblem

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """Raised when a config cannot be loaded; ``str(err)`` lists every problem, one per line."""


def _deprecated(data: dict, source: str) -> dict:
    """``data`` with ``prometheus.<f>`` for f in :data:`LOOP_ALIASES` moved to ``loop.<f>``.

    Raises:
        ConfigError: both spellings are given.
    """
    prom = data.get("prometheus")
    if not isinstance(prom, dict) or not any(f in prom for f in LOOP_ALIASES):
        return data
    loop = data.get("loop") or {}
    if not isinstance(loop, dict):
        return data   # the model reports the bad section
    prom, loop = dict(prom), dict(loop)
    for f in LOOP_ALIASES:
        if f in prom:
            if f in loop:
                raise ConfigError(f"{source}: prometheus.{f} and loop.{f} are both set; keep loop.{f}")
            loop[f] = prom.pop(f)
            log.warning("%s: prometheus.%s is deprecated; use loop.%s", source, f, f)
    return {**data, "prometheus": prom, "loop": loop}


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at pydantic location ``loc`` (deepest node found)."""
    line = None if node is None else node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if k.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            nxt = node.value[part]
        else:
            nxt = None
        if nxt is None:
            break
        node, line = nxt, nxt.start_mark.line + 1
    return line


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not re.fullmatch(r"[A-Za-z0-9_-]+", str(part)):
            out += f"[{str(part)!r}]"  # an odd key (spaces, control characters) stays on one line
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


_MERGE = "tag:yaml.org,2002:merge"
_TOO_DEEP = "the config nests too deeply to read"


def duplicate_keys(node: yaml.Node | None) -> list[tuple[int, str]]:
    """``(line, key)`` of every key that repeats an earlier key of the same mapping, anywhere under
    ``node`` (a composed YAML document); merge keys (``<<``) are not keys. Each node is visited once,
    so aliases of one anchor cost nothing more ("billion laughs")."""
    found: list[tuple[int, str]] = []
    seen: set[int] = set()
    stack = [node] if node is not None else []
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, yaml.MappingNode):
            keys: set[str] = set()
            for k, v in n.value:
                if k.tag != _MERGE and isinstance(k, yaml.ScalarNode):
                    if k.value in keys:
                        found.append((k.start_mark.line + 1, k.value))
                    keys.add(k.value)
                stack.extend((k, v))
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
    return sorted(found)


#: A check the app adds to the model's own (``parse_config(checks=...)``): the config -> its problems,
#: each a :class:`FieldProblem` naming its field (for example the picker's plugins and their
#: parameters, which only the app that loads them can check).
Check = Callable[[Config], Sequence[FieldProblem]]


def _report(node: yaml.Node | None, source: str, problems: Sequence[tuple[tuple[Any, ...], str]]) -> ConfigError:
    """``ConfigError`` listing ``(location, message)`` problems as ``SOURCE:LINE: FIELD: message``."""
    lines = []
    for loc, message in problems:
        line = _line_of(node, loc)
        where = f"{source}:{line}" if line else source
        lines.append(f"{where}: {_path(loc)}: {message}")
    return ConfigError("\n".join(lines))


def parse_config(text: str, source: str = "<config>", checks: Sequence[Check] = ()) -> Config:
    """Parse and validate YAML ``text``; then run ``checks`` on the valid config.

    Raises:
        ConfigError: listing each problem as ``SOURCE:LINE: FIELD: message`` (a key given twice:
            ``SOURCE:LINE: KEY: given twice``).
    """
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = " ".join(str(getattr(err, "problem", None) or err).split())  # one line per problem
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{source}: {_TOO_DEEP}") from None
    twice = duplicate_keys(node)
    if twice:
        raise ConfigError("\n".join(f"{source}:{line}: {key}: given twice in one mapping (YAML keys are unique)"
                                     for line, key in twice))
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a YAML mapping, got {type(data).__name__}")
    try:
        cfg = Config.model_validate(_deprecated(data, source))
    except RecursionError:
        raise ConfigError(f"{source}: {_TOO_DEEP}") from None
    except ValidationError as err:
        errors = []
        for e in err.errors():
            problem = (e.get("ctx") or {}).get("error")
            if isinstance(problem, FieldProblem):
                errors.append((problem.loc, {**e, "msg": str(problem)}))
            else:
                errors.append((tuple(p for p in e["loc"]
                                     if not (isinstance(p, str) and p.startswith("function-"))), e))
        # pydantic also reports a list as too short when its only items failed: keep the item errors.
        errors = [
            (loc, e) for loc, e in errors
            if not (e["type"] == "too_short" and any(o[: len(loc)] == loc and o != loc for o, _ in errors))
        ]
        raise _report(node, source, [(loc, e["msg"]) for loc, e in errors]) from None
    found = [(p.loc, str(p)) for check in checks for p in check(cfg)]
    if found:
        raise _report(node, source, found)
    return cfg


def load_config(path: str | Path, checks: Sequence[Check] = ()) -> Config:
    """Read and validate the YAML file at ``path``.

    Raises:
        ConfigError: the file is missing, unreadable or invalid, or a check of ``checks`` found a
            problem (each problem names field and line).
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x}); "
                          "a YAML config must be UTF-8") from None
    return parse_config(text, str(path), checks)
