"""Shared rule of the ``gpu_memory`` and ``max_concurrency`` factors: derate only a *persistent* shortage.

Saturation is not health. Free GPU memory and running requests change every few tens of ms, while
the slow loop acts every 0.5-5 s on window averages; turning one sample into an exclusion makes the
loop oscillate (an excluded endpoint restarts slow start, its sessions move, its load lands on the
others, which then saturate in turn). So these two rules never exclude: the picker admits each
request against the live memory and load of that moment, and the slow loop only lowers the weight of
an endpoint that has been short for ``rounds`` consecutive rounds (multiplier ``penalty``), and
restores it after ``rounds`` consecutive rounds without shortage. Hysteresis over rounds, as a
Schmitt trigger: one odd sample changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from pydantic import Field

from xds_server.engine.plugin import Array, ClusterRound, Factor, PluginParams, State


class ShortageParams(PluginParams):
    """``rounds``: consecutive rounds short (or calm) before the weight is lowered (or restored), >= 1;
    ``penalty``: the weight multiplier while persistently short, in (0, 1]."""

    rounds: int = Field(3, ge=1)
    penalty: float = Field(0.5, gt=0, le=1)


S = TypeVar("S", bound=ShortageParams)


@dataclass(frozen=True, slots=True)
class Shortage:
    """One endpoint's record: consecutive ``short`` / ``calm`` rounds, and whether it is ``derated``."""

    short: int = 0
    calm: int = 0
    derated: bool = False


_CALM = Shortage()  # a new endpoint's record; a record that is neither short nor derated acts as this one


def step(record: Shortage, short: bool | None, rounds: int) -> Shortage:
    """The next record after one round (``short`` None = no data: nothing changes).

    >>> r = step(step(step(Shortage(), True, 3), True, 3), True, 3); r.derated
    True
    >>> step(r, False, 3).derated, step(step(step(r, False, 3), False, 3), False, 3).derated
    (True, False)
    """
    if short is None:
        return record
    if short:
        n = record.short + 1
        return Shortage(n, 0, record.derated or n >= rounds)
    n = record.calm + 1
    return Shortage(0, n, record.derated and n < rounds)


def shortage_factor(name: str, is_short: Callable[[ClusterRound, S], Array], params: type[S]) -> Factor[S]:
    """A factor plugin ``name`` that derates endpoints for which ``is_short`` held ``rounds`` rounds in a row.

    ``is_short(round, params)``: per member 1.0 (short), 0.0 (not short) or NaN (no data); ``params``:
    the plugin's parameter model (:class:`ShortageParams` or one that extends it). Only records that
    are short or derated are kept (a calm count matters only to a derated endpoint): the members
    without one and not short this round are walked as one array, not one by one."""

    def run(rnd: ClusterRound, p: S, state: State, weights: Array) -> tuple[Array, State]:
        short = is_short(rnd, p)
        out = np.ones(len(rnd.addresses))
        new: dict[str, Shortage] = {}
        members = rnd.index() if state else {}
        todo = set(np.flatnonzero(short == 1.0).tolist())
        todo.update(members[a] for a in state if a in members)
        for i in sorted(todo):
            address, flag = rnd.addresses[i], float(short[i])
            r = step(state.get(address, _CALM), None if flag != flag else flag == 1.0, p.rounds)
            if r.derated:
                out[i] = p.penalty
            if r.derated or r.short:
                new[address] = r
        return out, new

    return Factor(name, params, run)
