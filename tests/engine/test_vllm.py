"""The vLLM engine (tandem.engine.vllm) over the shipped model, with vLLM's real CPU build.

One engine serves the whole module (vLLM's start is the expensive part). Its samples are checked against the
transformers model's own logprobs, before and after weight updates; the weights are restored at the end of
each test that changes them.
"""

from __future__ import annotations

import itertools
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from tandem.core.config import EngineConfig, RunConfig
from tandem.core.errors import EngineError
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.engine.follow import EngineWeightSync
from tandem.engine.gateway import GatewayConfig, GatewayServer, create_app
from tandem.engine.vllm import VllmEngine, reload_groups, sweep_rendezvous
from tandem.env.tasks import TOOLS
from tandem.model import load_chat_format
from tandem.weights import WeightStore, serve_store
from tandem.weights.publish import WeightPublisher

MODEL = Path(__file__).resolve().parents[2] / "models" / "tandem-base"
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def engine():
    eng = VllmEngine(MODEL, EngineConfig(max_batch=16, max_seq_len=512, max_parked=16))
    eng.start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True).eval()


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        lp = model(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    return np.array([lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)])


def sampled(seed: int, n: int = 24, **kw) -> GenerationRequest:
    return GenerationRequest(PROMPT, SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed, **kw))


def test_samples_carry_the_models_logprobs_and_seeds_reproduce(engine, hf):
    first = engine.generate([sampled(s) for s in range(4)])
    again = engine.generate([sampled(s) for s in range(4)])
    for a, b in zip(first, again, strict=True):
        assert a.finish_reason == "length" and len(a.token_ids) == 24
        assert a.token_ids == b.token_ids
        assert a.versions == [engine.version] * 24
        np.testing.assert_allclose(a.logprobs, hf_logprobs(hf, PROMPT, a.token_ids), atol=1e-4)
    assert len({tuple(c.token_ids) for c in first}) == 4  # different seeds, different samples


def test_seeded_prompts_beyond_one_steps_token_budget_all_complete(engine):
    # 8 x 400 prompt tokens exceed vLLM's default 2048 per step: with chunked prefill, a seeded request
    # whose prompt was split failed the whole step on CPU ("CPU Generator does not use offset")
    prompts = [[10 + (7 * i + k) % 3000 for k in range(400)] for i in range(8)]
    reqs = [
        GenerationRequest(p, SamplingParams(max_new_tokens=4, temperature=1.0, seed=i))
        for i, p in enumerate(prompts)
    ]
    first, again = engine.generate(reqs), engine.generate(reqs)
    assert [c.finish_reason for c in first] == ["length"] * 8, first[0].error
    assert [c.token_ids for c in first] == [c.token_ids for c in again]


def test_top_logprobs_are_the_sampled_distribution(engine, hf):
    c = engine.generate([sampled(5, n=8, top_logprobs=4)])[0]
    assert c.top_token_ids is not None and len(c.top_token_ids) == len(c.top_logprobs) == 8
    with torch.no_grad():
        lp = hf(torch.tensor([PROMPT + c.token_ids])).logits[0].float().log_softmax(-1)
    for i, (tok, ids, lps) in enumerate(zip(c.token_ids, c.top_token_ids, c.top_logprobs, strict=True)):
        assert len(ids) == 4 and lps == sorted(lps, reverse=True)
        want = lp[len(PROMPT) - 1 + i]
        np.testing.assert_allclose(lps, want[ids].numpy(), atol=1e-4)
        assert set(ids) == set(want.topk(4).indices.tolist())
        if tok in ids:
            assert lps[ids.index(tok)] == c.logprobs[i]
    greedy_req = GenerationRequest(PROMPT, SamplingParams(max_new_tokens=3, temperature=0.0, top_logprobs=2))
    greedy = engine.generate([greedy_req])[0]
    assert all(lps == [0.0, float("-inf")] for lps in greedy.top_logprobs)
    assert [ids[0] for ids in greedy.top_token_ids] == greedy.token_ids
    bad = engine.generate([sampled(1, n=3, top_logprobs=21)])[0]
    assert bad.finish_reason == "error" and "top_logprobs=21" in bad.error


