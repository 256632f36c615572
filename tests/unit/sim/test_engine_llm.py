"""The llm engine: calibration against BLIS's fits, vLLM V1's scheduling rules (checked against a
literal step-by-step model of them), the KV cache, the contract's guarantees."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from bench.engine_curves import closed_loop
from sim.engines.api import (
    FAIL_TOO_LONG,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineRequest,
    Failed,
    Finished,
    FirstToken,
    Tokens,
)
from sim.engines.hardware import GPU_CLASSES, MODELS, kv_cache_blocks, step_coefficients
from sim.engines.kv import chain_hashes
from sim.engines.llm import LlmEngine

LLAMA = MODELS["llama-3.1-8b"]
A100 = step_coefficients(LLAMA, GPU_CLASSES["a100"])
US = 1e-6


def prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(32000) for _ in range(n))


def drive(engine: LlmEngine, arrivals: list[tuple[float, EngineRequest]], *, until: float = 1e9,
          extra_times: list[float] = ()) -> list:
    """Submit ``arrivals`` (time-sorted) and advance to each next event and each of ``extra_times``."""
    events: list = []
    todo = sorted([(t, 0, r) for t, r in arrivals] + [(t, 1, None) for t in extra_times], key=lambda x: x[:2])
    i = 0
    while True:
        nxt = engine.next_event_s()
        ta = todo[i][0] if i < len(todo) else None
        if ta is not None and (nxt is None or ta <= nxt):
            t, kind, r = todo[i]
            i += 1
            events += engine.advance(t)
            if kind == 0:
                engine.submit(r, t)
            continue
        if nxt is None or nxt > until:
            return events
        events += engine.advance(nxt)


def by_type(events: list, kind: type) -> dict[str, object]:
    return {e.request_id: e for e in events if isinstance(e, kind)}


# --- calibration -----------------------------------------------------------------------------------

def test_step_times_are_blis_fits():
    """A lone request's first token takes one prefill step, each later token one decode step of
    batch 1; a 64-request batch's decode step: BLIS's β0 + β2·64 (within 2 %: here exact)."""
    eng = LlmEngine("a100", stream=True)
    eng.submit(EngineRequest("a", prompt(1, 512), 32, 0.0), 0.0)
    events = drive(eng, [])
    first = by_type(events, FirstToken)["a"]
    assert first.time_s == pytest.approx((A100.beta0_us + 512 * A100.beta1_us) * US, rel=0.02)
    done = by_type(events, Finished)["a"]
    itl = (done.time_s - first.time_s) / 31
    assert itl == pytest.approx((A100.beta0_us + A100.beta2_us) * US, rel=0.02)
    # 64 decoding together: their steady inter-token time is one step of batch 64.
    eng = LlmEngine("a100", stream=True)
    for i in range(64):
        eng.submit(EngineRequest(f"r{i}", prompt(i, 16), 200, 0.0), 0.0)
    events = drive(eng, [], extra_times=[3.0, 3.5])
    late = [e for e in events if isinstance(e, Tokens) and e.time_s > 3.0]
    assert late and all(e.itl_s == pytest.approx((A100.beta0_us + 64 * A100.beta2_us) * US, rel=0.02) for e in late)


def test_h100_fit_and_derived_classes():
    h100 = step_coefficients(LLAMA, GPU_CLASSES["h100"])
    assert (h100.beta0_us, h100.beta1_us, h100.beta2_us) == pytest.approx((5752.705, 17.2509, 5.99914), rel=1e-5)
    a10 = step_coefficients(LLAMA, GPU_CLASSES["a10"])
    assert a10.beta0_us == pytest.approx(5752.705 * 3350 / 600, rel=1e-5)
    assert a10.beta1_us == pytest.approx(17.2509 * 989 / 125, rel=1e-5)
    assert "derived" in a10.source and "BLIS" in h100.source


def test_fp8_checkpoint_is_derived_from_its_bf16_model():
    """The FP8 checkpoint on an L4 (FP8 tensor cores): beta0 x the weight-byte ratio (8.46 / 14.96 GiB),
    beta1 x the BF16 / FP8 FLOP ratio (121 / 242.5), beta2 as BF16; on an A100 (no FP8: weight-only
    FP8, BF16 compute) beta1 unchanged."""
    fp8 = MODELS["llama-3.1-8b-fp8"]
    assert fp8.weights_gib == pytest.approx(8.46)
    l4, l4_fp8 = step_coefficients(LLAMA, GPU_CLASSES["l4"]), step_coefficients(fp8, GPU_CLASSES["l4"])
    assert l4_fp8.beta0_us == pytest.approx(l4.beta0_us * 8.46 / 14.96)
    assert l4_fp8.beta1_us == pytest.approx(l4.beta1_us * 121 / 242.5)
    assert l4_fp8.beta2_us == l4.beta2_us
    a100_fp8 = step_coefficients(fp8, GPU_CLASSES["a100"])
    assert (a100_fp8.beta1_us, a100_fp8.beta2_us) == (A100.beta1_us, A100.beta2_us)
    assert a100_fp8.beta0_us == pytest.approx(A100.beta0_us * 8.46 / 14.96)


def test_fp8_kv_cache_holds_twice_the_tokens():
    """``kv_cache_dtype="fp8"``: one byte per value, so twice the blocks in the same memory; KubeAI's
    L4 engines (FP8 weights and KV, 0.95 of 24 GiB): (22.8 - 8.46 - 3.05) GiB / 64 KiB per token."""
    assert kv_cache_blocks(LLAMA, 81920, block_size=16, kv_cache_dtype="fp8") == int((72 - 14.96 - 3.05) * 1024)
    eng = LlmEngine("l4", "llama-3.1-8b-fp8", kv_cache_dtype="fp8", gpu_memory_utilization=0.95)
    tokens = eng.spec.num_blocks * eng.spec.block_size
    assert tokens == 16 * int((24 * 0.95 - 8.46 - 3.05) * 1024 ** 3 // (64 * 1024 * 16))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LlmEngine("l4", kv_cache_dtype="int4")


@pytest.mark.parametrize("gpu", sorted(GPU_CLASSES))
def test_batching_raises_throughput_not_inter_token_time(gpu):
    """1 -> 16 concurrent 256/256 requests: output tokens/s >= 8x, inter-token time <= 1.3x (A100:
    15.1x and 1.04x)."""
    tps1, itl1 = closed_loop(1, gpu)
    tps16, itl16 = closed_loop(16, gpu)
    assert tps16 >= 8 * tps1
    assert itl16 <= 1.3 * itl1


def test_a_cached_prefix_skips_its_prefill():
    """A prompt whose first 2 000 tokens are cached: TTFT lower by those tokens' prefill (2 000 x β1,
    and one chunk step fewer: 2 100 uncached tokens take two steps under the 2 048-token budget)."""
    shared = prompt(7, 2000)
    eng = LlmEngine("a100")
    eng.submit(EngineRequest("cold", shared + prompt(8, 100), 8, 0.0), 0.0)
    cold_events = drive(eng, [])
    t = cold_events[-1].time_s + 1.0
    eng.submit(EngineRequest("warm", shared + prompt(9, 100), 8, t), t)
    warm_events = drive(eng, [])
    cold = by_type(cold_events, FirstToken)["cold"]
    warm = by_type(warm_events, FirstToken)["warm"]
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 2000)
    ttft_cold, ttft_warm = cold.time_s, warm.time_s - t
    assert ttft_cold == pytest.approx((2 * A100.beta0_us + 2100 * A100.beta1_us) * US)
    assert ttft_cold - ttft_warm == pytest.approx((A100.beta0_us + 2000 * A100.beta1_us) * US)
    assert by_type(warm_events, Finished)["warm"].cached_tokens == 2000
    assert eng.stats().prefix_hits == 2000 and eng.stats().prefix_queries == 4200


def test_a_reply_the_client_resends_is_found_cached():
    """A request that carries its output ids (a chat's real reply) leaves the blocks full of its
    computed tokens (prompt + all outputs but the last) cached when it finishes: the next turn
    (history + reply + new question) finds them; without the ids only the prompt's blocks stay."""
    history, reply, question = prompt(11, 300), prompt(12, 200), prompt(13, 50)
    for ids, cached in ((reply, (300 + 200 - 1) // 16 * 16), (None, 300 // 16 * 16)):
        eng = LlmEngine("a100")
        eng.submit(EngineRequest("turn1", history, 200, 0.0, output_ids=ids), 0.0)
        drive(eng, [])
        t = 100.0
        eng.submit(EngineRequest("turn2", history + reply + question, 8, t), t)
        assert by_type(drive(eng, []), Finished)["turn2"].cached_tokens == cached
    with pytest.raises(ValueError, match="output_ids"):
        EngineRequest("x", history, 3, 0.0, output_ids=(1, 2))


def test_a_full_kv_cache_makes_requests_wait_never_fail():
    """An A10 holds 29 408 tokens of KV: 40 requests of 2 000 + 200 tokens cannot all run; the rest
    wait (num_requests_waiting > 0), nothing fails, everyone finishes."""
    eng = LlmEngine("a10")
    assert eng.spec.num_blocks * 16 == 29408
    for i in range(40):
        eng.submit(EngineRequest(f"r{i}", prompt(i, 2000), 200, 0.0), 0.0)
    waiting = []
    events = []
    while (t := eng.next_event_s()) is not None:
        events += eng.advance(t)
        waiting.append(eng.stats().waiting)
    assert max(waiting) > 0
    assert not [e for e in events if isinstance(e, Failed)]
    assert len(by_type(events, Finished)) == 40
    assert eng.stats().kv_blocks_used == 0


def test_decode_growth_preempts_the_last_admitted_request():
    """Requests admitted while their prompts fit grow past the KV cache while decoding: vLLM V1
    preempts the last-admitted running request (FCFS: ``self.running.pop()``); it recomputes and
    still finishes, with its preemptions counted."""
    eng = LlmEngine("a10", prefix_caching=False)
    blocks = eng.spec.num_blocks
    n = 8
    plen = (blocks * 16) // (n + 1)  # all prompts fit, their outputs do not
    for i in range(n):
        eng.submit(EngineRequest(f"r{i}", prompt(i, plen), plen, 0.0), 0.0)
    events = drive(eng, [])
    done = by_type(events, Finished)
    assert len(done) == n
    assert eng.stats().preemptions > 0
    assert done["r0"].preemptions == 0 and done[f"r{n - 1}"].preemptions > 0
    assert eng.stats().kv_blocks_used == 0


# --- vLLM V1's rules, step by step -----------------------------------------------------------------

@dataclass
class _R:
    rid: str
    arrival: float
    prompt: tuple[int, ...]
    target: int
    out: int = 0
    computed: int = 0
    held: int = 0
    cached: int = -1
    preemptions: int = 0
    decoding: bool = False
    keys: list[int] = field(default_factory=list)


class Reference:
    """vLLM V1's scheduler written out literally, one loop iteration per step and per request: the
    running list first (preempting its tail when blocks run out), then the waiting queue FCFS; step
    time β0 + β1·prefill + β2·decode. The prefix cache never evicts here (tests keep KV ample when
    caching is on)."""

    def __init__(self, eng: LlmEngine) -> None:
        sp = eng.spec
        self.coef, self.bs, self.free = sp.coefficients, sp.block_size, sp.num_blocks
        self.max_seqs, self.budget, self.caching = sp.max_num_seqs, sp.max_num_batched_tokens, sp.prefix_caching
        self.cache: set[int] = set()

    def run(self, arrivals: list[tuple[float, EngineRequest]]) -> list[tuple]:
        pending = deque(sorted(arrivals, key=lambda a: a[0]))
        waiting: deque[_R] = deque()
        running: list[_R] = []
        out: list[tuple] = []
        t = 0.0
        bs = self.bs
        while pending or waiting or running:
            if not waiting and not running:
                t = max(t, pending[0][0])
            while pending and pending[0][0] <= t:
                a, r = pending.popleft()
                waiting.append(_R(r.request_id, a, r.prompt, r.output_tokens,
                                  keys=chain_hashes(r.prompt, bs) if self.caching else []))
            budget, preempted, sched, prefill, decode = self.budget, False, [], 0, 0
            i = 0
            while i < len(running) and budget > 0:
                r = running[i]
                ntok = len(r.prompt) + r.out
                if r.decoding:
                    n, need = 1, -(-ntok // bs) - r.held
                else:
                    n = min(ntok - r.computed, budget)
                    need = -(-(r.computed + n) // bs) - r.held
                gone = False
                while need > self.free:
                    v = running.pop()
                    self.free += v.held
                    v.held = v.computed = 0
                    v.decoding = False
                    v.preemptions += 1
                    waiting.appendleft(v)
                    preempted = True
                    if v is r:
                        gone = True
                        break
                if gone:
                    break
                self.free -= need
                r.held += need
                sched.append((r, n))
                if r.decoding:
                    decode += 1
                else:
                    prefill += n
                    self.store(r, r.computed + n)
                budget -= n
                i += 1
            while not preempted and waiting and budget > 0 and len(running) < self.max_seqs:
                r = waiting[0]
                ntok = len(r.prompt) + r.out
                hit = 0
                while self.caching and hit < (ntok - 1) // bs and hit < len(r.keys) and r.keys[hit] in self.cache:
                    hit += 1
                n = min(ntok - hit * bs, budget)
                need = -(-(hit * bs + n) // bs)
                if need > self.free:
                    break
                waiting.popleft()
                if r.cached < 0:
                    r.cached = hit * bs
                self.free -= need
                r.held, r.computed = need, hit * bs
                running.append(r)
                sched.append((r, n))
                prefill += n
                self.store(r, r.computed + n)
                budget -= n
            t += self.coef.step_s(prefill, decode)
            for r, n in sched:
                if r.decoding:
                    r.out += 1
                else:
                    r.computed += n
                    if r.computed < len(r.prompt) + r.out:
                        continue
                    r.out += 1
                    r.decoding = True
                    if r.out == 1:
                        out.append(("first", r.rid, t, r.cached))
                if r.out == r.target:
                    out.append(("done", r.rid, t, r.preemptions))
                    running.remove(r)
                    self.free += r.held
        return out

    def store(self, r: _R, known: int) -> None:
        if self.caching:
            self.cache.update(r.keys[:min(known, len(r.prompt)) // self.bs])


def engine_trace(eng: LlmEngine, arrivals) -> list[tuple]:
    out = []
    for e in drive(eng, arrivals):
        if isinstance(e, FirstToken):
            out.append(("first", e.request_id, e.time_s, e.cached_tokens))
        elif isinstance(e, Finished):
            out.append(("done", e.request_id, e.time_s, e.preemptions))
    return out


def assert_same(got: list[tuple], want: list[tuple]) -> None:
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g[2] == pytest.approx(w[2], rel=1e-9, abs=1e-9), (g, w)
        assert g[3] == w[3], (g, w)


def workload(seed: int, n: int, rate: float, *, shared: int = 0, plen=(20, 600), olen=(1, 300)):
    rng = random.Random(seed)
    prefixes = [prompt(seed * 1000 + i, 400) for i in range(shared)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        body = prompt(seed * 7919 + i, rng.randint(*plen))
        if shared and rng.random() < 0.7:
            body = rng.choice(prefixes) + body
        out.append((t, EngineRequest(f"q{i}", body, rng.randint(*olen), t)))
    return out


@pytest.mark.parametrize(("seed", "budget"), [(0, None), (1, None), (2, 256), (3, 256)])
def test_matches_vllm_rules_with_shared_prefixes(seed, budget):
    """Arrivals, chunked prefills (some prompts longer than the budget; a 256-token budget cuts most
    prompts into several chunk steps), prefix hits on shared prefixes, finishes: every first token
    and finish at the time the literal model gives."""
    arrivals = workload(seed, 120, 25.0, shared=5, plen=(20, 2600))
    eng = LlmEngine("a100", max_num_batched_tokens=budget)
    assert_same(engine_trace(eng, arrivals), Reference(eng).run(arrivals))


@pytest.mark.parametrize("seed", range(4))
def test_matches_vllm_rules_under_kv_pressure(seed):
    """A small KV cache (200 blocks), no prefix caching: waiting, preemption of the running list's
    tail, recomputation: the same times and preemption counts as the literal model."""
    arrivals = workload(seed, 60, 40.0, plen=(10, 700), olen=(50, 900))
    memory = (LLAMA.weights_gib + 3.05) * 1024 / 0.9 + 200 * 2 / 0.9 + 1  # MiB: room for 200 blocks
    eng = LlmEngine("a100", gpu_memory_mib=memory, prefix_caching=False, max_num_seqs=16,
                    max_num_batched_tokens=512)
    assert eng.spec.num_blocks == 200
    got = engine_trace(eng, arrivals)
    assert any(row[0] == "done" and row[3] > 0 for row in got)
    assert_same(got, Reference(eng).run(arrivals))


# --- the contract ----------------------------------------------------------------------------------

def test_advancing_more_often_changes_nothing():
    """The engine's closed forms: advancing at many extra times gives the same events (non-streaming)."""
    arrivals = workload(11, 80, 30.0, shared=3)
    a = drive(LlmEngine("a100"), arrivals)
    extra = [i * 0.0137 for i in range(3000)]
    b = drive(LlmEngine("a100"), arrivals, extra_times=extra)
    assert a == b


def test_deterministic_and_tokens_add_up():
    arrivals = workload(5, 60, 30.0, shared=2)
    a = drive(LlmEngine("h100", stream=True), arrivals, extra_times=[i * 0.05 for i in range(200)])
    b = drive(LlmEngine("h100", stream=True), arrivals, extra_times=[i * 0.05 for i in range(200)])
    assert a == b
    times = [e.time_s for e in a]
    assert times == sorted(times)
    done = by_type(a, Finished)
    assert len(done) == 60
    for rid, f in done.items():
        n = sum(e.count for e in a if isinstance(e, Tokens) and e.request_id == rid)
        assert n + 1 == f.output_tokens


def test_streaming_reports_tokens_as_they_come():
    eng = LlmEngine("a100", stream=True)
    eng.submit(EngineRequest("a", prompt(1, 100), 100, 0.0), 0.0)
    eng.advance(0.5)
    got = eng.advance(1.0)
    assert len(got) == 1 and isinstance(got[0], Tokens)
    step = (A100.beta0_us + A100.beta2_us) * US
    assert got[0].itl_s == pytest.approx(step) and got[0].count == pytest.approx(0.5 / step, abs=1)


def test_too_long_is_refused_at_once():
    eng = LlmEngine("a10")
    eng.submit(EngineRequest("big", prompt(1, 29000), 1000, 2.0), 2.0)
    [f] = eng.advance(2.0)
    assert isinstance(f, Failed) and f.reason == FAIL_TOO_LONG and f.time_s == 2.0
    assert "maximum context length is 29408 tokens" in f.detail
    assert eng.next_event_s() is None


def test_cancel_gives_blocks_back_and_silences_the_request():
    eng = LlmEngine("a100")
    eng.submit(EngineRequest("a", prompt(1, 300), 500, 0.0), 0.0)
    eng.submit(EngineRequest("b", prompt(2, 300), 50, 0.0), 0.0)
    eng.advance(0.3)
    assert eng.stats().kv_blocks_used > 0
    eng.cancel("a", 0.3)
    events = drive(eng, [])
    assert {e.request_id for e in events} == {"b"}
    assert eng.stats().kv_blocks_used == 0 and eng.stats().running == 0


def test_slow_factor_stretches_later_steps():
    eng = LlmEngine("a100")
    eng.submit(EngineRequest("a", prompt(1, 16), 200, 0.0), 0.0)
    eng.advance(1.0)
    eng.set_slow_factor(2.0, 1.0)
    events = drive(eng, [])
    fast = LlmEngine("a100")
    fast.submit(EngineRequest("a", prompt(1, 16), 200, 0.0), 0.0)
    t_fast = by_type(drive(fast, []), Finished)["a"].time_s
    t_slow = by_type(events, Finished)["a"].time_s
    assert t_slow == pytest.approx(1.0 + 2 * (t_fast - 1.0), abs=0.05)


def test_long_tail_request_decodes_one_step_in_n():
    eng = LlmEngine("a100")
    eng.submit(EngineRequest("slow", prompt(1, 16), 100, 0.0, slowdown=10), 0.0)
    eng.submit(EngineRequest("fast", prompt(2, 16), 100, 0.0), 0.0)
    done = by_type(drive(eng, []), Finished)
    assert done["slow"].time_s > 5 * done["fast"].time_s


def test_kv_events_as_vllm_publishes_them():
    eng = LlmEngine("a10", kv_events=True)
    p = prompt(3, 64)
    eng.submit(EngineRequest("a", p, 4, 0.0), 0.0)
    drive(eng, [])
    stored = [e for e in eng.drain_kv_events() if isinstance(e, BlockStored)]
    keys = chain_hashes(p, 16)
    assert stored[0].block_hashes == tuple(keys) and stored[0].parent_block_hash is None
    assert stored[0].token_ids == p and stored[0].block_size == 16
    assert eng.drain_kv_events() == []
    # Fill the cache with other prompts: the first one's blocks are evicted.
    t = 1.0
    for i in range(40):
        eng.submit(EngineRequest(f"f{i}", prompt(100 + i, 1500), 2, t), t)
        drive(eng, [])
        t += 1.0
    removed = {h for e in eng.drain_kv_events() if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert set(keys) <= removed
    assert eng.reset_prefix_cache(t)
    assert eng.drain_kv_events() == [AllBlocksCleared(t)]


def test_block_keys_given_by_the_caller_are_the_ones_the_engine_would_compute():
    shared = prompt(5, 160)
    runs = []
    for given in (False, True):
        eng = LlmEngine("a10", kv_events=True)
        arrivals = [(0.1 * i, EngineRequest(f"r{i}", shared + prompt(10 + i, 40 + i), 8, 0.1 * i,
                                            block_keys=tuple(chain_hashes(shared + prompt(10 + i, 40 + i), 16))
                                            if given else None)) for i in range(6)]
        runs.append((drive(eng, arrivals), eng.drain_kv_events(), eng.stats()))
    assert runs[0] == runs[1] and runs[0][2].prefix_hits > 0
    with pytest.raises(ValueError, match="block keys"):
        LlmEngine("a10").submit(EngineRequest("x", shared, 8, 0.0, block_keys=(1, 2)), 0.0)


def test_what_the_oracle_reads_matches_the_engine_state():
    eng = LlmEngine("a10")
    pool = eng._pool
    shared = prompt(6, 320)
    todo = [(0.05 * i, EngineRequest(f"r{i}", shared + prompt(20 + i, 600 + 64 * i), 40, 0.05 * i)) for i in range(30)]
    seen_prefill = False
    while todo or eng.next_event_s() is not None:
        nxt = eng.next_event_s()
        if todo and (nxt is None or todo[0][0] <= nxt):
            t, r = todo.pop(0)
            eng.advance(t)
            eng.submit(r, t)
        else:
            t = nxt
            eng.advance(t)
        idle = sum(1 for b in range(pool.num_blocks) if pool._ref[b] == 0 and pool._key[b] is not None)
        assert eng.idle_cached_blocks == idle
        stats = eng.stats()
        assert (eng.running, eng.free_blocks) == (stats.running, stats.kv_blocks_total - stats.kv_blocks_used)
        assert eng.step_end_s(t) >= t
        seen_prefill |= eng.prefilled_tokens() > 0
    assert seen_prefill and eng.idle_cached_blocks > 0
    keys = chain_hashes(shared, 16)
    assert eng.prefix_users(keys) == [0] * 20  # cached, no request uses them now
    assert eng.step_end_s(1e6) == 1e6 and eng.prefilled_tokens() == 0  # idle: a request starts at once


def test_capacity_from_memory():
    """(80 GiB x 0.9 - 14.96 GiB weights - 3.05 GiB reserve) / 2 MiB per block (16 x 128 KiB)."""
    assert kv_cache_blocks(LLAMA, 81920, block_size=16) == int((72 - 14.96 - 3.05) * 1024 / 2)
    with pytest.raises(ValueError, match="no memory left"):
        LlmEngine("a100", gpu_memory_mib=16000)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LlmEngine("a100", max_num_seqs=300, max_num_batched_tokens=256)


def test_time_never_goes_back():
    eng = LlmEngine("a100")
    eng.advance(5.0)
    with pytest.raises(ValueError, match="backwards"):
        eng.submit(EngineRequest("a", (1,), 1, 4.0), 4.0)
