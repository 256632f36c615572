"""The cost model's statistics kept as X'X's upper triangle in one tuple (ext_proc/costmodel.py) against
a frozen copy of the full 4 x 4 lists it kept before: the same fits, bit for bit, on random streams
of observations (so every decision that reads them is the same), the five-feature TTFT fit too."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.costmodel import _RIDGE, CostModel


class _OldSums:
    def __init__(self) -> None:
        self.xx, self.xy, self.tt, self.ty = [0.0] * 16, [0.0] * 4, [0.0] * 16, [0.0] * 4
        self.tl, self.tly = [0.0] * 25, [0.0] * 5  # the TTFT fit with the uncached share and the load
        self.w = self.wy = self.wl = 0.0
        self.n = self.nt = self.misses = 0

    def add(self, p, o, load, y, ttft, miss, forget):
        _old_accumulate(self.xx, self.xy, (1.0, p, o, load), y, forget)
        self.w = self.w * forget + 1.0
        self.wy = self.wy * forget + y
        self.wl = self.wl * forget + load
        self.n += 1
        if ttft is not None:
            f = 1.0 if miss else 0.0
            _old_accumulate(self.tt, self.ty, (1.0, p, f, f * p), ttft, forget)
            _old_accumulate(self.tl, self.tly, (1.0, p, f, f * p, load), ttft, forget)
            self.nt += 1
            self.misses += miss


def _old_accumulate(xx, xy, x, y, forget):
    k = len(x)
    for i in range(k):
        xy[i] = xy[i] * forget + x[i] * y
        for j in range(k):
            xx[k * i + j] = xx[k * i + j] * forget + x[i] * x[j]


def _old_solve(xx, xy, k):
    a = np.array(xx, dtype=float).reshape(k, k)
    a += np.eye(k) * _RIDGE * max(1.0, float(np.trace(a)))
    try:
        coef = np.linalg.solve(a, np.array(xy, dtype=float))
    except np.linalg.LinAlgError:
        return None
    if not np.all(np.isfinite(coef)):
        return None
    return tuple(float(c) for c in coef)


observations = st.lists(st.tuples(
    st.sampled_from(["a100", "a10"]), st.floats(0, 40_000), st.floats(0, 4_000), st.floats(0.01, 1e5),
    st.one_of(st.none(), st.floats(0, 1e4)), st.floats(0, 50), st.booleans()), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(observations, st.sampled_from([1.0, 0.999, 0.9]))
def test_the_fits_are_the_old_ones_bit_for_bit(stream, forget):
    model = CostModel(forget, min_samples=3)
    old: dict[str, _OldSums] = {}
    for i, (cls, prompt, output, duration, ttft, load, miss) in enumerate(stream):
        model.observe(cls, prompt, output, duration, ttft, load, miss)
        old.setdefault(cls, _OldSums()).add(prompt / 1000.0, output / 1000.0, load, duration, ttft, miss, forget)
        if i % 17 == 16 or i == len(stream) - 1:
            fits = model.refit()
            for name, s in old.items():
                fit = fits.get(name)
                if s.n < 3:
                    assert fit is None
                    continue
                duration_fit = _old_solve(s.xx, s.xy, 4)
                assert (fit.duration if fit else None) == duration_fit
                if fit is not None:
                    ttft_fit = _old_solve(s.tt, s.ty, 4) if s.nt >= 3 and min(s.misses, s.nt - s.misses) >= 5 else None
                    assert fit.ttft == ttft_fit
                    assert fit.ttft_load == (_old_solve(s.tl, s.tly, 5) if ttft_fit is not None else None)
                    assert (fit.mean_ms, fit.mean_load, fit.samples) == (s.wy / s.w, s.wl / s.w, s.n)


def test_the_ttft_fit_with_the_load_is_the_old_one_bit_for_bit():
    """A stream where every fit is ready (hits and misses, TTFTs, loads): the five-feature fit too."""
    rng = np.random.default_rng(7)
    model, old = CostModel(0.999, min_samples=3), _OldSums()
    for i in range(400):
        prompt, output, load = float(rng.uniform(0, 8000)), float(rng.uniform(0, 1000)), float(rng.uniform(0, 30))
        ttft, duration = float(rng.uniform(10, 900)), float(rng.uniform(100, 9000))
        model.observe("a100", prompt, output, duration, ttft, load, i % 3 == 0)
        old.add(prompt / 1000.0, output / 1000.0, load, duration, ttft, i % 3 == 0, 0.999)
    fit = model.refit()["a100"]
    assert fit.ttft_load is not None and fit.ttft_load == _old_solve(old.tl, old.tly, 5)
