"""The request cost model: per GPU class, an online least-squares fit of duration and TTFT.

Source of the rule: "equal-cost" balancing with a weighted linear regression of a request's cost
from its prompt and output tokens (the seed design, issue 13); the fit is ordinary least squares
with exponential forgetting (recursive least squares with a forgetting factor, as in Ljung &
Söderström, *Theory and Practice of Recursive Identification*, 1983): each observation's weight
decays by ``forget`` per later observation of its class, so the fit follows a GPU class whose speed
changes (another model, a hot node) and old data fades out.

- duration (ms) ~ a + b x prompt_ktokens + c x output_ktokens
- TTFT (ms)     ~ a + b x prompt_ktokens

Learned from Envoy's access log: each completion of a pick whose tokens the picker knew (read from
the OpenAI body or the request class) adds one observation: the features recorded at pick time
and the times Envoy reports (``time_to_last_downstream_tx_byte``, ``time_to_first_upstream_rx_byte``).

The request path only reads :meth:`CostModel.relative_work`: two dictionary reads and a few
multiplications. Observations are summed in plain floats (``observe``, once per completion);
the 3x3 systems are solved once a second (:meth:`refit`, from the picker's housekeeping) with
numpy. A class is *ready* after ``min_samples`` observations; until then every request weighs 1
(request counting, the classic bounded loads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["CostModel", "Fit"]

_RIDGE = 1e-6
#: Relative work is clamped to this range (a request is at most 50x or 1/50 of a typical one).
_MIN_WORK, _MAX_WORK = 0.02, 50.0


@dataclass(frozen=True, slots=True)
class Fit:
    """The solved model of one GPU class.

    Attributes:
        duration: ``(a ms, b ms per 1000 prompt tokens, c ms per 1000 output tokens)``.
        ttft: ``(a ms, b ms per 1000 prompt tokens)``, or None without TTFT data.
        mean_ms: the forgetting-weighted mean duration (ms): the cost of a "typical" request.
        samples: observations seen (not decayed).
    """

    duration: tuple[float, float, float]
    ttft: tuple[float, float] | None
    mean_ms: float
    samples: int

    def predict_ms(self, prompt_tokens: float, output_tokens: float) -> float:
        """Predicted duration (ms) of a request (never below 1 ms)."""
        a, b, c = self.duration
        return max(1.0, a + b * prompt_tokens / 1000.0 + c * output_tokens / 1000.0)

    def predict_ttft_ms(self, prompt_tokens: float) -> float | None:
        """Predicted TTFT (ms), None without TTFT data."""
        if self.ttft is None:
            return None
        a, b = self.ttft
        return max(0.0, a + b * prompt_tokens / 1000.0)


class _Sums:
    """Forgetting-weighted sufficient statistics of one class: X'X, X'y for both fits, and the mean."""

    __slots__ = ("xx", "xy", "tt", "ty", "w", "wy", "n", "nt")

    def __init__(self) -> None:
        self.xx = [0.0] * 9
        self.xy = [0.0] * 3
        self.tt = [0.0] * 4
        self.ty = [0.0] * 2
        self.w = self.wy = 0.0
        self.n = self.nt = 0

    def add(self, p: float, o: float, y: float, ttft: float | None, forget: float) -> None:
        x = (1.0, p, o)
        xx, xy = self.xx, self.xy
        for i in range(3):
            xy[i] = xy[i] * forget + x[i] * y
            for j in range(3):
                xx[3 * i + j] = xx[3 * i + j] * forget + x[i] * x[j]
        self.w = self.w * forget + 1.0
        self.wy = self.wy * forget + y
        self.n += 1
        if ttft is not None:
            t = (1.0, p)
            tt, ty = self.tt, self.ty
            for i in range(2):
                ty[i] = ty[i] * forget + t[i] * ttft
                for j in range(2):
                    tt[2 * i + j] = tt[2 * i + j] * forget + t[i] * t[j]
            self.nt += 1


def _solve(xx: list[float], xy: list[float], k: int) -> tuple[float, ...] | None:
    a = np.array(xx, dtype=float).reshape(k, k)
    a += np.eye(k) * _RIDGE * max(1.0, float(np.trace(a)))
    try:
        coef = np.linalg.solve(a, np.array(xy, dtype=float))
    except np.linalg.LinAlgError:
        return None
    if not np.all(np.isfinite(coef)):
        return None
    return tuple(float(c) for c in coef)


class CostModel:
    """Per-GPU-class online fits of request duration and TTFT from prompt and output tokens.

    Args:
        forget: per-observation forgetting factor in (0, 1] (1 = plain least squares; 0.999: an
            observation's weight halves after ~700 newer ones of its class).
        min_samples: observations of a class before its fit is used (>= 3).

    Raises:
        ValueError: ``forget`` outside (0, 1] or ``min_samples`` < 3.
    """

    def __init__(self, forget: float = 0.999, min_samples: int = 20) -> None:
        if not 0.0 < forget <= 1.0 or min_samples < 3:
            raise ValueError(f"cost model: forget in (0, 1] and min_samples >= 3 needed, got {forget}, {min_samples}")
        self.forget = forget
        self.min_samples = min_samples
        self._sums: dict[str, _Sums] = {}
        self.fits: dict[str, Fit] = {}
        """GPU class -> its solved fit (ready classes only); replaced whole by :meth:`refit`."""

    def observe(self, gpu_class: str, prompt_tokens: float, output_tokens: float, duration_ms: float,
                ttft_ms: float | None = None) -> None:
        """Add one finished request (tokens as known at pick time; times in ms). Bad values are ignored."""
        if not (duration_ms > 0 and math.isfinite(duration_ms) and prompt_tokens >= 0 and output_tokens >= 0):
            return
        if ttft_ms is not None and not (ttft_ms >= 0 and math.isfinite(ttft_ms)):
            ttft_ms = None
        sums = self._sums.get(gpu_class)
        if sums is None:
            sums = self._sums[gpu_class] = _Sums()
        sums.add(prompt_tokens / 1000.0, output_tokens / 1000.0, duration_ms, ttft_ms, self.forget)

    def refit(self) -> dict[str, Fit]:
        """Solve every class with at least ``min_samples`` observations; returns (and keeps) the fits."""
        fits: dict[str, Fit] = {}
        for gpu_class, s in self._sums.items():
            if s.n < self.min_samples or s.w <= 0:
                continue
            duration = _solve(s.xx, s.xy, 3)
            if duration is None:
                continue
            ttft = _solve(s.tt, s.ty, 2) if s.nt >= self.min_samples else None
            fits[gpu_class] = Fit(duration, ttft, s.wy / s.w, s.n)  # type: ignore[arg-type]
        self.fits = fits
        return fits

    def relative_work(self, gpu_class: str | None, prompt_tokens: float | None, output_tokens: float | None) -> float:
        """A request's predicted cost in units of a typical request of that class (1.0 = typical).

        1.0 when the class has no ready fit or the tokens are unknown (then loads are request counts).
        """
        if prompt_tokens is None or output_tokens is None:
            return 1.0
        fit = self.fits.get(gpu_class) if gpu_class is not None else None
        if fit is None or fit.mean_ms <= 0:
            return 1.0
        work = fit.predict_ms(prompt_tokens, output_tokens) / fit.mean_ms
        return _MIN_WORK if work < _MIN_WORK else _MAX_WORK if work > _MAX_WORK else work

    def describe(self) -> dict:
        """JSON-ready: per class the coefficients, mean, samples and readiness (for the admin API)."""
        out = {}
        for gpu_class, s in sorted(self._sums.items()):
            fit = self.fits.get(gpu_class)
            out[gpu_class] = {
                "samples": s.n,
                "ready": fit is not None,
                "duration_ms": None if fit is None else {
                    "intercept": fit.duration[0], "per_1k_prompt_tokens": fit.duration[1],
                    "per_1k_output_tokens": fit.duration[2]},
                "ttft_ms": None if fit is None or fit.ttft is None else {
                    "intercept": fit.ttft[0], "per_1k_prompt_tokens": fit.ttft[1]},
                "mean_duration_ms": None if fit is None else fit.mean_ms,
            }
        return {"forget": self.forget, "min_samples": self.min_samples, "classes": out}
