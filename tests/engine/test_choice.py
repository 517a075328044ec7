"""engine.kind = "auto": the built-in engine for what only it supports; otherwise, on CPU, the engine measured
faster on this machine (tandem.engine.calibrate), or without a measurement vLLM from engine.vllm_from_params
up when it can be imported (tandem.engine.choice)."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tandem.core.config import EngineConfig, RunConfig
from tandem.engine import create_engine
from tandem.engine.builtin import BuiltinEngine
from tandem.engine.choice import choose_engine, resolve_run_engine
from tandem.engine.vllm import vllm_available
from tandem.model import build_model, num_params, qwen3_config
from tandem.model.load import checkpoint_parameters
from tandem.model.moe import write_model_dir

from .conftest import MEASURED_MAX_BATCH, MEASURED_THREADS, SHIPPED

SHIPPED_PARAMS = 5_771_264  # `tandem bench engine`'s model_params for the shipped shape


def test_the_parameter_count_comes_from_the_safetensors_headers(tmp_path):
    model = build_model(qwen3_config("smoke", vocab_size=600), seed=1)
    model.save_pretrained(str(tmp_path))
    assert checkpoint_parameters(tmp_path) == num_params(model)  # the tied embedding counted once
    assert checkpoint_parameters(SHIPPED) == SHIPPED_PARAMS
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)  # a header length past the file
    assert checkpoint_parameters(tmp_path) is None
    assert checkpoint_parameters(tmp_path / "nowhere") is None


def test_auto_keeps_a_model_below_the_threshold_on_the_builtin_engine_without_importing_vllm():
    def probe():
        raise AssertionError("vLLM must not be probed for a model the size already decides")

    cfg = EngineConfig(vllm_from_params=SHIPPED_PARAMS + 1, auto_measure=False)
    kind, reason = choose_engine(cfg, SHIPPED, vllm_probe=probe)
    assert kind == "builtin"
    assert "5,771,264 parameters < engine.vllm_from_params=5,771,265" in reason
    assert isinstance(create_engine(SHIPPED, cfg), BuiltinEngine)  # create_engine resolves 'auto' too


def test_without_a_measurement_auto_serves_the_shipped_model_on_vllm_when_it_can_be_imported():
    kind, reason = choose_engine(EngineConfig(auto_measure=False), SHIPPED)  # the default threshold, 5M
    missing = vllm_available()
    if missing is None:  # the test command installs the vllm extra
        assert (kind, reason) == ("vllm", "auto: 5,771,264 parameters >= engine.vllm_from_params=5,000,000")
    else:
        assert kind == "builtin" and missing in reason
    kind, reason = choose_engine(
        EngineConfig(auto_measure=False), SHIPPED, vllm_probe=lambda: "vLLM is not importable (no module)"
    )
    assert kind == "builtin"
    assert reason == "auto: vLLM would serve this model, but vLLM is not importable (no module)"
    kind, reason = choose_engine(EngineConfig(), SHIPPED, vllm_probe=lambda: "vLLM is not importable (x)")
    assert (kind, reason) == ("builtin", "auto: vLLM is not importable (x)")  # nothing to measure against


def test_an_explicit_kind_is_kept():
    assert choose_engine(EngineConfig(kind="vllm"), SHIPPED)[0] == "vllm"
    assert choose_engine(EngineConfig(kind="builtin", vllm_from_params=0), SHIPPED)[0] == "builtin"


def test_a_mixture_of_experts_model_stays_on_the_builtin_engine_on_cpu(tmp_path):
    path = write_model_dir(tmp_path / "moe", "moe", tokenizer_dir=SHIPPED)
    kind, reason = choose_engine(EngineConfig(vllm_from_params=0), path, vllm_probe=lambda: None)
    assert kind == "builtin" and "mixture-of-experts" in reason


def test_an_unknown_size_stays_on_the_builtin_engine(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    kind, reason = choose_engine(EngineConfig(vllm_from_params=0), tmp_path)
    assert kind == "builtin" and "parameter count" in reason and "unknown" in reason


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        ({"train": {"deterministic": True}}, "train.deterministic=true"),
        ({"rollout": {"top_p": 0.9}}, "rollout.top_p=0.9"),
        ({"rollout": {"temperature": 2.5}}, "rollout.temperature=2.5"),  # vLLM refuses every such request
        ({"eval": {"temperature": 3.0}}, "eval.temperature=3.0"),
    ],
)
def test_a_run_that_needs_the_builtin_engine_gets_it(overrides, setting):
    cfg = RunConfig(engine={"kind": "auto", "vllm_from_params": 0}, **overrides)  # valid with auto
    resolved, reason = resolve_run_engine(cfg, vllm_probe=lambda: None)
    assert resolved.engine.kind == "builtin" and reason == f"auto: {setting} needs the built-in engine"
    assert cfg.engine.kind == "auto"  # the caller's config is not changed
    with pytest.raises(ValueError, match="engine.kind='builtin'"):  # an explicit vllm is still refused
        RunConfig(engine={"kind": "vllm"}, **overrides)


def test_a_resolved_run_config_names_one_engine():
    cfg = RunConfig(engine={"vllm_from_params": 0, "auto_measure": False})
    resolved, reason = resolve_run_engine(cfg, vllm_probe=lambda: None)
    assert resolved.engine.kind == "vllm" and reason.startswith("auto: ")


def test_bad_engine_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="kind"):
        EngineConfig(kind="tgi")
    with pytest.raises(ValueError, match="vllm_from_params"):
        EngineConfig(vllm_from_params=-1)
    with pytest.raises(ValueError, match="auto_measure"):
        EngineConfig(auto_measure="sometimes")


def rendezvous_files() -> set[Path]:
    """vLLM's rendezvous files: in this project's per-process directories, or (older) the bare temp dir."""
    tmp = Path(tempfile.gettempdir())
    return set(tmp.glob("vllm_dist_*")) | set(tmp.glob("tandem-vllm-*/vllm_dist_*"))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["auto", "vllm"])
def test_serve_runs_the_engine_it_names_and_answers(tmp_path, engine, request):
    """...and SIGTERM ends it with exit 143 after closing the engine. uvicorn re-raises the SIGTERM it caught
    after shutting down; with the default action that killed the process before the engine was closed,
    leaving vLLM's rendezvous file (``vllm_dist_*``) in the temp dir for good.

    ``auto`` serves with the engine the session's measurement of the shipped model found faster
    (``shipped_measurement``), read from its cache as on a machine that measured it before."""
    rendezvous = rendezvous_files()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TANDEM_CACHE_DIR": str(tmp_path / "cache")}
    if engine == "auto":
        cache_dir, rates = request.getfixturevalue("shipped_measurement")
        env["TANDEM_CACHE_DIR"] = str(cache_dir)
        serves = "vllm" if rates["vllm"] > rates["builtin"] else "builtin"
        # read for the threads and batch it serves with (before, serve measured at 1 thread and batch 64)
        says = (
            f"(engine {serves}: auto: decodes faster on this machine: built-in {rates['builtin']:.0f} "
            f"tokens/s, vLLM {rates['vllm']:.0f} (cached; {MEASURED_THREADS} threads"
        )
    else:
        serves, says = "vllm", "(engine vllm: engine.kind='vllm' (set explicitly))"
    cmd = [sys.executable, "-m", "tandem.cli.main", "serve", "--engine", engine, "--port", "0"]
    cmd += ["--model", SHIPPED, "--max-seq-len", "256", "--max-batch", str(MEASURED_MAX_BATCH)]
    cmd += ["--threads", str(MEASURED_THREADS)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    killer = threading.Timer(300, proc.kill)  # a server that never prints its address ends the loop below
    killer.start()
    try:
        url, seen = None, []
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            m = re.search(r"serving \S+ on (http://\S+/v1) " + re.escape(says), line)
            if m:
                url = m.group(1)
                break
        assert url, "".join(seen)
        for _ in range(200):
            try:
                if httpx.get(url.removesuffix("/v1") + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = httpx.post(url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # vLLM's file exists while it serves
        assert bool(rendezvous_files() - rendezvous) == (serves == "vllm")
        proc.terminate()  # SIGTERM
        rest = proc.communicate(timeout=120)[0]
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, rest[-3000:]
    assert rendezvous_files() <= rendezvous
    assert not list(Path(tempfile.gettempdir()).glob(f"tandem-vllm-*-{proc.pid}"))  # its directory too