def test_temperature_is_in_the_logprobs_and_greedy_stops_on_a_stop_token(engine, hf):
    req = GenerationRequest(PROMPT, SamplingParams(max_new_tokens=12, temperature=2.0, seed=7))
    c = engine.generate([req])[0]
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + c.token_ids])).logits[0]
    want = [(logits[len(PROMPT) - 1 + i] / 2.0).log_softmax(-1)[t].item() for i, t in enumerate(c.token_ids)]
    np.testing.assert_allclose(c.logprobs, want, atol=1e-4)

    greedy = engine.generate([GenerationRequest(PROMPT, SamplingParams(max_new_tokens=8, temperature=0))])[0]
    assert greedy.logprobs == [0.0] * 8
    stop = greedy.token_ids[2]
    first = greedy.token_ids.index(stop)
    params = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[stop])
    cut = engine.generate([GenerationRequest(PROMPT, params)])[0]
    assert cut.finish_reason == "stop" and cut.token_ids == greedy.token_ids[: first + 1]


@pytest.mark.parametrize(
    ("prompt", "params", "needle"),
    [
        ([], SamplingParams(), "empty prompt"),
        ([99999], SamplingParams(), "outside the vocabulary"),
        ([5] * 600, SamplingParams(), "max_seq_len=512"),
        ([5], SamplingParams(max_new_tokens=0), "max_new_tokens=0"),
        ([5], SamplingParams(temperature=-1), "temperature=-1"),
        ([5], SamplingParams(top_p=0.9), "top_p=0.9"),
    ],
)
def test_bad_requests_get_an_error_naming_the_field_and_the_engine_serves_on(engine, prompt, params, needle):
    c = engine.generate([GenerationRequest(prompt, params)])[0]
    assert c.finish_reason == "error" and needle in c.error
    assert engine.generate([sampled(1, n=3)])[0].finish_reason == "length"


def test_a_request_vllm_refuses_fails_alone(engine):
    """vLLM checks some sampling settings itself when tandem builds its ``SamplingParams`` (a temperature
    above 2): that check used to raise out of the engine's iteration and fail every request beside it."""
    start = engine.stats()["tokens_generated"]
    running = engine.submit(sampled(41, n=200))
    while engine.stats()["tokens_generated"] < start + 5:
        time.sleep(0.005)
    hot = engine.submit(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=4, temperature=3.0)))
    done, bad = running.result(timeout=120), hot.result(timeout=120)
    assert done.finish_reason == "length", done.error
    assert 0 < engine.stats()["last_token_at"] <= time.monotonic()  # the last step's end
    assert bad.finish_reason == "error" and "vLLM refused the request" in bad.error
    assert "temperature" in bad.error


def test_run_config_refuses_top_p_with_the_vllm_engine():
    with pytest.raises(ValidationError, match=r"rollout.top_p=0.9 with engine.kind='vllm'"):
        RunConfig.model_validate({"engine": {"kind": "vllm"}, "rollout": {"top_p": 0.9}})


def test_run_config_checks_the_cpu_binding():
    assert RunConfig.model_validate({"engine": {"vllm_cpu_bind": "0-1"}}).engine.vllm_cpu_bind == "0-1"
    with pytest.raises(ValidationError, match="vllm_cpu_bind"):
        RunConfig.model_validate({"engine": {"vllm_cpu_bind": "banana"}})


