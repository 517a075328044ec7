"""`tandem serve` option checks (src/tandem/cli/serve.py): a bad option is one `error:` line and exit status
2 before the model is loaded, the engine measured or the port bound."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tandem.cli.serve import serve

MODEL = Path(__file__).resolve().parents[2] / "models" / "tandem-base"
app = typer.Typer()
app.command()(serve)
app.command("other")(lambda: None)  # two commands keep `serve` as a subcommand
runner = CliRunner()


def _refused(*args: str) -> str:
    res = runner.invoke(app, ["serve", "--model", str(MODEL), "--engine", "builtin", "--port", "0", *args])
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and res.output.count("\n") == 1, res.output
    return res.output


def test_sizes_past_the_machine_are_refused_before_loading() -> None:
    """Before: --max-seq-len past a C long was a TypeError traceback from torch.zeros, --threads past one a
    ValueError traceback (and --threads 100000 a segfault); --max-batch 9999999999999 started serving."""
    for args, needle in (
        (["--max-seq-len", "99999999999999999999"], "KV cache"),
        (["--threads", "99999999999999999999"], "--threads must be <= 1024"),
        (["--threads", "100000"], "--threads must be <= 1024"),
        (["--max-batch", "9999999999999"], "KV cache"),
        (["--max-parked", "99999999999999999999"], "KV cache"),
    ):
        assert needle in _refused(*args)


def test_unknown_dtype_and_log_level_are_refused_before_loading() -> None:
    """Before: --log-level bogus was a KeyError traceback after the model loaded and the port was bound;
    --dtype float16 was refused only after loading the model."""
    assert _refused("--log-level", "bogus").startswith("error: --log-level 'bogus' is unknown")
    assert _refused("--dtype", "float16").startswith("error: --dtype 'float16' is unknown")


def test_sigterm_closes_the_vllm_engine_before_exiting() -> None:
    """uvicorn re-raises the SIGTERM it caught after shutting down; with the default action that killed the
    process before the engine was closed, leaving vLLM's rendezvous file in the temp dir. Now the process
    unwinds (exit 143) and the engine's close removes it."""
    from tandem.engine.vllm import vllm_available

    if vllm_available() is not None:
        pytest.skip("vLLM is not installed")
    before = set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))
    argv = [sys.executable, "-m", "tandem.cli.main", "serve", "--model", str(MODEL), "--engine", "vllm",
            "--port", "0"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "serving ... on http://127.0.0.1:PORT/v1 (...)" once it listens
        assert line.startswith("serving "), line + proc.communicate(timeout=60)[1][-3000:]
        url = line.split(" on ", 1)[1].split("/v1", 1)[0]
        end = time.monotonic() + 120
        while True:  # the engine is up once /health answers
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < end
                time.sleep(0.2)
        assert set(Path(tempfile.gettempdir()).glob("vllm_dist_*")) - before  # vLLM's file exists meanwhile
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert set(Path(tempfile.gettempdir()).glob("vllm_dist_*")) <= before
