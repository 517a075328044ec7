"""The gateway over the built-in engine serving a tiny Qwen3-MoE: a session's recorded segment carries the
experts every token was routed to (``Segment.routed_experts``), equal to a plain HF forward's routing."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tandem.core.config import EngineConfig
from tandem.core.records import Trajectory
from tandem.engine import BuiltinEngine
from tandem.engine.gateway import GatewayConfig, GatewayServer, create_app
from tandem.model import RouterHooks, load_chat_format, write_model_dir
from tandem.train.trainer import load_causal_lm

BASE = Path(__file__).resolve().parents[2] / "models" / "tandem-base"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_model_dir(tmp_path_factory.mktemp("moe"), "moe", tokenizer_dir=BASE, seed=1)
    chat = load_chat_format(path)
    engine = BuiltinEngine.from_path(path, EngineConfig(max_batch=4, max_seq_len=512, max_parked=4))
    engine.start()
    server = GatewayServer(create_app(engine, chat, chat.tokenizer, GatewayConfig(model_name="moe"))).start()
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http, load_causal_lm(path).eval()
    server.stop()
    engine.stop()


def test_session_segments_carry_the_engines_routes(served):
    http, ref = served
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    for turn in range(2):
        r = http.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 8, "user": "moe", "temperature": 1.0, "seed": turn},
        )
        assert r.status_code == 200, r.text
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "Now make it shorter."}]
        messages = [{k: v for k, v in m.items() if k in ("role", "content")} for m in messages]
    rec = http.get("/v1/tandem/sessions/moe")
    assert rec.status_code == 200, rec.text
    segments = Trajectory.from_dict(rec.json()).segments
    for seg in segments:
        assert seg.routed_experts is not None and seg.routed_experts.shape == (len(seg), 2, 2)
        with RouterHooks(ref) as hooks, torch.no_grad():
            ref(input_ids=torch.from_numpy(seg.token_ids.astype(np.int64))[None], use_cache=False)
            assert np.array_equal(seg.routed_experts, hooks.own().numpy())
