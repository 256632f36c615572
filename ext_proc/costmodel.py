"""The request cost model: per GPU class, an online least-squares fit of duration and TTFT.

Source of the rule: "equal-cost" balancing with a weighted linear regression of a request's cost
from its prompt and output tokens (the seed design, issue 13); the fit is ordinary least squares
with exponential forgetting (recursive least squares with a forgetting factor, as in Ljung &
Söderström, *Theory and Practice of Recursive Identification*, 1983): each observation's weight
decays by ``forget`` per later observation of its class, so the fit follows a GPU class whose speed
changes (another model, a hot node) and old data fades out.

- duration (ms) ~ a + b x prompt_ktokens + c x output_ktokens + d x load
- TTFT (ms)     ~ a + b x prompt_ktokens + m x miss + e x miss x prompt_ktokens
- TTFT (ms)     ~ a + b x prompt_ktokens + m x uncached + e x uncached x prompt_ktokens + g x load
  (kept apart, for the ``predicted-latency`` picker,
  :mod:`ext_proc.scheduling.plugins.predicted_latency`)

``load`` is the work already in flight on the chosen endpoint when the request was picked (units
of a typical request), so ``d`` is what one more request running beside it costs a request (ms);
``miss`` is 1 when the request did not go to the endpoint its affinity key pointed at (a new
session, a spill, no key), so ``m + e x prompt_ktokens`` is the prefill a KV-cache hit saves (ms);
``uncached`` is the share of the prompt's blocks the picker's prefix index did not say the chosen
endpoint held (0-1; ``miss`` when the blocks are unknown), so there ``m + e x prompt_ktokens`` is
the prefill of the whole prompt, and ``g`` is what each typical request in flight on the endpoint
adds to a request's TTFT (ms): the work ahead of its first token. With a binary ``miss`` and
without the cached share, load is confounded with the cache (the endpoint holding a prompt gets
both the load and the fast TTFTs: ``g`` came out negative in the lab).
Together they give the **cost-aware affinity slack** (:meth:`CostModel.affinity_slack`): how many
requests of imbalance keeping a request on its cached endpoint is worth, the trade behind NVIDIA
Dynamo's KV router (prefill blocks against active blocks) and llm-d's prefix and load scorers,
here learned from the backends' own times instead of weighed by hand.

Learned from Envoy's access log: each completion of a pick whose tokens the picker knew (read from
the OpenAI body or the request class) adds one observation: the features recorded at pick time
and the times Envoy reports (``time_to_last_downstream_tx_byte``, ``time_to_first_upstream_rx_byte``).

The request path only reads :meth:`CostModel.relative_work`, :meth:`CostModel.affinity_slack` and,
with the ``predicted-latency`` picker, :attr:`CostModel.fits` (:meth:`Fit.queue_ms`,
:meth:`Fit.prefill_ms`): a dictionary read and a few multiplications each. Observations are summed in plain floats
(``observe``, once per completion); the small systems are solved once a second (:meth:`refit`,
from the picker's housekeeping) with numpy. A class is *ready* after ``min_samples`` observations;
until then every request weighs 1 (request counting, the classic bounded loads) and the slack is
the configured one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["CostModel", "Fit"]

_RIDGE = 1e-6
#: Relative work is clamped to this range (a request is at most 50x or 1/50 of a typical one).
_MIN_WORK, _MAX_WORK = 0.02, 50.0
#: Below this many ms per request in flight, load is taken to cost nothing measurable (no slack cap).
_MIN_LOAD_MS = 0.01
#: Observations with and without a miss each needed before the TTFT fit tells a miss's cost.
_MIN_EACH = 5


@dataclass(frozen=True, slots=True)
class Fit:
    """The solved model of one GPU class.

    Attributes:
        duration: ``(a ms, b ms per 1000 prompt tokens, c ms per 1000 output tokens, d ms per
            typical request in flight on the endpoint at pick time)``.
        ttft: ``(a ms, b ms per 1000 prompt tokens, m ms for a miss, e ms per 1000 prompt tokens of
            a miss)``, or None without enough TTFT data (hits and misses).
        ttft_load: the TTFT fit on the uncached share with a load term: ``(a ms, b ms per 1000
            prompt tokens, m ms for a whole prompt uncached, e ms per 1000 prompt tokens uncached,
            g ms per typical request in flight on the endpoint at pick time)``; None when ``ttft``
            is.
        mean_ms: the forgetting-weighted mean duration (ms): the cost of a "typical" request.
        mean_load: the forgetting-weighted mean load at pick time (typical requests).
        samples: observations seen (not decayed).
    """

    duration: tuple[float, float, float, float]
    ttft: tuple[float, float, float, float] | None
    mean_ms: float
    mean_load: float
    samples: int
    ttft_load: tuple[float, float, float, float, float] | None = None

    def predict_ms(self, prompt_tokens: float, output_tokens: float, load: float | None = None) -> float:
        """Predicted duration (ms) of a request picked beside ``load`` work in flight (None: the
        mean load); never below 1 ms."""
        a, b, c, d = self.duration
        x = self.mean_load if load is None else load
        return max(1.0, a + b * prompt_tokens / 1000.0 + c * output_tokens / 1000.0 + d * x)

    def queue_ms(self) -> float | None:
        """What one typical request in flight on an endpoint of this class adds to a new request's
        TTFT (ms, >= 0: ``ttft_load``'s ``g``); None without TTFT data."""
        return None if self.ttft_load is None else max(0.0, self.ttft_load[4])

    def prefill_ms(self, prompt_tokens: float) -> float | None:
        """The prefill of a whole uncached prompt of ``prompt_tokens`` (ms, >= 0: ``ttft_load``'s
        ``m + e x prompt ktokens``); None without TTFT data."""
        if self.ttft_load is None:
            return None
        _, _, m, e, _ = self.ttft_load
        return max(0.0, m + e * prompt_tokens / 1000.0)

    def hit_saving_ms(self, prompt_tokens: float) -> float | None:
        """The prefill a KV-cache hit saves a request of ``prompt_tokens`` (ms, >= 0); None without
        TTFT data."""
        if self.ttft is None:
            return None
        _, _, m, e = self.ttft
        return max(0.0, m + e * prompt_tokens / 1000.0)


class _Sums:
    """Forgetting-weighted sufficient statistics of one class: X'X and X'y of the three fits
    (:func:`_accumulate`, :func:`_accumulate5`), and the means."""

    __slots__ = ("duration", "ttft", "ttft_load", "w", "wy", "wl", "n", "nt", "misses")

    def __init__(self) -> None:
        self.duration = self.ttft = _NO_STATS
        self.ttft_load = _NO_STATS5
        self.w = self.wy = self.wl = 0.0
        self.n = self.nt = self.misses = 0

    def add(self, p: float, o: float, load: float, y: float, ttft: float | None, miss: bool, forget: float,
            uncached: float | None = None) -> None:
        self.duration = _accumulate(self.duration, 1.0, p, o, load, y, forget)
        self.w = self.w * forget + 1.0
        self.wy = self.wy * forget + y
        self.wl = self.wl * forget + load
        self.n += 1
        if ttft is not None:
            f = 1.0 if miss else 0.0
            self.ttft = _accumulate(self.ttft, 1.0, p, f, f * p, ttft, forget)
            u = f if uncached is None else uncached
            self.ttft_load = _accumulate5(self.ttft_load, 1.0, p, u, u * p, load, ttft, forget)
            self.nt += 1
            self.misses += miss


_NO_STATS = (0.0,) * 14
_NO_STATS5 = (0.0,) * 20


def _accumulate(stats: tuple[float, ...], a: float, b: float, c: float, d: float, y: float, forget: float
                ) -> tuple[float, ...]:
    """One more observation ``x = (a, b, c, d)``, ``y`` of a least-squares fit with forgetting:
    ``stats`` (X'X's upper triangle row by row, 10 values, then X'y, 4) each times ``forget`` plus
    the observation's term. X'X is symmetric, so its lower triangle is the upper one (each value is
    the same product, ``x_i x_j = x_j x_i`` exactly) and is not kept; one tuple of locals, not a loop
    over 20 list items (0.5 µs against 2.1 µs an observation, timeit)."""
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, t0, t1, t2, t3 = stats
    f = forget
    return (s0 * f + a * a, s1 * f + a * b, s2 * f + a * c, s3 * f + a * d, s4 * f + b * b, s5 * f + b * c,
            s6 * f + b * d, s7 * f + c * c, s8 * f + c * d, s9 * f + d * d,
            t0 * f + a * y, t1 * f + b * y, t2 * f + c * y, t3 * f + d * y)


def _accumulate5(stats: tuple[float, ...], a: float, b: float, c: float, d: float, e: float, y: float,
                 forget: float) -> tuple[float, ...]:
    """:func:`_accumulate` for five features ``x = (a, b, c, d, e)``: X'X's upper triangle row by row
    (15 values), then X'y (5), each times ``forget`` plus the observation's term; one tuple of locals
    (1.0-1.3 µs against 3.2 µs for comprehensions over the pairs; timeit, best of 5, 2026-12-07)."""
    (s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, t0, t1, t2, t3, t4) = stats
    f = forget
    return (s0 * f + a * a, s1 * f + a * b, s2 * f + a * c, s3 * f + a * d, s4 * f + a * e,
            s5 * f + b * b, s6 * f + b * c, s7 * f + b * d, s8 * f + b * e,
            s9 * f + c * c, s10 * f + c * d, s11 * f + c * e,
            s12 * f + d * d, s13 * f + d * e,
            s14 * f + e * e,
            t0 * f + a * y, t1 * f + b * y, t2 * f + c * y, t3 * f + d * y, t4 * f + e * y)


#: Where X'X's upper triangle (``_accumulate``'s first 10 values, ``_accumulate5``'s first 15) goes
#: in the k x k matrix.
_TRIU = {k: np.triu_indices(k) for k in (4, 5)}


def _solve(stats: tuple[float, ...], k: int = 4) -> tuple[float, ...] | None:
    rows, cols = _TRIU[k]
    n = len(rows)
    a = np.zeros((k, k))
    a[rows, cols] = stats[:n]
    a[cols, rows] = stats[:n]
    a += np.eye(k) * _RIDGE * max(1.0, float(np.trace(a)))
    try:
        coef = np.linalg.solve(a, np.array(stats[n:], dtype=float))
    except np.linalg.LinAlgError:
        return None
    if not np.all(np.isfinite(coef)):
        return None
    return tuple(float(c) for c in coef)


class CostModel:
    """Per-GPU-class online fits of request duration and TTFT from prompt and output tokens, the
    load a request was picked beside, and whether it missed its KV cache.

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
                ttft_ms: float | None = None, load: float = 0.0, miss: bool = True,
                uncached: float | None = None) -> None:
        """Add one finished request (tokens as known at pick time; times in ms; ``load``: the work in
        flight on its endpoint when it was picked; ``miss``: it did not go where its affinity key
        pointed; ``uncached``: the share of its prompt the endpoint did not hold, 0-1, None:
        unknown, ``miss`` stands for it). Bad values are ignored."""
        if not (duration_ms > 0 and math.isfinite(duration_ms) and prompt_tokens >= 0 and output_tokens >= 0
                and load >= 0 and math.isfinite(load)):
            return
        if ttft_ms is not None and not (ttft_ms >= 0 and math.isfinite(ttft_ms)):
            ttft_ms = None
        sums = self._sums.get(gpu_class)
        if sums is None:
            sums = self._sums[gpu_class] = _Sums()
        if uncached is not None and not 0.0 <= uncached <= 1.0:
            uncached = None
        sums.add(prompt_tokens / 1000.0, output_tokens / 1000.0, load, duration_ms, ttft_ms, miss, self.forget,
                 uncached)

    def refit(self) -> dict[str, Fit]:
        """Solve every class with at least ``min_samples`` observations; returns (and keeps) the fits.

        The TTFT fit also needs :data:`_MIN_EACH` observations with a miss and as many without."""
        fits: dict[str, Fit] = {}
        for gpu_class, s in self._sums.items():
            if s.n < self.min_samples or s.w <= 0:
                continue
            duration = _solve(s.duration)
            if duration is None:
                continue
            ttft = ttft_load = None
            if s.nt >= self.min_samples and min(s.misses, s.nt - s.misses) >= _MIN_EACH:
                ttft = _solve(s.ttft)
                ttft_load = _solve(s.ttft_load, 5) if ttft is not None else None
            fits[gpu_class] = Fit(duration, ttft, s.wy / s.w, s.wl / s.w, s.n, ttft_load)  # type: ignore[arg-type]
        self.fits = fits
        return fits

    def relative_work(self, gpu_class: str | None, prompt_tokens: float | None, output_tokens: float | None) -> float:
        """A request's predicted cost in units of a typical request of that class (1.0 = typical),
        at the class's mean load.

        1.0 when the class has no ready fit or the tokens are unknown (then loads are request counts).
        """
        if prompt_tokens is None or output_tokens is None:
            return 1.0
        fit = self.fits.get(gpu_class) if gpu_class is not None else None
        if fit is None or fit.mean_ms <= 0:
            return 1.0
        work = fit.predict_ms(prompt_tokens, output_tokens) / fit.mean_ms
        return _MIN_WORK if work < _MIN_WORK else _MAX_WORK if work > _MAX_WORK else work

    def affinity_slack(self, gpu_class: str | None, prompt_tokens: float | None) -> float | None:
        """The cost-aware affinity slack of a request (typical requests, >= 0; ``inf`` when load
        costs nothing measurable), None when the class's fit cannot tell (not ready, no TTFT data,
        unknown prompt).

        Keeping a request on the endpoint with its KV cache saves ``s`` ms of prefill
        (:meth:`Fit.hit_saving_ms`); each request of imbalance there costs it ``d`` ms (the
        duration's load coefficient) and costs each request running beside it about as much, so
        the slack is ``s / (2 d)``: beyond that many requests more than the least loaded endpoint,
        the cache hit is worth less than the slower batch.
        """
        if prompt_tokens is None or gpu_class is None:
            return None
        fit = self.fits.get(gpu_class)
        if fit is None:
            return None
        saving = fit.hit_saving_ms(prompt_tokens)
        if saving is None:
            return None
        d = fit.duration[3]
        if d < _MIN_LOAD_MS:
            return math.inf
        return saving / (2.0 * d)

    def describe(self) -> dict:
        """JSON-ready: per class the coefficients, means, samples and readiness (for the admin API)."""
        out = {}
        for gpu_class, s in sorted(self._sums.items()):
            fit = self.fits.get(gpu_class)
            out[gpu_class] = {
                "samples": s.n,
                "ready": fit is not None,
                "duration_ms": None if fit is None else {
                    "intercept": fit.duration[0], "per_1k_prompt_tokens": fit.duration[1],
                    "per_1k_output_tokens": fit.duration[2], "per_request_in_flight": fit.duration[3]},
                "ttft_ms": None if fit is None or fit.ttft is None else {
                    "intercept": fit.ttft[0], "per_1k_prompt_tokens": fit.ttft[1],
                    "miss": fit.ttft[2], "per_1k_prompt_tokens_of_a_miss": fit.ttft[3]},
                "ttft_uncached_ms": None if fit is None or fit.ttft_load is None else dict(zip(
                    ("intercept", "per_1k_prompt_tokens", "uncached", "per_1k_prompt_tokens_uncached",
                     "per_request_in_flight"), fit.ttft_load, strict=True)),
                "mean_duration_ms": None if fit is None else fit.mean_ms,
                "mean_load": None if fit is None else fit.mean_load,
                "ttft_misses": s.misses,
            }
        return {"forget": self.forget, "min_samples": self.min_samples, "classes": out}
