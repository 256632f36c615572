"""One ``llm`` engine's KV-cache usage, queue and preemptions as its load nears and passes what it can
serve: the figures behind the ``gpu_memory`` factor's ``kv_full`` and the GPU classes' capacities.

Feeds one engine of ``--gpu`` Poisson arrivals of the reference request (random prompts of
:data:`~sim.engines.hardware.REFERENCE_PROMPT_TOKENS` tokens for
:data:`~sim.engines.hardware.REFERENCE_OUTPUT_TOKENS`, so the prefix cache hits only by chance) at
each ``--loads`` share of the rate the engine physics predicts it saturates at
(:func:`sim.engines.hardware.saturated_requests_per_s`), for ``--seconds`` of virtual time, sampling
its gauges every second. Prints per load the mean KV-cache usage, waiting and running requests over
the last ``--window`` seconds (the slow loop's window) and the preemptions in it. Virtual time only.

    python -m bench.kv_saturation                       # A10, 0.6-1.2 x its saturated rate
    python -m bench.kv_saturation --gpu a100 --loads 0.8 1.0 1.1
"""

from __future__ import annotations

import argparse
import random

from sim.engines.api import EngineRequest
from sim.engines.hardware import (
    DEFAULT_MODEL,
    GPU_CLASSES,
    MODELS,
    REFERENCE_OUTPUT_TOKENS,
    REFERENCE_PROMPT_TOKENS,
    saturated_requests_per_s,
)
from sim.engines.llm import BLOCK_SIZE, LlmEngine
from sim.tokens import VOCAB_SIZE


def run(gpu: str, rate: float, seconds: float, window: float, seed: int) -> dict[str, float]:
    """One engine at ``rate`` requests/s for ``seconds``: ``kv``, ``waiting``, ``running`` (means of the
    1 s samples in the last ``window`` s) and ``preemptions`` (in that window)."""
    rng = random.Random(seed)
    engine = LlmEngine(gpu)
    samples: list[tuple[float, float, float, int]] = []
    arrival, n, now = rng.expovariate(rate), 0, 0.0
    while now < seconds:
        now += 1.0
        while arrival <= now:
            prompt = tuple(rng.randrange(1, VOCAB_SIZE) for _ in range(REFERENCE_PROMPT_TOKENS))
            engine.submit(EngineRequest(f"r{n}", prompt, REFERENCE_OUTPUT_TOKENS, arrival), arrival)
            n += 1
            arrival += rng.expovariate(rate)
        engine.advance(now)
        st = engine.stats()
        if now > seconds - window:
            samples.append((st.kv_usage, st.waiting, st.running, st.preemptions))
    k = len(samples)
    return {"kv": sum(s[0] for s in samples) / k, "waiting": sum(s[1] for s in samples) / k,
            "running": sum(s[2] for s in samples) / k, "preemptions": samples[-1][3] - samples[0][3]}


def main() -> None:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="a10", choices=sorted(GPU_CLASSES))
    ap.add_argument("--loads", type=float, nargs="+", default=[0.6, 0.8, 0.9, 1.0, 1.1, 1.2],
                    help="shares of the predicted saturated rate")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    saturated = saturated_requests_per_s(MODELS[DEFAULT_MODEL], GPU_CLASSES[a.gpu], block_size=BLOCK_SIZE)
    print(f"{a.gpu}: predicted saturated rate {saturated:.2f} requests/s "
          f"({REFERENCE_PROMPT_TOKENS} + {REFERENCE_OUTPUT_TOKENS} tokens)")
    print("load  requests/s  kv_mean  waiting_mean  running_mean  preemptions")
    for load in a.loads:
        r = run(a.gpu, load * saturated, a.seconds, a.window, a.seed)
        print(f"{load:4.2f}  {load * saturated:10.2f}  {r['kv']:7.3f}  {r['waiting']:12.1f}  {r['running']:12.1f}  "
              f"{r['preemptions']:11.0f}", flush=True)


if __name__ == "__main__":
    main()
