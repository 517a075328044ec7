"""The vLLM engine (tandem.engine.vllm) when vLLM fails: a start that fails after vLLM set up its process
group, and an engine a weight update left unable to serve, with the gateway in front of it.

These tests start their own engine (they leave it unusable), so they are marked slow; the engine that serves
the other vLLM tests is in test_vllm.py. Faults are injected into vLLM's own code, never into tandem's.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch.distributed as dist

from tandem.core.config import EngineConfig
from tandem.core.errors import EngineError, ModelLoadError
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.engine.gateway import GatewayConfig, GatewayServer, create_app
from tandem.engine.vllm import VllmEngine, _rendezvous_dir
from tandem.model import load_chat_format

MODEL = Path(__file__).resolve().parents[2] / "models" / "tandem-base"

pytestmark = pytest.mark.slow


def rendezvous_files() -> set[Path]:
    tmp = Path(tempfile.gettempdir())
    return set(tmp.glob("vllm_dist_*")) | set(tmp.glob("tandem-vllm-*/vllm_dist_*"))


def test_a_start_that_fails_inside_vllm_leaves_no_rendezvous_file():
    """vLLM sets up its process group (a ``vllm_dist_*`` file in the temp dir) before it allocates the KV
    cache; a start that failed there left the file behind for good (one per failed start) and the group set
    up in the process."""
    assert not dist.is_initialized(), "another vLLM engine of this process is alive"
    before = rendezvous_files()
    with pytest.raises(ModelLoadError, match="vLLM could not start.*kv"):
        VllmEngine(MODEL, EngineConfig(max_batch=2, max_seq_len=128, vllm_kv_cache_gib=1 << 20))
    assert rendezvous_files() <= before
    assert not dist.is_initialized()


def test_an_engine_that_cannot_restore_its_weights_refuses_to_serve_and_says_why(monkeypatch):
    """A weight update whose reload fails inside vLLM, and whose reload of the old values fails too, leaves an
    engine that cannot serve: the request running is answered with the reason (never left hanging), health
    says so, new requests and updates are refused with it, and the gateway answers 503 naming it. Before,
    health stayed ok and every request failed with vLLM's meta-tensor error (the gateway said 500). A closed
    engine refuses to start again instead of failing each request with a process-group assertion."""
    before = rendezvous_files()
    engine = VllmEngine(MODEL, EngineConfig(max_batch=4, max_seq_len=256, max_parked=0))
    engine.start()
    assert list(_rendezvous_dir().glob("vllm_dist_*"))  # named with this pid: a later start can sweep it
    try:
        chat = load_chat_format(MODEL)
        app = create_app(engine, chat, chat.tokenizer, GatewayConfig(model_name="m"))
        server = GatewayServer(app).start()
        model = engine._llm.collective_rpc(lambda worker: worker.model_runner.get_model())[0]

        def load_weights(self, weights):
            raise RuntimeError("injected fault inside vLLM's load_weights")

        running = engine.submit(GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=250, seed=1)))
        while not engine.health()["active"] and not running.done():
            time.sleep(0.005)
        monkeypatch.setattr(type(model), "load_weights", load_weights)
        norm = engine._host["model.norm.weight"].numpy().copy()
        with pytest.raises(EngineError) as failed:
            engine.update_weights(1, {"model.norm.weight": norm})
        health = engine.health()
        assert not health["ok"] and "cannot serve" in health.get("error", ""), health
        assert health["version"] == 0
        assert re.search("injected fault.*restoring version 0 failed too.*cannot serve", str(failed.value))
        done = running.result(timeout=120)
        assert done.finish_reason == "error" and "cannot serve" in done.error
        later = engine.submit(GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=4)))
        assert "cannot serve" in later.result(timeout=60).error
        with pytest.raises(EngineError, match="cannot serve"):
            engine.patch_weights(1, {"model.norm.weight": (np.array([0]), norm[:1])})
        with pytest.raises(EngineError, match="cannot serve"):
            engine.start()
        try:
            assert httpx.get(server.url + "/health", timeout=60).status_code == 503
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 503 and "cannot serve" in r.json()["error"]["message"]
        finally:
            server.stop()
    finally:
        engine.close()
    assert rendezvous_files() <= before and not _rendezvous_dir().exists()
    with pytest.raises(EngineError, match="engine closed"):
        engine.start()
    with pytest.raises(EngineError, match="engine closed"):
        engine.update_weights(2, {})
    assert "engine closed" in engine.submit(GenerationRequest([5], SamplingParams())).result().error
