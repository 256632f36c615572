"""Scheduling profiles: a list of steps ``{plugin, weight, params}`` -> filters, scorers and one picker.

A profile is built once per routing table (:func:`build_profile`; the config's ``picker.profile`` and
``picker.profiles``) and run per request (:meth:`Profile.choose`). The steps name registered plugins
(:mod:`ext_proc.scheduling.registry`); each step's ``params`` are validated by its plugin's
``Params`` model (the one place for their defaults), ``weight`` is a scorer's (default: its
``default_weight``). Filters run in the order listed: the first that turns an endpoint away names the
refusal. The wire form (:meth:`Profile.wire`) is derived from the steps and their models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

from pydantic import ValidationError

from ext_proc.scheduling.api import Check, Choice, Filter, PluginParams, Request, Score, Scorer
from ext_proc.scheduling.registry import REGISTRY, kind_of

__all__ = ["DEFAULT_STEPS", "Profile", "ProfileError", "Step", "build_profile", "default_profile"]


class Step(NamedTuple):
    """One step of a profile: a registered plugin's name, a scorer's weight (None: its default) and
    its parameters (a validated model)."""

    plugin: str
    weight: float | None
    params: PluginParams


#: The default profile, today's rules: skip failing endpoints, admit by memory, bound the affinity's
#: load, and choose by cached prefix against load (a request without a pin whose prompt blocks are
#: known), else on the ring (session pin, then the key's endpoint clockwise), or the least loaded per
#: share without a key. Each plugin with its own defaults.
DEFAULT_STEPS: tuple[Mapping[str, Any], ...] = (
    {"plugin": "failed-endpoints"},
    {"plugin": "memory-admission"},
    {"plugin": "bounded-load"},
    {"plugin": "least-loaded"},
    {"plugin": "prefix-cache"},
)


class ProfileError(ValueError):
    """A profile's steps are invalid. ``problems``: ``[(location, message), ...]``, each location a path
    inside the step list (``(2, "params", "load_factor")``)."""

    def __init__(self, problems: list[tuple[tuple[str | int, ...], str]]) -> None:
        super().__init__("; ".join(f"[{'.'.join(map(str, loc))}]: {msg}" for loc, msg in problems))
        self.problems = problems


_STEP_KEYS = frozenset({"plugin", "weight", "params"})


def build_profile(steps: Sequence[Mapping[str, Any] | Step], name: str = "default") -> Profile:
    """The profile of ``steps`` (mappings ``{plugin, weight?, params?}``, or :class:`Step`).

    Raises:
        ProfileError: an unknown plugin, a weight on a plugin that is no scorer or a negative one,
            parameters its model refuses, a plugin listed twice, or not exactly one picker; every
            problem with its location.
    """
    problems: list[tuple[tuple[str | int, ...], str]] = []
    built: list[Step] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(steps):
        if isinstance(raw, Step):
            raw = {"plugin": raw.plugin, "weight": raw.weight, "params": raw.params}
        if not isinstance(raw, Mapping):
            problems.append(((i,), f"a step is a mapping {{plugin, weight, params}}, got {raw!r}"))
            continue
        for extra in sorted(set(raw) - _STEP_KEYS, key=str):
            problems.append(((i, extra), "unknown key (a step has plugin, weight and params)"))
        plugin = raw.get("plugin")
        if plugin not in REGISTRY:
            problems.append(((i, "plugin"), f"unknown plugin {plugin!r}; known: {', '.join(REGISTRY.names())}"))
            continue
        if plugin in seen:
            problems.append(((i, "plugin"), f"{plugin!r} is already step {seen[plugin]}: a plugin runs once "
                                            "per profile"))
            continue
        seen[plugin] = i
        cls = REGISTRY.get(plugin)
        weight = raw.get("weight")
        if weight is not None:
            if kind_of(cls) != "scorer":
                problems.append(((i, "weight"), f"{plugin!r} is a {kind_of(cls)}: only scorers have a weight"))
            elif isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight < float("inf"):
                problems.append(((i, "weight"), f"a weight is a number >= 0, got {weight!r}"))
        params = raw.get("params")
        if isinstance(params, PluginParams):
            if type(params) is not cls.Params:
                problems.append(((i, "params"), f"parameters of {type(params).__name__}, not of {plugin!r}"))
                continue
        else:
            try:
                params = cls.Params.model_validate(params if params is not None else {})
            except ValidationError as err:
                for e in err.errors():
                    problems.append(((i, "params", *e["loc"]), e["msg"]))
                continue
        built.append(Step(plugin, None if weight is None else float(weight), params))
    pickers = [s.plugin for s in built if kind_of(REGISTRY.get(s.plugin)) == "picker"]
    if not problems and len(pickers) != 1:
        problems.append(((), f"a profile has exactly one picker ({', '.join(REGISTRY.names('picker'))}), "
                             f"got {len(pickers)}{': ' + ', '.join(pickers) if pickers else ''}"))
    if problems:
        raise ProfileError(problems)
    return Profile(name, tuple(built))


class Profile:
    """A built profile: its filters (in order), its weighted scorers and its picker.

    Equal when the names and steps are. Attributes (read by pickers): ``steps`` (the :class:`Step`
    list it was built from); ``filters`` (the filter plugins, in order), ``keeps`` (their ``keep``
    methods), ``filter_bits`` (each one's bit in a label mask), ``soft_bits`` (the mask of the soft
    ones); ``scorers`` (``(bit, weight, plugin)``, weights > 0); ``picker_bit`` and ``picker_label``
    (the picker's name).
    """

    __slots__ = ("name", "steps", "filters", "keeps", "filter_bits", "soft_bits", "scorers", "picker_bit",
                 "picker_label", "_pick", "_names", "_labels", "_rules", "_scores")

    def __init__(self, name: str, steps: tuple[Step, ...]) -> None:
        self.name = name
        self.steps = steps
        filters, bits, scorers = [], [], []
        self._names: list[tuple[int, str]] = []
        self.soft_bits = 0
        for i, step in enumerate(steps):
            cls = REGISTRY.get(step.plugin)
            plugin = cls(step.params)
            bit = 1 << i
            self._names.append((bit, step.plugin))
            kind = kind_of(cls)
            if kind == "filter":
                filters.append(plugin)
                bits.append(bit)
                if plugin.soft:
                    self.soft_bits |= bit
            elif kind == "scorer":
                weight = step.weight if step.weight is not None else float(cls.default_weight)
                if weight > 0:  # a weight of 0 leaves the totals as they are
                    scorers.append((bit, weight, plugin))
            else:
                self._pick = plugin.pick
                self.picker_bit = bit
        self.filters: tuple[Filter, ...] = tuple(filters)
        self.keeps: tuple[Callable[[Request, str], bool], ...] = tuple(f.keep for f in filters)
        self.filter_bits: tuple[int, ...] = tuple(bits)
        self.scorers: tuple[tuple[int, float, Scorer], ...] = tuple(scorers)
        # Each filter's (soft, rule or None, keep) and each scorer's (bit, weight, rule or None, score).
        self._rules = tuple((f.soft, getattr(f, "rule", None), f.keep) for f in filters)
        self._scores = tuple((bit, w, getattr(s, "rule", None), s.score) for bit, w, s in scorers)
        self._labels: dict[int, str] = {}
        self.picker_label = self.label(self.picker_bit)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Profile) and (self.name, self.steps) == (other.name, other.steps)

    def __hash__(self) -> int:
        return hash((self.name, self.steps))

    def __repr__(self) -> str:
        return f"Profile({self.name!r}, {[s.plugin for s in self.steps]})"

    def label(self, mask: int) -> str:
        """The names of the plugins whose bits are in ``mask``, in step order, joined with ``+``
        (cached: at most one string per subset of this profile's plugins)."""
        text = self._labels.get(mask)
        if text is None:
            text = self._labels[mask] = "+".join(name for bit, name in self._names if mask & bit)
        return text

    def choose(self, request: Request) -> Choice:
        """Run the profile for ``request`` (the request and its cluster's tier): its picker, which asks
        the filters and scorers what it needs."""
        return self._pick(request, self)

    def rules(self, request: Request, hard_only: bool = False) -> list[Check]:
        """The filters' rules for ``request`` (``hard_only``: the hard filters'), in order, without
        those that keep every endpoint: each filter's ``rule(request)``, or its ``keep`` per endpoint."""
        out = []
        for soft, rule, keep in self._rules:
            if soft and hard_only:
                continue
            if rule is None:
                out.append(partial(keep, request))
            else:
                check = rule(request)
                if check is not None:
                    out.append(check)
        return out

    def scores(self, request: Request) -> tuple[list[tuple[float, Score]], int]:
        """The scorers' rules for ``request``: ``([(weight, score), ...], mask of their bits)``, without
        those that score every endpoint alike (each scorer's ``rule(request)``, or its ``score``)."""
        scores = []
        mask = 0
        for bit, weight, rule, score in self._scores:
            s = partial(score, request) if rule is None else rule(request)
            if s is not None:
                scores.append((weight, s))
                mask |= bit
        return scores, mask

    def wire(self) -> list[dict[str, Any]]:
        """The steps as JSON-able objects ``{plugin, weight, params}`` (params from their models)."""
        return [{"plugin": s.plugin, "weight": s.weight, "params": s.params.model_dump(mode="json")}
                for s in self.steps]


_DEFAULT: list[Profile] = []


def default_profile() -> Profile:
    """The default profile (:data:`DEFAULT_STEPS`), built once."""
    if not _DEFAULT:
        _DEFAULT.append(build_profile(DEFAULT_STEPS))
    return _DEFAULT[0]
