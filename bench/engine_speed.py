"""How fast the ``llm`` engine simulates, in virtual time (the policy lab's budget).

Drives ``--engines`` A100 ``llm`` engines the way the lab does (one heap of the engines' next event
times and the arrivals; each engine advanced only when its next event or an arrival comes), with
Poisson arrivals of ``--prompt``-token prompts (random, so the prefix cache hits only by chance)
for ``--output`` tokens at ``--rate`` requests per second per engine, for ``--minutes`` of virtual
time. Prints the CPU seconds of the run (``time.process_time``: the engines and this driver) and
what the engines saw. Virtual time only: no sockets, no sleeps; safe to run beside other work (the
CPU figure then includes the slowdown of a shared core).

    python -m bench.engine_speed                         # 16 engines, 10 min, 13 req/s each
    python -m bench.engine_speed --engines 64 --minutes 1
"""

from __future__ import annotations

import argparse
import heapq
import random
import time

from sim.engines.api import EngineRequest, Finished, FirstToken
from sim.engines.llm import LlmEngine


def run(engines: int, rate: float, minutes: float, prompt: int, output: int, seed: int) -> dict[str, float]:
    """One run; returns ``cpu_s``, ``requests``, ``finished``, ``mean_running`` (per engine, sampled at
    arrivals), ``ttft_p50_s``, ``tpot_s`` (mean time per output token after the first)."""
    rng = random.Random(seed)
    duration = minutes * 60.0
    arrivals: list[tuple[float, int]] = []
    t = 0.0
    while (t := t + rng.expovariate(rate * engines)) < duration:
        arrivals.append((t, rng.randrange(engines)))
    prompts = [tuple(rng.randrange(32000) for _ in range(prompt)) for _ in range(4096)]
    fleet = [LlmEngine("a100") for _ in range(engines)]
    heap: list[tuple[float, int, int]] = []
    version = [0] * engines
    finished = 0
    running_sum = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    arrived: dict[str, float] = {}

    def reschedule(k: int) -> None:
        version[k] += 1
        nxt = fleet[k].next_event_s()
        if nxt is not None:
            heapq.heappush(heap, (nxt, k, version[k]))

    def handle(events: list) -> None:
        nonlocal finished
        for e in events:
            if isinstance(e, FirstToken):
                ttfts.append(e.time_s - arrived[e.request_id])
            elif isinstance(e, Finished):
                finished += 1
                tpots.append((e.time_s - e.first_token_s) / max(1, e.output_tokens - 1))
                del arrived[e.request_id]

    started = time.process_time()
    i = 0
    while i < len(arrivals) or heap:
        while heap and heap[0][2] != version[heap[0][1]]:
            heapq.heappop(heap)
        if i < len(arrivals) and (not heap or arrivals[i][0] <= heap[0][0]):
            t, k = arrivals[i]
            rid = f"r{i}"
            arrived[rid] = t
            fleet[k].submit(EngineRequest(rid, prompts[i % len(prompts)], output, t), t)
            running_sum += fleet[k].stats().running
            i += 1
            reschedule(k)
        elif heap:
            t, k, _ = heapq.heappop(heap)
            handle(fleet[k].advance(t))
            reschedule(k)
    cpu = time.process_time() - started
    ttfts.sort()
    return {"cpu_s": cpu, "requests": len(arrivals), "finished": finished,
            "mean_running": running_sum / max(1, len(arrivals)), "ttft_p50_s": ttfts[len(ttfts) // 2],
            "tpot_s": sum(tpots) / len(tpots)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--rate", type=float, default=13.0, help="requests/s per engine (A100 256/256 saturates ~14)")
    ap.add_argument("--minutes", type=float, default=10.0, help="virtual minutes")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    r = run(a.engines, a.rate, a.minutes, a.prompt, a.output, a.seed)
    print(f"{a.engines} A100 llm engines, {a.minutes:g} virtual min, {a.rate:g} req/s each, "
          f"{a.prompt}/{a.output} tokens: {r['requests']} requests ({r['finished']} finished), "
          f"mean running per engine {r['mean_running']:.0f}, TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms, "
          f"TPOT {r['tpot_s'] * 1000:.1f} ms; CPU {r['cpu_s']:.1f} s")


if __name__ == "__main__":
    main()
