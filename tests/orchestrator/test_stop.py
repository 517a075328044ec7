"""Stopping a run (src/tandem/core/stopping.py): SIGTERM, SIGINT or SIGHUP ends `tandem train` through
its stop path: a checkpoint of the trainer's version, every actor released (no sandbox left behind), the
shell's exit code for the signal, a message saying how to continue. Real Ray,
real sandboxes, the shipped model."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from .conftest import tandem_debris

REPO = Path(__file__).resolve().parents[2]
TANDEM = [sys.executable, "-m", "tandem.cli.main"]


@pytest.mark.slow
def test_sigterm_stops_a_run_with_a_checkpoint_and_nothing_left(tmp_path):
    run_dir = tmp_path / "run"
    before = tandem_debris()
    proc = subprocess.Popen(
        [*TANDEM, "train", "--preset", "smoke", "--run-dir", str(run_dir), "--set", "orchestrator.steps=1000",
         "--set", "train.checkpoint_every=0", "--set", "eval.before_after=false"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watchdog = threading.Timer(600, proc.kill)  # a hang fails the test instead of stalling the suite
    watchdog.start()
    try:
        seen = []
        for line in proc.stderr:  # wait for the first logged step, then stop the run as a scheduler would
            seen.append(line)
            if "step 1/1000" in line:
                break
        assert proc.poll() is None, "".join(seen)[-3000:]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(seen) + err
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    m = re.search(r"stopped by SIGTERM after step (\d+): the latest checkpoint is (\S+?/step_(\d{6}))\b", err)
    assert m, err[-3000:]
    logged, ckpt, saved = int(m.group(1)), Path(m.group(2)), int(m.group(3))
    assert f"tandem train --run-dir {run_dir} --resume" in err
    # the trainer's version when it stopped: the logged step, or one more if a step was running
    assert logged >= 1 and saved in (logged, logged + 1)
    assert ckpt.parent == run_dir / "checkpoints" and (ckpt / "trainer_state.json").is_file()
    assert json.loads((ckpt / "trainer_state.json").read_text())["version"] == saved
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == logged
    assert "report:" not in out  # a stopped run reports no results
    # the rollout worker exited normally: its sandboxes, layer caches and /etc copies are gone now, not at
    # the next run's sweep
    assert tandem_debris() <= before
    # (resuming from a checkpoint is test_train_smoke's; the stop's is written by the same call)


SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from tandem.core.stopping import StopRequested, stop_on_signals
    # the dispositions an interactive start gives (a test run under `nohup` would have SIGHUP ignored, and
    # stop_on_signals rightly leaves an ignored signal ignored)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with stop_on_signals():
            try:
                print("ready", flush=True)  # inside the try: the signal may come before the sleep starts
                time.sleep(60)
            except StopRequested as e:
                print("stop", e.signum, flush=True)
                print("restored", signal.getsignal(signal.SIGTERM) == before, flush=True)
                time.sleep(60)  # a slow stop path: the second signal must act at once
    finally:
        print("unreachable after a second SIGTERM", flush=True)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_the_first_signal_asks_to_stop_and_a_second_acts_as_before(sig):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)
        assert proc.stdout.readline() == f"stop {int(sig)}\n"
        assert proc.stdout.readline() == "restored True\n"
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Both die of the signal: SIGINT through Python's own handler (KeyboardInterrupt unwinds, so `finally`
    # runs), SIGTERM and SIGHUP by their default action, at once
    assert proc.returncode == -sig
    assert ("unreachable" in out) == (sig == signal.SIGINT)


@pytest.mark.slow
def test_a_stop_while_the_actors_start_is_a_stop_not_a_failure(tmp_path):
    """A signal during startup interrupts Ray's C code, which turned the handler's exception into a
    SystemError: the run reported "could not start" (exit 2). It is a stop, with nothing to resume. The run
    here is the first of `bench pipeline`'s two, which also reported a stop as a benchmark error (exit 2)."""
    run_dir = tmp_path / "sync"
    before = tandem_debris()
    proc = subprocess.Popen(
        [*TANDEM, "bench", "pipeline", "--preset", "smoke", "--budget-s", "60", "--run-root", str(tmp_path),
         "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        end = time.monotonic() + 300
        while not (run_dir / "weights").is_dir():  # made once the run's handlers are set, as actors start
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()
            time.sleep(0.05)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert (
        "bench pipeline stopped; nothing is reported. "
        "stopped by SIGTERM after step 0: no step had finished, so there is no checkpoint"
    ) in err, err[-3000:]
    assert out.strip() == ""  # no JSON: nothing was measured to the end
    assert not (run_dir / "checkpoints").exists()
    assert tandem_debris() <= before
