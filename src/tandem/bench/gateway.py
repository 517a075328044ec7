"""`tandem bench gateway`: the OpenAI gateway's overhead against calling the engine in-process.

Workload: ``sessions`` concurrent agent sessions of ``turns`` turns each (the built-in tasks' prompts and
tools); every turn samples exactly ``max_tokens`` tokens (temperature 1, ``ignore_eos``, so both sides
generate the same number of tokens) and the next turn sends the history back plus one tool message. Both
sides run on the same engine in this process, in the same run (``engine``: ``auto``, as ``tandem serve``
picks it, ``builtin`` or ``vllm``):

- in-process: the prompt ids are built the way the harness builds them (``render_prompt`` once, then the
  sampled ids, the end-of-turn token when the turn was cut, and ``render_continuation`` of the tool message)
  and submitted with ``engine.submit``;
- gateway: the official ``openai`` client (``AsyncOpenAI``, one coroutine per session, each session with its
  own ``X-Tandem-Session``) runs in ``client_procs`` separate processes (sessions split between them), as
  harnesses would, against a real uvicorn server on 127.0.0.1 serving ``create_app`` over that engine (in a
  thread of this process). Client processes are started and warmed up before the clock starts.

Each side runs one warm-up round, then ``repeats`` timed rounds, alternating sides; the best round of each
counts (the least disturbed on a shared machine). Every round uses fresh session ids and slightly different
prompts. throughput = generated tokens / wall time; ``overhead = 1 - gateway / in_process``. Because the
best of a few rounds per side moves with the machine's noise (three rounds gave 0.05-0.15 for one setting
here, seven gave 0.11-0.12), the JSON also has ``overhead_paired_median``: the median over the timed rounds
of ``1 - in_process_wall / gateway_wall`` of the two sides' rounds run back to back. Afterwards the
gateway's session records are checked: one segment per session (the history matched every turn, nothing was
re-rendered) of the expected length. Sets torch threads (restored on return) and, like ``tandem serve``,
freezes the process's start-up heap once the engine runs (``freeze_heap``; thawed on return).

What the overhead contains (measured on 2 cores): the server's work per request (the JSON's
``server_cpu_ms_per_request``: its thread's CPU, in the engine's process) and the client's (about 2 ms per
request for ``openai``: ``client_cpu_ms_per_request``), on the same cores as the engine; and the turn
boundaries: the sessions run in lockstep; in-process resubmits all of them at once, while through HTTP the
next turns exist only once the client has handled the responses and built the requests, one session at a
time. The client sends each request's headers as soon as it has built it, but its body only in a later pass
of its event loop (``httpx`` over ``anyio`` yields between the two writes), after the other sessions ready
then have built and sent theirs: at each boundary the headers come about 2 ms apart and every body of the
burst comes after the last header (traced with ``strace``, docs/results.md). So no request of a burst reaches
the engine before the client has spent its CPU on all of them, whatever the server does; with one client
process that is the boundary's cost, four times per round (the opening turn, two tool turns, the last
answers). An idle engine gathers such a burst (``EngineConfig.gather_idle_ms``, ``gather_idle_max_ms``: it
waits for the sessions that just finished a turn), so both sides start each turn as one batch. Before the
engine gathered, it started the first arrivals at once, and their decode steps slowed the server still
answering the rest (about 100-200 ms of spread per boundary instead of 50-60). More tokens per turn
(``max_tokens``) or more client processes (``client_procs``) amortise or split that cost.

The client's own share is measured beside it: after the timed rounds, the same client (fresh processes,
``client_procs`` of them) runs one warm-up and ``repeats`` timed rounds against ``InstantChatServer``
(``tandem.bench.instant``: every request answered at once with a canned completion of ``max_tokens``
words), the same sessions, turns and tools. The best of those rounds (``client_alone_wall_s``) is the time the
client's work alone takes per round, and ``client_alone_overhead = alone / (in_process + alone)`` (best
rounds) the overhead it would make if nothing else cost anything: a gateway and HTTP stack that took no time,
with the client's work falling between the in-process side's turns, as the lockstep boundaries put it. It is
an estimate, not a bound: beside the engine the client's CPU per request is higher than alone (compare
``client_alone_cpu_ms_per_request`` with ``client_cpu_ms_per_request``), and a round's best can fall below it
by noise. What ``overhead`` has beyond it is the gateway's own cost plus that noise.

Before the engine starts (and, from the CLI, before this module is imported), ``preflight.check_gateway``
refuses (``BenchInputError``, naming the option) an unknown engine, counts < 1, more than
``limits.MAX_REPEATS`` rounds, thread counts outside 1..4 per CPU, more client processes than 4 per CPU or
than sessions, sessions whose KV cache (``2 x sessions`` slots of ``MAX_SEQ_LEN`` tokens: every session is
parked between turns) exceeds the memory available, and sessions whose longest context (prompt, every turn's
tokens, the tool messages; ``preflight.gateway_longest_context``) exceeds ``MAX_SEQ_LEN`` or the model's
context.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from tandem.bench import preflight
from tandem.bench.instant import InstantChatServer
from tandem.core.config import EngineConfig
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.core.procs import cpu_ticks, freeze_heap, gc_freeze_enabled, steal_fraction, thaw_heap
from tandem.engine.front import RequestFront

ENGINES = preflight.GATEWAY_ENGINES
MAX_SEQ_LEN = preflight.GATEWAY_MAX_SEQ_LEN

TOOL_RESULT = preflight.GATEWAY_TOOL_RESULT


def _seed(r: int, i: int, t: int) -> int:
    return 1_000_000 * r + 1000 * i + t


def _in_process(engine: RequestFront, chat: Any, r: int, sessions: int, turns: int, max_tokens: int) -> dict:
    opening, tools = preflight.gateway_workload(sessions, r)
    eot = int(chat.stop_token_ids[0])
    ctx = [chat.render_prompt(m, tools) for m in opening]
    done = [0] * sessions
    tokens = 0

    def submit(i: int) -> Future:
        sp = SamplingParams(max_new_tokens=max_tokens, temperature=1.0, seed=_seed(r, i, done[i]))
        return engine.submit(GenerationRequest(list(ctx[i]), sp))

    t0 = time.perf_counter()
    inflight = {submit(i): i for i in range(sessions)}
    while inflight:
        finished, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
        for f in finished:
            i = inflight.pop(f)
            c = f.result()
            if c.finish_reason == "error":
                raise RuntimeError(f"in-process session {i} failed: {c.error}")
            tokens += len(c.token_ids)
            done[i] += 1
            if done[i] < turns:
                tool = {"role": "tool", "content": TOOL_RESULT.format(r=r, i=i, t=done[i])}
                closing = [] if c.token_ids and c.token_ids[-1] == eot else [eot]
                ctx[i] = ctx[i] + c.token_ids + closing + chat.render_continuation([tool])
                inflight[submit(i)] = i
    return {"wall_s": time.perf_counter() - t0, "tokens": tokens}


# ---- the client process (the "harness") ----------------------------------------------------------------


async def _client_round(client: Any, spec: dict[str, Any]) -> dict[str, Any]:
    r, turns, max_tokens, tools = spec["round"], spec["turns"], spec["max_tokens"], spec["tools"]
    first = spec.get("first", 0)

    async def session(i: int, messages: list[dict[str, Any]]) -> int:
        n = 0
        for t in range(turns):
            resp = await client.chat.completions.create(
                model="tandem",
                messages=messages,
                tools=tools,
                max_tokens=max_tokens,
                temperature=1.0,
                seed=_seed(r, i, t),
                extra_headers={"X-Tandem-Session": f"bench-{r}-{i}"},
                extra_body={"ignore_eos": True},
            )
            n += resp.usage.completion_tokens
            messages.append(resp.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "content": TOOL_RESULT.format(r=r, i=i, t=t + 1)})
        return n

    t0, cpu0 = time.perf_counter(), time.process_time()
    counts = await asyncio.gather(*(session(first + i, m) for i, m in enumerate(spec["opening"])))
    return {"wall_s": time.perf_counter() - t0, "tokens": sum(counts), "cpu_s": time.process_time() - cpu0}


def _client_main(base_url: str) -> None:
    """Reads one round spec (JSON) per stdin line, answers one JSON line per round."""
    import openai

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600.0)
        print(json.dumps({"ready": True, "openai": openai.__version__}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            try:
                out = await _client_round(client, json.loads(line))
            except Exception as e:  # noqa: BLE001 - reported to the parent
                out = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(out), flush=True)
        await client.close()

    asyncio.run(main())


class _Client:
    def __init__(self, base_url: str) -> None:
        code = f"from tandem.bench.gateway import _client_main; _client_main({base_url!r})"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark client process exited (status {self.proc.wait()})")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"gateway round failed in the client: {out['error']}")
        return out

    def send(self, spec: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict[str, Any]:
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _check_records(url: str, r: int, sessions: int, turns: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    segments, sampled, reasons = 0, 0, []
    with httpx.Client(base_url=url, timeout=60) as http:
        for i in range(sessions):
            rec = http.get(f"/v1/tandem/sessions/bench-{r}-{i}").raise_for_status().json()
            segments += len(rec["segments"])
            sampled += sum(sum(s["loss_mask"]) for s in rec["segments"])
            reasons += [x["reason"] for x in rec["segment_reasons"]]
    ok = segments == sessions and sampled == sessions * turns * max_tokens and not reasons
    return {
        "token_exact_records": ok,
        "segments": segments,
        "sampled_tokens": sampled,
        "reasons": reasons[:3],
    }


def _gateway_round(clients: list[_Client], spec: dict[str, Any], server: Any) -> dict[str, Any]:
    """One round split over the client processes (contiguous blocks of sessions), all started together;
    with the CPU time the server's thread used meanwhile."""
    n = len(spec["opening"])
    size = -(-n // len(clients))
    cpu0 = server.cpu_s()
    t0 = time.perf_counter()
    for j, c in enumerate(clients):
        lo, hi = j * size, min((j + 1) * size, n)
        c.send({**spec, "opening": spec["opening"][lo:hi], "first": lo})
    outs = [c.receive() for c in clients]
    return {
        "wall_s": time.perf_counter() - t0,
        "tokens": sum(o["tokens"] for o in outs),
        "client_cpu_s": sum(o["cpu_s"] for o in outs),
        "server_cpu_s": server.cpu_s() - cpu0,
    }


def _client_alone(
    client_procs: int, repeats: int, first_round: int, sessions: int, turns: int, max_tokens: int
) -> list[dict[str, Any]]:
    """The timed rounds of the same client against ``InstantChatServer`` (after one warm-up round): fresh
    client processes, the same sessions, turns, tools and kinds of messages, every answer there at once."""
    instant = InstantChatServer(max_tokens).start()
    clients: list[_Client] = []
    try:
        clients = [_Client(instant.url + "/v1") for _ in range(client_procs)]
        rounds = []
        for k in range(repeats + 1):
            r = first_round + k
            opening, tools = preflight.gateway_workload(sessions, r)
            spec = {"round": r, "turns": turns, "max_tokens": max_tokens, "tools": tools, "opening": opening}
            rounds.append(_gateway_round(clients, spec, instant))
    finally:
        for c in clients:
            c.close()
        instant.stop()
    expected = sessions * turns * max_tokens
    bad = [x["tokens"] for x in rounds if x["tokens"] != expected]
    if bad:
        raise RuntimeError(f"the client against the instant server counted {bad[0]} tokens, not {expected}")
    return rounds[1:]


def run_gateway_bench(
    model_path: str = "models/tandem-base",
    sessions: int = 32,
    turns: int = 3,
    max_tokens: int = 32,
    threads: int = 2,
    repeats: int = 5,
    client_procs: int = 1,
    engine_kind: str = "auto",
) -> dict[str, Any]:
    """Run both sides (see module docstring) and return the benchmark's JSON object."""
    gc_freeze_enabled()  # a bad TANDEM_GC_FREEZE is a ValueError before anything starts
    preflight.check_gateway(
        model_path, sessions, turns, max_tokens, threads, repeats, client_procs, engine_kind
    )
    from tandem.engine import create_engine
    from tandem.engine.choice import choose_engine
    from tandem.engine.gateway import GatewayConfig, GatewayServer, create_app
    from tandem.model import load_chat_format

    cfg = EngineConfig(
        kind=engine_kind, max_batch=sessions, max_seq_len=MAX_SEQ_LEN, max_parked=sessions, threads=threads
    )
    kind, engine_reason = choose_engine(cfg, model_path)
    if kind == "vllm":
        from tandem.engine.vllm import vllm_available

        why_not = vllm_available()
        if why_not is not None:
            raise ValueError(f"engine 'vllm': {why_not}")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    chat = load_chat_format(model_path)
    engine = create_engine(model_path, cfg.model_copy(update={"kind": kind}), seed=0)
    gw_cfg = GatewayConfig(max_concurrent=max(64, sessions), max_sessions=max(1024, 2 * sessions))
    server = GatewayServer(create_app(engine, chat, chat.tokenizer, gw_cfg)).start()
    clients: list[_Client] = []
    ticks0 = cpu_ticks()
    try:
        engine.start()
        freeze_heap()  # as `tandem serve` does once its engine runs
        clients = [_Client(server.url + "/v1") for _ in range(client_procs)]
        expected = sessions * turns * max_tokens
        in_proc: list[dict] = []
        gateway: list[dict] = []
        r = 0
        for _ in range(repeats + 1):  # round 0 of each side is its warm-up
            in_proc.append(_in_process(engine, chat, r, sessions, turns, max_tokens))
            r += 1
            opening, tools = preflight.gateway_workload(sessions, r)
            spec = {"round": r, "turns": turns, "max_tokens": max_tokens, "tools": tools, "opening": opening}
            gateway.append(_gateway_round(clients, spec, server))
            last_gateway_round = r
            r += 1
        for side, rounds in (("in-process", in_proc), ("gateway", gateway)):
            bad = [x["tokens"] for x in rounds if x["tokens"] != expected]
            if bad:
                raise RuntimeError(f"{side} generated {bad[0]} tokens in a round, expected {expected}")
        records = _check_records(server.url, last_gateway_round, sessions, turns, max_tokens)
        alone = _client_alone(client_procs, repeats, r, sessions, turns, max_tokens)
    finally:
        for c in clients:
            c.close()
        server.stop()
        getattr(engine, "close", engine.stop)()  # close: vLLM also frees its engine core and rendezvous file
        torch.set_num_threads(old)
        thaw_heap()
    steal = steal_fraction(ticks0, cpu_ticks())
    ip_wall = min(x["wall_s"] for x in in_proc[1:])
    gw_wall = min(x["wall_s"] for x in gateway[1:])
    ip_tps, gw_tps = expected / ip_wall, expected / gw_wall
    paired = sorted(1 - a["wall_s"] / b["wall_s"] for a, b in zip(in_proc[1:], gateway[1:], strict=True))
    paired_median = (paired[(len(paired) - 1) // 2] + paired[len(paired) // 2]) / 2
    alone_wall = min(x["wall_s"] for x in alone)
    return {
        "in_process_tokens_per_s": round(ip_tps, 1),
        "gateway_tokens_per_s": round(gw_tps, 1),
        "overhead": round(1 - gw_tps / ip_tps, 4),
        "overhead_paired_median": round(paired_median, 4),
        "in_process_wall_s": [round(x["wall_s"], 3) for x in in_proc[1:]],
        "gateway_wall_s": [round(x["wall_s"], 3) for x in gateway[1:]],
        "sessions": sessions,
        "turns": turns,
        "max_tokens": max_tokens,
        "tokens_per_round": expected,
        "requests_per_round": sessions * turns,
        "threads": threads,
        "repeats": repeats,
        "client": f"openai {clients[0].info.get('openai')} AsyncOpenAI, {client_procs} process(es)",
        "client_procs": client_procs,
        # the harness side's own work: CPU of the client processes per request, mean of the timed rounds
        "client_cpu_ms_per_request": round(
            1000 * sum(x["client_cpu_s"] for x in gateway[1:]) / (repeats * sessions * turns), 3
        ),
        # the gateway's own work: CPU of the server's thread (HTTP, handlers, responses) per request, likewise
        "server_cpu_ms_per_request": round(
            1000 * sum(x["server_cpu_s"] for x in gateway[1:]) / (repeats * sessions * turns), 3
        ),
        # the same client against an instant server: its own work per round, and the overhead that work
        # alone makes when it sits between the in-process side's turns (see the module docstring)
        "client_alone_wall_s": [round(x["wall_s"], 3) for x in alone],
        "client_alone_cpu_ms_per_request": round(
            1000 * sum(x["client_cpu_s"] for x in alone) / (repeats * sessions * turns), 3
        ),
        "client_alone_overhead": round(alone_wall / (ip_wall + alone_wall), 4),
        "engine": kind,
        "engine_reason": engine_reason,
        "gateway_records": records,
        # share of CPU time a VM host took during the run (noise indicator)
        "cpu_steal_frac": None if steal is None else round(steal, 3),
    }


if __name__ == "__main__":
    print(json.dumps(run_gateway_bench()))