def test_fused_modules_reload_together():
    names = {f"m.l.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {"m.l.0.mlp.up_proj.weight"}
    names |= {"m.l.0.mlp.gate_proj.weight", "m.l.0.mlp.down_proj.weight"}
    got = reload_groups(["m.l.0.self_attn.k_proj.weight", "m.l.0.mlp.up_proj.weight"], names)
    assert got == sorted(names - {"m.l.0.self_attn.o_proj.weight", "m.l.0.mlp.down_proj.weight"})


def test_weight_updates_and_patches_apply_in_place(engine, hf):
    original = {k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    before = engine.generate([sampled(3)])[0]
    v0 = engine.version
    g = torch.Generator().manual_seed(0)
    try:
        # a bad update names the tensor and changes nothing
        with pytest.raises(EngineError, match="model.norm.weight.*shape"):
            engine.update_weights(v0 + 1, {"model.norm.weight": np.zeros(3, np.float32)})
        with pytest.raises(EngineError, match="unknown tensor 'nope'"):
            engine.patch_weights(v0 + 1, {"nope": (np.array([0]), np.array([1.0], np.float32))})
        assert engine.version == v0 and engine.generate([sampled(3)])[0].token_ids == before.token_ids

        # full update of every tensor, the tied embedding included (published once, as the trainer does)
        new = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in original.items()}
        engine.update_weights(v0 + 1, {k: v.numpy() for k, v in new.items()})
        hf.load_state_dict({**new, "lm_head.weight": new["model.embed_tokens.weight"]})
        c = engine.generate([sampled(3)])[0]
        assert c.versions == [v0 + 1] * len(c.token_ids) and c.token_ids != before.token_ids
        np.testing.assert_allclose(c.logprobs, hf_logprobs(hf, PROMPT, c.token_ids), atol=1e-4)

        # element patches (the delta path): bfloat16 bit patterns into one of the fused q/k/v projections
        name = "model.layers.2.self_attn.k_proj.weight"
        idx = np.arange(0, hf.state_dict()[name].numel(), 5, dtype=np.int64)
        vals = torch.full((len(idx),), 0.0625, dtype=torch.bfloat16)
        engine.patch_weights(v0 + 2, {name: (idx, vals.view(torch.uint16).numpy())})
        with torch.no_grad():
            hf.state_dict()[name].view(-1)[torch.as_tensor(idx)] = 0.0625
        c = engine.generate([sampled(4)])[0]
        assert c.versions == [v0 + 2] * len(c.token_ids)
        np.testing.assert_allclose(c.logprobs, hf_logprobs(hf, PROMPT, c.token_ids), atol=1e-4)
    finally:
        engine.update_weights(v0 + 3, {k: v.numpy() for k, v in original.items()})
        hf.load_state_dict({**original, "lm_head.weight": original["model.embed_tokens.weight"]})
    assert engine.generate([sampled(3)])[0].token_ids == before.token_ids


def test_an_update_lands_between_steps_of_running_sessions(engine):
    v0 = engine.version
    same = {"model.norm.weight": engine._host["model.norm.weight"].clone().numpy()}
    start = engine.stats()["tokens_generated"]
    fut = engine.submit(sampled(9, n=400))
    while engine.stats()["tokens_generated"] < start + 20:
        time.sleep(0.005)
    pauses: list[float] = []
    t = threading.Thread(target=lambda: pauses.append(engine.update_weights(v0 + 1, same)))
    t.start()
    t.join()
    c = fut.result()
    assert c.versions[0] == v0 and c.versions[-1] == v0 + 1 and c.versions == sorted(c.versions)
    assert pauses and pauses[0] < 5.0 and engine.health()["version"] == v0 + 1


def test_a_cancelled_request_is_aborted_running_or_queued(engine):
    """A request whose caller gave up (a client that left, a revoked rollout) stops at the engine's next
    step, and a queued one never runs; the others finish as usual."""
    start, before = engine.stats()["tokens_generated"], engine.stats()["cancelled"]
    running = engine.submit(sampled(11, n=400))
    while engine.stats()["tokens_generated"] < start + 10:
        time.sleep(0.005)
    assert running.cancel()
    kept = engine.submit(sampled(12, n=8))
    assert kept.result(timeout=60).finish_reason == "length"
    deadline = time.monotonic() + 60
    while (engine.health()["active"] or engine.health()["queued"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats()["cancelled"] == before + 1
    assert engine.stats()["tokens_generated"] - start < 200  # not generated to its 400 tokens


def test_prefix_blocks_of_older_weights_are_never_reused(engine):
    prompt = [20 + k % 2000 for k in range(300)]  # more than one KV block of the CPU build (128 tokens)

    def hits_of(req: GenerationRequest) -> int:
        before = engine.stats()["prefix_hit_tokens"]
        engine.generate([req])
        return engine.stats()["prefix_hit_tokens"] - before

    req = GenerationRequest(prompt, SamplingParams(max_new_tokens=2, temperature=1.0, seed=1))
    hits_of(req)
    assert hits_of(req) > 0  # same version: the prompt's blocks are reused
    runner = engine.submit(sampled(11, n=300))  # holds blocks, so resetting the prefix cache fails
    start = engine.stats()["tokens_generated"]
    while engine.stats()["tokens_generated"] < start + 10:
        time.sleep(0.005)
    same = {"model.norm.weight": engine._host["model.norm.weight"].clone().numpy()}
    engine.update_weights(engine.version + 1, same)
    assert hits_of(req) == 0  # the blocks the old version computed are not reused on the new one
    assert hits_of(req) > 0
    runner.result()


def _fail_in_vllms_load_weights(engine, monkeypatch, times: int, loaded: int = 6) -> list[int]:
    """Fault injection into vLLM (not tandem): the model's ``load_weights`` loads the first ``loaded`` tensors
    it is given for real, then raises, for its next ``times`` calls. Returns the list of calls made."""
    model = engine._llm.collective_rpc(lambda worker: worker.model_runner.get_model())[0]
    original = type(model).load_weights
    calls: list[int] = []

    def load_weights(self, weights):
        calls.append(1)
        if len(calls) > times:
            return original(self, weights)
        original(self, itertools.islice(iter(weights), loaded))
        raise RuntimeError("injected fault inside vLLM's load_weights")

    monkeypatch.setattr(type(model), "load_weights", load_weights)
    return calls


def test_a_reload_that_fails_inside_vllm_applies_nothing(engine, monkeypatch):
    """vLLM's layerwise reload moves every layer to the meta device first: one that raised midway left the
    model there (every later request failed with a meta-tensor error while health() said ok), with part of
    the update applied. Now the engine puts the layers back, reloads the old values and still serves its
    version exactly."""
    v0 = engine.version
    before = engine.generate([sampled(21)])[0]
    host = {k: v.clone() for k, v in engine._host.items()}
    bumped = {k: (v + 0.05).numpy() for k, v in host.items() if k != "lm_head.weight"}
    calls = _fail_in_vllms_load_weights(engine, monkeypatch, times=1)
    with pytest.raises(EngineError) as full:
        engine.update_weights(v0 + 1, bumped)
    after = engine.generate([sampled(21)])[0]
    assert after.finish_reason == "length", after.error
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    assert len(calls) == 2  # the failed reload and the one that put the old values back
    name = "model.layers.0.mlp.down_proj.weight"
    idx = np.arange(0, host[name].numel(), 3, dtype=np.int64)
    _fail_in_vllms_load_weights(engine, monkeypatch, times=1, loaded=1)
    with pytest.raises(EngineError) as patch:
        engine.patch_weights(v0 + 1, {name: (idx, np.full(len(idx), 0.5, np.float32))})
    after = engine.generate([sampled(21)])[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    assert engine.version == v0 and engine.health()["ok"]
    assert all(torch.equal(engine._host[k], v) for k, v in host.items())
    for info in (full, patch):
        assert re.search(rf"injected fault.*nothing was applied.*serves version {v0}", str(info.value))


def test_a_loop_started_during_an_update_on_the_callers_thread_waits_for_it(engine, monkeypatch):
    """With no loop running, an update is applied on the caller's thread; a loop started meanwhile (start, or
    a first submit) stepped vLLM in the middle of the reload: its request failed on meta tensors (or was
    sampled from half-updated weights). Now the loop waits, and the request is served by the new version."""
    v0 = engine.version
    model = engine._llm.collective_rpc(lambda worker: worker.model_runner.get_model())[0]
    original = type(model).load_weights
    entered, release = threading.Event(), threading.Event()

    def load_weights(self, weights):  # vLLM's own loader, held back until the test lets it go on
        entered.set()
        release.wait(120)
        return original(self, weights)

    same = {"model.norm.weight": engine._host["model.norm.weight"].clone().numpy()}
    engine.stop()
    monkeypatch.setattr(type(model), "load_weights", load_weights)
    updater = threading.Thread(target=engine.update_weights, args=(v0 + 1, same))
    updater.start()
    try:
        assert entered.wait(120)
        engine.start()
        fut = engine.submit(sampled(31, n=4))
        with pytest.raises(TimeoutError):  # (before: answered at once, with an error)
            fut.result(timeout=3)
    finally:
        release.set()
        updater.join()
        engine.start()
    c = fut.result(timeout=120)
    assert c.finish_reason == "length", c.error
    assert c.versions == [v0 + 1] * 4 and engine.version == v0 + 1


def test_a_sync_the_engine_refused_is_redone_not_relabelled(engine, monkeypatch, tmp_path):
    """The delta path: a patch the engine refused (vLLM failed to reload it) left the follower a version
    ahead of the engine; the next sync sent an empty patch and the engine labelled its old weights with the
    new version. Now the next sync reloads in full and the engine holds the published bits."""
    original = {k: v.clone() for k, v in engine._host.items() if k != "lm_head.weight"}
    bf16 = lambda t: t.to(torch.bfloat16).view(torch.uint16).numpy().copy()  # noqa: E731 - the publish format
    published = {k: bf16(v) for k, v in original.items()}
    store = WeightStore.open(tmp_path / "weights", create=True, snapshot_every=100)
    server = serve_store(store)
    sync = EngineWeightSync(engine, server.url)
    try:
        publisher = WeightPublisher(store)
        publisher.publish(0, published)
        assert sync.sync(0)["full"]
        name = "model.layers.1.mlp.down_proj.weight"
        changed = torch.from_numpy(published[name]).view(torch.bfloat16).float() * 1.5
        published = {**published, name: bf16(changed)}
        publisher.publish(1, published)
        _fail_in_vllms_load_weights(engine, monkeypatch, times=1, loaded=1)
        with pytest.raises(EngineError, match="nothing was applied"):
            sync.sync(1)
        assert engine.version == 0
        sync.sync(1)
        assert engine.version == 1
        want = torch.from_numpy(published[name]).view(torch.bfloat16).float()
        assert torch.equal(engine._host[name], want)
    finally:
        sync.close()
        server.close()
        store.close()
        engine.update_weights(engine.version + 1, {k: v.numpy() for k, v in original.items()})


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64])
def test_weights_of_a_wrong_kind_are_refused_naming_the_tensor(engine, dtype):
    """An integer array of the right shape was cast silently: fp32 bit patterns sent as int32 became weights
    near 1e9 (uint16 stays the bfloat16 bit-pattern format)."""
    v0, before = engine.version, engine.generate([sampled(3)])[0]
    values = engine._host["model.norm.weight"].numpy().view(np.int32).astype(dtype)
    with pytest.raises(EngineError, match=r"'model.norm.weight' is not usable.*dtype"):
        engine.update_weights(v0 + 1, {"model.norm.weight": values})
    with pytest.raises(EngineError, match=r"'model.norm.weight' is not usable.*dtype"):
        engine.patch_weights(v0 + 1, {"model.norm.weight": (np.array([0, 1]), values[:2])})
    assert engine.version == v0 and engine.generate([sampled(3)])[0].token_ids == before.token_ids


def test_rendezvous_files_of_killed_processes_are_swept(tmp_path):
    """vLLM's rendezvous file lives in a directory named with the owner's pid: one a SIGKILL left (no close
    ran) is deleted by the next engine's start; a live process's is kept. Before, the file sat in the bare
    temp dir, where nothing tells whose it is, for good."""
    code = (
        "import os, signal; from tandem.engine.vllm import _rendezvous_dir; d = _rendezvous_dir(); "
        "d.mkdir(); (d / 'vllm_dist_0').write_text('x'); print(d, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = Path(proc.stdout.strip())
    assert (left / "vllm_dist_0").is_file()
    alive = left.with_name(left.name.rsplit("-", 1)[0] + "-1")  # pid 1 lives
    alive.mkdir(exist_ok=True)
    try:
        assert left in sweep_rendezvous()
        assert not left.exists() and alive.is_dir()
    finally:
        alive.rmdir()


def test_routing_capture_is_refused_on_cpu_with_the_reason():
    with pytest.raises(EngineError, match="routed_experts.*Triton"):
        VllmEngine(MODEL, EngineConfig(max_batch=2, max_seq_len=128), routed_experts=True)


def test_gateway_over_the_vllm_engine_is_token_exact(engine):
    chat = load_chat_format(MODEL)
    server = GatewayServer(create_app(engine, chat, chat.tokenizer, GatewayConfig(model_name="m"))).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Write a function add(a, b)."}]
        resp = client.chat.completions.create(
            model="m",
            messages=messages,
            tools=TOOLS,
            max_tokens=40,
            seed=5,
            logprobs=True,
            extra_headers={"X-Tandem-Session": "v"},
            extra_body={"return_token_ids": True},
        )
        ids = resp.choices[0].model_extra["token_ids"]
        rec = httpx.get(server.url + "/v1/tandem/sessions/v").json()
        seg = rec["segments"][0]
        prompt = chat.render_prompt(messages, TOOLS)
        assert seg["token_ids"] == prompt + ids
        assert seg["loss_mask"] == [0] * len(prompt) + [1] * len(ids)
        lps = [x.logprob for x in resp.choices[0].logprobs.content]
        np.testing.assert_allclose(seg["sampler_logprobs"][len(prompt) :], lps, atol=1e-6)
        bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "top_p": 0.5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
        # Streaming through the vLLM engine's token hook: the deltas add up to the non-stream text.
        greedy = dict(
            model="m", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0.0
        )
        whole = client.chat.completions.create(**greedy).choices[0].message.content or ""
        deltas = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**greedy, stream=True)
            if c.choices
        ]
        assert "".join(deltas) == whole and len([d for d in deltas if d]) > 1
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
