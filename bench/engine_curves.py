"""The ``llm`` engine's output tokens/s and inter-token time against concurrency, per GPU class.

Closed loop in virtual time: ``c`` clients, each sending a 256-token prompt (random tokens: no prefix
hits) for 256 output tokens and the next one as soon as it is answered, for three rounds; the
figures are over every request. Writes ``docs/engine-curves.png`` (and prints the table):

    python -m bench.engine_curves [--out docs/engine-curves.png]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from sim.engines.api import EngineRequest, Finished
from sim.engines.hardware import GPU_CLASSES
from sim.engines.llm import LlmEngine

CONCURRENCY: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def closed_loop(concurrency: int, gpu: str = "a100", *, rounds: int = 3, prompt: int = 256,
                output: int = 256) -> tuple[float, float]:
    """``concurrency`` clients back to back on one ``gpu`` engine: (output tokens/s, mean
    inter-token time s)."""
    rng = random.Random(concurrency)
    eng = LlmEngine(gpu)
    total = concurrency * rounds
    sent = 0
    itls: list[float] = []
    last = 0.0

    def send(t: float) -> None:
        nonlocal sent
        sent += 1
        eng.submit(EngineRequest(f"r{sent}", tuple(rng.randrange(32000) for _ in range(prompt)), output, t), t)

    for _ in range(concurrency):
        send(0.0)
    while len(itls) < total:
        t = eng.next_event_s()
        assert t is not None
        for e in eng.advance(t):
            if isinstance(e, Finished):
                last = e.time_s
                itls.append((e.time_s - e.first_token_s) / (e.output_tokens - 1))
                if sent < total:
                    send(t)
    return total * output / last, sum(itls) / len(itls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/engine-curves.png"))
    out = ap.parse_args().out
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_itl) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    print("gpu   " + " ".join(f"{c:>14}" for c in CONCURRENCY))
    for gpu in GPU_CLASSES:
        points = [closed_loop(c, gpu) for c in CONCURRENCY]
        print(f"{gpu:5} " + " ".join(f"{tps:7.0f}/{itl * 1000:5.1f}ms" for tps, itl in points))
        ax_tps.plot(CONCURRENCY, [p[0] for p in points], marker="o", label=gpu)
        ax_itl.plot(CONCURRENCY, [p[1] * 1000 for p in points], marker="o", label=gpu)
    for ax in (ax_tps, ax_itl):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests (256-token prompts, 256 output tokens)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_tps.set_ylabel("output tokens/s")
    ax_tps.set_yscale("log")
    ax_itl.set_ylabel("mean inter-token time (ms)")
    fig.suptitle("llm engine, Llama-3.1-8B (virtual time, python -m bench.engine_curves)")
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
