"""Tests of the request side engines share (``tandem.engine.front``): gathering bursts at an idle engine."""

from __future__ import annotations

import threading
import time

from tandem.core.config import EngineConfig
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.engine import BuiltinEngine
from tandem.model import build_model, qwen3_config

V = 512
TOKENS = 6  # per request: the first comes from the prefill, the rest from TOKENS - 1 decode steps


def engine(**config) -> BuiltinEngine:
    model = build_model(qwen3_config("smoke", vocab_size=V), seed=0).eval()
    eng = BuiltinEngine(model, EngineConfig(max_batch=8, max_seq_len=256, **config))
    eng.start()
    return eng


def req(ids: list[int], n: int = TOKENS) -> GenerationRequest:
    return GenerationRequest(ids, SamplingParams(max_new_tokens=n, temperature=0.0))


def spread_out(eng: BuiltinEngine, prompts: list[list[int]], gap_s: float) -> list:
    futures = []
    for p in prompts:
        futures.append(eng.submit(req(p)))
        time.sleep(gap_s)
    return [f.result(timeout=60) for f in futures]


def test_an_idle_engine_starts_a_spread_out_burst_as_one_batch():
    prompts = [[1 + i, 2, 3, 4 + i] for i in range(4)]
    eng = engine(gather_idle_ms=500.0, gather_idle_max_ms=5000.0)
    try:
        done = spread_out(eng, prompts, 0.05)
        assert all(len(c.token_ids) == TOKENS for c in done)
        assert eng.stats()["steps"] == TOKENS - 1  # one prefill batch, then lockstep decode steps
    finally:
        eng.stop()
    eng = engine(gather_idle_max_ms=0.0)  # gathering off: the first request starts alone
    try:
        spread_out(eng, prompts, 0.05)
        assert eng.stats()["steps"] > TOKENS - 1
    finally:
        eng.stop()


class _SlowList(list):
    """A caller whose thread is descheduled between items: iterating the list sleeps before each one."""

    def __iter__(self):
        for item in super().__iter__():
            time.sleep(0.05)
            yield item


def test_generate_queues_its_whole_list_at_once_however_slow_the_caller():
    # Gathering off: an idle loop starts whatever is queued when it wakes. Queued one by one as the list is
    # read, the first request started alone (more steps); queued together, the four are one prefill batch.
    prompts = [[1 + i, 2, 3, 4 + i] for i in range(4)]
    eng = engine(gather_idle_max_ms=0.0)
    try:
        done = eng.generate(_SlowList(req(p) for p in prompts))
        assert [len(c.token_ids) for c in done] == [TOKENS] * 4
        assert eng.stats()["steps"] == TOKENS - 1
    finally:
        eng.stop()
    model = build_model(qwen3_config("smoke", vocab_size=V), seed=0).eval()
    idle = BuiltinEngine(model, EngineConfig(max_batch=8, max_seq_len=256))
    assert idle.generate([]) == [] and idle.health()["loop_nice"] is None  # nothing queued, loop not started
    idle.stop()


def test_an_idle_engine_waits_for_the_sessions_that_just_finished_a_turn():
    # The gap rule alone (1 ms) would start the first continuation at once; the wait for the three sessions
    # that just finished a turn with their KV parked holds it until all three are back.
    eng = engine(gather_idle_ms=1.0, gather_idle_max_ms=5000.0)
    try:
        opening = [[5 + i, *range(20, 40)] for i in range(3)]  # long enough for their KV to be parked
        first = eng.generate([req(p) for p in opening])
        before = eng.stats()["steps"]
        nxt = [[*p, *c.token_ids, 9, 10] for p, c in zip(opening, first, strict=True)]
        done = spread_out(eng, nxt, 0.05)
        assert all(len(c.token_ids) == TOKENS for c in done)
        assert eng.stats()["steps"] - before == TOKENS - 1
        assert eng.stats()["prefix_hit_tokens"] > 0  # they came back to their parked KV
    finally:
        eng.stop()


def test_a_request_that_reaches_a_busy_engine_is_never_held():
    eng = engine(gather_idle_ms=500.0, gather_idle_max_ms=5000.0)
    try:
        started = threading.Event()
        order: list[str] = []
        long = eng.submit(req([1, 2, 3], n=150), on_tokens=lambda ids: started.set())
        long.add_done_callback(lambda f: order.append("long"))
        assert started.wait(60)
        short = eng.submit(req([4, 5, 6], n=2))
        short.add_done_callback(lambda f: order.append("short"))
        assert len(short.result(timeout=60).token_ids) == 2
        long.result(timeout=60)
        assert order == ["short", "long"]  # it joined the running batch instead of waiting for it to drain
    finally:
        eng.stop()


def test_stopping_an_engine_while_it_gathers_fails_the_held_requests():
    eng = engine(gather_idle_ms=1000.0, gather_idle_max_ms=10_000.0)
    fut = eng.submit(req([1, 2, 3]))
    eng.stop()  # wakes the loop out of its wait
    c = fut.result(timeout=60)
    assert c.finish_reason == "error" and "stopped" in c.error
    assert eng.stats()["steps"] == 0


class _FailingAdmission(BuiltinEngine):
    """Fault injection: admitting a request whose first prompt id is 13 raises inside the engine's loop,
    after it was taken from the queue and before it becomes an active session."""

    def _admit(self, admitted):
        if any(p.request.prompt_ids[0] == 13 for p in admitted):
            raise RuntimeError("injected admission fault")
        super()._admit(admitted)


def test_an_iteration_that_raises_answers_every_request_it_took_and_the_engine_keeps_serving():
    model = build_model(qwen3_config("smoke", vocab_size=V), seed=0).eval()
    eng = _FailingAdmission(model, EngineConfig(max_batch=8, max_seq_len=256, gather_idle_max_ms=0.0))
    eng.start()
    try:
        running = eng.submit(req([1, 2, 3], n=40))
        time.sleep(0.05)
        taken = [eng.submit(req([13, 2, 3])), eng.submit(req([4, 5, 6]))]
        outs = [f.result(timeout=60) for f in [running, *taken]]
        assert outs[1].finish_reason == "error" and "injected admission fault" in outs[1].error
        # Admitted with it (same fault) or in a later iteration; active when it failed, or done before.
        assert outs[2].finish_reason in ("error", "length") and outs[0].finish_reason in ("error", "length")
        assert eng.health()["active"] == 0 and eng.health()["queued"] == 0
        assert len(eng.generate([req([7, 8, 9])])[0].token_ids) == TOKENS
    finally:
        eng.stop()
