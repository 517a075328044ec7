"""The delta path end to end on one machine: a publisher writes versions to a real store served over HTTP on
127.0.0.1, an engine follows it by patching changed elements, and recovers from corruption via a snapshot."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tandem.core.config import EngineConfig
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.engine import BuiltinEngine
from tandem.engine.follow import EngineWeightSync
from tandem.weights import WeightStore, serve_store
from tandem.weights.publish import WeightPublisher


def _bf16_state(model) -> dict[str, np.ndarray]:
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().to(torch.bfloat16).contiguous().view(torch.uint16).numpy().copy()
    return out


def _model():
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()


def _step(model, g):
    """An RL-like update of the fp32 master weights: small, so most bf16 values do not change."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-4 * (p.abs() + 1e-3))


@pytest.fixture
def served(tmp_path):
    store = WeightStore.open(tmp_path / "weights", create=True, snapshot_every=3)
    server = serve_store(store)
    yield store, server
    server.close()
    store.close()


def _greedy(engine, prompt):
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    return engine.generate([GenerationRequest(prompt, params)])[0]


def test_engine_follows_deltas_and_matches_published_bits(served):
    store, server = served
    trainer_model = _model()
    publisher = WeightPublisher(store, keep_versions=4)
    engine = BuiltinEngine(_model(), EngineConfig(max_batch=2, max_seq_len=64))
    engine.start()
    sync = EngineWeightSync(engine, server.url)
    g = torch.Generator().manual_seed(1)
    try:
        kinds = []
        for version in range(6):
            if version:
                _step(trainer_model, g)
            published = _bf16_state(trainer_model)
            kinds.append(publisher.publish(version, published).kind)
            out = sync.sync(version)
            assert out["version"] == engine.version == version
            assert out["full"] == (version == 0)  # only the first sync reloads; later ones patch
            state = engine.model.state_dict()
            for name, bits in published.items():
                want = torch.from_numpy(bits).view(torch.bfloat16).float()
                assert torch.equal(state[name], want), (version, name)
            if version:
                assert 0 < out["patched_elements"] < sum(b.size for b in published.values())
        assert kinds == ["full", "delta", "delta", "full", "delta", "delta"]
        # The engine's outputs are those of a model loaded with the published weights.
        ref = BuiltinEngine(_model(), EngineConfig(max_batch=2, max_seq_len=64))
        ref.update_weights(5, published)
        ref.start()
        try:
            assert _greedy(engine, [1, 2, 3]).token_ids == _greedy(ref, [1, 2, 3]).token_ids
        finally:
            ref.stop()
        assert sync.recoveries == 0
    finally:
        engine.stop()


def test_corrupt_blob_recovers_from_snapshot_and_never_serves_bad_weights(served, tmp_path):
    store, server = served
    trainer_model = _model()
    publisher = WeightPublisher(store, keep_versions=10)
    engine = BuiltinEngine(_model(), EngineConfig(max_batch=2, max_seq_len=64))
    sync = EngineWeightSync(engine, server.url)
    g = torch.Generator().manual_seed(2)
    publisher.publish(0, _bf16_state(trainer_model))
    sync.sync(0)
    for version in (1, 2, 3, 4):
        _step(trainer_model, g)
        publisher.publish(version, _bf16_state(trainer_model))
    published = _bf16_state(trainer_model)
    # Corrupt a blob of the delta 0 -> 1 in place (same size): the chain 0..4 becomes unusable.
    ref = next(iter(store.manifest(1).blobs.values()))
    path = tmp_path / "weights" / "blobs" / ref.key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    out = sync.sync(4)
    assert out["recovered"] and sync.recoveries == 1 and engine.version == 4
    state = engine.model.state_dict()
    for name, bits in published.items():
        assert torch.equal(state[name], torch.from_numpy(bits).view(torch.bfloat16).float()), name


def test_store_work_and_idle_syncs_run_below_the_process_priority_and_bad_nice_is_refused(served):
    """Download and decode run ``nice`` levels down, and so does an idle engine's whole sync; a serving
    engine's short GIL-holding sync work stays at the process's priority (a starved GIL holder would stall
    its decode loop). Which thread a sync takes follows ``health()["active"]``."""
    import os
    import threading
    import time

    from tandem.core.config import load_config
    from tandem.core.errors import ConfigError

    _, server = served
    engine = BuiltinEngine(_model(), EngineConfig(max_batch=2, max_seq_len=4096))
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    sync = EngineWeightSync(engine, server.url, nice=5)

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    publisher = WeightPublisher(served[0], keep_versions=4)
    trainer_model = _model()
    g = torch.Generator().manual_seed(1)
    engine.start()
    try:
        assert sync._store.submit(niceness).result() == min(19, base + 5)
        assert sync._idle_worker.submit(niceness).result() == min(19, base + 5)
        assert sync._worker.submit(niceness).result() == base
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller is untouched
        publisher.publish(0, _bf16_state(trainer_model))
        assert sync.sync(0)["serving"] is False  # idle: the lowered thread
        _step(trainer_model, g)
        publisher.publish(1, _bf16_state(trainer_model))
        long = GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=4000, temperature=1.0))
        running = engine.submit(long)
        deadline = time.monotonic() + 30
        while not engine.health().get("active") and time.monotonic() < deadline:
            time.sleep(0.001)
        out = sync.sync(1)
        assert out["serving"] is True and out["version"] == 1 and sync.stats["serving_syncs"] == 1
        running.result(timeout=120)
    finally:
        sync.close()
        engine.stop()
    with pytest.raises(ValueError, match="nice=25"):
        EngineWeightSync(engine, server.url, nice=25)
    with pytest.raises(ConfigError, match="follow_nice"):
        load_config(overrides=["weights.follow_nice=-1"])


def test_sync_threads_of_a_niced_process_still_rank_well_below_its_engine():
    """Ray starts worker processes (engine actors) at nice 15, which leaves 4 nice levels: the sync thread
    then becomes SCHED_IDLE, not nice 19 (2.4x below the engine instead of the 10 levels' 9.3x)."""
    import os
    import subprocess
    import sys

    from tandem.engine.follow import lower_priority_plan

    assert lower_priority_plan(0, 10) == ("nice", 10)
    assert lower_priority_plan(5, 10) == ("nice", 15)
    assert lower_priority_plan(15, 10) == ("idle", 19)
    assert lower_priority_plan(15, 0) == ("nice", 15)
    if not hasattr(os, "SCHED_IDLE"):
        pytest.skip("no SCHED_IDLE on this platform")
    code = (
        "import os, threading\n"
        "from tandem.engine.follow import _lower_priority\n"
        "os.nice(15 - os.nice(0))\n"
        "out = []\n"
        "def probe():\n"
        "    _lower_priority(10)\n"
        "    tid = threading.get_native_id()\n"
        "    idle = os.sched_getscheduler(tid) == os.SCHED_IDLE\n"
        "    out.append((idle, os.getpriority(os.PRIO_PROCESS, tid)))\n"
        "t = threading.Thread(target=probe); t.start(); t.join()\n"
        "main = os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER\n"
        "print(out[0][0], out[0][1], main)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "19", "True"]


def _assert_serves(engine, published):
    state = engine.model.state_dict()
    for name, bits in published.items():
        assert torch.equal(state[name], torch.from_numpy(bits).view(torch.bfloat16).float()), name


def test_engines_of_a_host_share_one_decode_and_one_shadow_per_delta_and_never_apply_a_bad_patch(
    served, tmp_path
):
    """Three engines follow one store through a host share: the first load is downloaded once and the
    others reload from the host's one verified shadow; per delta one engine downloads, decodes and advances
    that shadow, the others apply its verified patch (nothing downloaded, no shadow of their own); a lagging
    engine applies a chain of patches composed into one; a corrupt patch file is never applied (the engine
    patches the positions the store's delta changes from the verified shadow instead); every engine ends on
    exactly the published bits."""
    from tandem.weights.hostshadow import HostShadow
    from tandem.weights.hostshare import HostShare

    store, server = served
    trainer_model = _model()
    publisher = WeightPublisher(store, keep_versions=10)
    share = HostShare(tmp_path / "share", keep=4)
    engines = [BuiltinEngine(_model(), EngineConfig(max_batch=2, max_seq_len=64)) for _ in range(3)]
    syncs = [EngineWeightSync(e, server.url, share=share) for e in engines]
    g = torch.Generator().manual_seed(3)

    def host_shadow_is(version: int) -> None:
        with share.lock():
            at, tensors = HostShadow(share.path).load()
        assert at == version
        for name, bits in _bf16_state(trainer_model).items():
            np.testing.assert_array_equal(tensors[name].view(np.uint16), bits.view(np.uint16))
        assert len(list(share.path.glob("shadow-*.bin"))) == 1
        assert all(s.follower.shadow is None for s in syncs)  # no engine keeps a shadow of its own

    try:
        publisher.publish(0, _bf16_state(trainer_model))
        first = [s.sync(0) for s in syncs]
        assert all(r["full"] for r in first)
        assert (
            first[0]["downloaded_bytes"] > 0
            and first[1]["downloaded_bytes"] == first[2]["downloaded_bytes"] == 0
        )
        assert not list(share.path.glob("*.patch"))  # a full load writes no patch
        assert not any(e._deferred for e in engines)  # a full sync's late writes (second bank) are done
        host_shadow_is(0)
        for version in (1, 2):
            _step(trainer_model, g)
            publisher.publish(version, _bf16_state(trainer_model))
            lead, *rest = [syncs[0].sync(version), syncs[1].sync(version)]
            assert lead["shared_steps"] == 0 and lead["downloaded_bytes"] > 0 and not lead["full"]
            assert rest[0]["shared_steps"] == 1 and rest[0]["downloaded_bytes"] == 0 and not rest[0]["full"]
            assert rest[0]["patched_elements"] == lead["patched_elements"] > 0
            _assert_serves(engines[1], _bf16_state(trainer_model))
            host_shadow_is(version)
        # The third engine is two versions behind: it applies the chain 0 -> 1 -> 2 from the share at once.
        lag = syncs[2].sync(2)
        assert lag["shared_steps"] == 2 and lag["downloaded_bytes"] == 0 and not lag["full"]
        _assert_serves(engines[2], _bf16_state(trainer_model))
        # A corrupt patch (one flipped byte) is not applied: the shadow is past the reader, so the reader
        # patches the elements the store's delta 2 -> 3 changes with the shadow's values (no full reload).
        _step(trainer_model, g)
        publisher.publish(3, _bf16_state(trainer_model))
        syncs[0].sync(3)
        (path,) = share.path.glob("00000002-00000003.patch")
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        assert share.read(2, 3) is None
        out = syncs[1].sync(3)
        assert out["shared_steps"] == 0 and not out["full"] and out["downloaded_bytes"] > 0
        assert 0 < out["patched_elements"] < sum(t.size for t in _bf16_state(trainer_model).values())
        for e in engines[:2]:
            _assert_serves(e, _bf16_state(trainer_model))
        host_shadow_is(3)
        assert len(list(share.path.glob("*.patch"))) <= 4  # the writer keeps the newest `keep`
        assert all(s.recoveries == 0 for s in syncs)
    finally:
        for s in syncs:
            s.close()
    with pytest.raises(ValueError, match="keep=0"):
        HostShare(tmp_path / "other", keep=0)


def _two_engines_sharing(served, tmp_path):
    """A trainer model, its publisher, a host share, and two engines following the store through it."""
    from tandem.weights.hostshare import HostShare

    store, server = served
    share = HostShare(tmp_path / "share")
    engines = [BuiltinEngine(_model(), EngineConfig(max_batch=2, max_seq_len=64)) for _ in range(2)]
    syncs = [EngineWeightSync(e, server.url, share=share) for e in engines]
    return _model(), WeightPublisher(store, keep_versions=10), share, engines, syncs


def test_a_damaged_or_unfinished_host_shadow_is_recovered_from_a_snapshot_never_served(served, tmp_path):
    """The host shadow is the base every engine's patch is decoded against. Flipped bits in it fail the next
    delta's verification (the leader recovers from the snapshot, counts it, and reloads the verified
    weights; the other engine patches from them); a leader that died while updating it (state left dirty)
    leaves no shadow, so the next one recovers too. Engines only ever serve the published bits."""
    import json

    from tandem.weights.hostshadow import HostShadow

    trainer_model, publisher, share, engines, syncs = _two_engines_sharing(served, tmp_path)
    g = torch.Generator().manual_seed(11)
    try:
        publisher.publish(0, _bf16_state(trainer_model))
        for s in syncs:
            s.sync(0)
        # Flip bits of the shadow the way a stray write would (its state still says "verified").
        with share.lock():
            _, tensors = HostShadow(share.path).load()
            next(iter(tensors.values())).reshape(-1)[:8] ^= 0x5A5A
        _step(trainer_model, g)
        publisher.publish(1, _bf16_state(trainer_model))
        out = syncs[0].sync(1)
        assert out["recovered"] and out["full"] and syncs[0].recoveries == 1
        _assert_serves(engines[0], _bf16_state(trainer_model))
        # No patch leads from 0 (the leader recovered): the reader patches what the store's delta 0 -> 1
        # changes with the recovered shadow's values.
        out = syncs[1].sync(1)
        assert not out["full"] and out["shared_steps"] == 0 and out["downloaded_bytes"] > 0
        _assert_serves(engines[1], _bf16_state(trainer_model))
        # A leader that died mid-update leaves the state dirty: no shadow until the next one recovers.
        state_path = share.path / "shadow.json"
        state = json.loads(state_path.read_text())
        state_path.write_text(json.dumps({**state, "dirty": True}))
        with share.lock():
            assert HostShadow(share.path).load() == (None, None)
        _step(trainer_model, g)
        publisher.publish(2, _bf16_state(trainer_model))
        out = syncs[1].sync(2)
        assert out["full"] and out["downloaded_bytes"] > 0
        _assert_serves(engines[1], _bf16_state(trainer_model))
        with share.lock():
            assert HostShadow(share.path).load()[0] == 2
    finally:
        for s in syncs:
            s.close()


def test_engines_read_a_written_patch_while_another_holds_the_share_lock(served, tmp_path):
    """Reading a patch that is already written takes no lock: while another process of the host holds the
    share's lock (a leader decoding a later step), an engine still applies the written patch and serves the
    version. Without a patch, the engine waits for the lock rather than decode the same step alongside."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as FutureTimeout

    trainer_model, publisher, share, engines, syncs = _two_engines_sharing(served, tmp_path)
    held, release = threading.Event(), threading.Event()

    def hold_lock() -> None:
        with share.lock():
            held.set()
            release.wait(60)

    g = torch.Generator().manual_seed(5)
    try:
        publisher.publish(0, _bf16_state(trainer_model))
        for s in syncs:
            s.sync(0)
        _step(trainer_model, g)
        publisher.publish(1, _bf16_state(trainer_model))
        assert syncs[0].sync(1)["shared_steps"] == 0  # the leader wrote the patch 0 -> 1
        with ThreadPoolExecutor(3) as pool:
            holder = pool.submit(hold_lock)
            assert held.wait(30)
            out = pool.submit(syncs[1].sync, 1).result(timeout=30)  # the lock is held throughout
            assert out["shared_steps"] == 1 and out["downloaded_bytes"] == 0
            _assert_serves(engines[1], _bf16_state(trainer_model))
            # Version 2 has no patch yet: the engine must wait for the lock, not advance on its own.
            _step(trainer_model, g)
            publisher.publish(2, _bf16_state(trainer_model))
            waiting = pool.submit(syncs[1].sync, 2)
            with pytest.raises(FutureTimeout):
                waiting.result(timeout=1.0)
            release.set()
            holder.result(timeout=30)
            assert waiting.result(timeout=60)["shared_steps"] == 0
        _assert_serves(engines[1], _bf16_state(trainer_model))
    finally:
        release.set()
        for s in syncs:
            s.close()


def test_a_serving_engine_lets_an_idle_one_produce_the_shared_patch(served, tmp_path):
    """With a host share, an engine that has sessions running waits (``lead_yield_ms``) for another engine
    of its host to produce the next patch instead of decoding it beside its decode loop; when nobody does,
    it produces the patch itself after the wait. A bad wait is refused naming the parameter."""
    import threading
    import time
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from tandem.weights.hostshare import HostShare

    store, server = served
    trainer_model = _model()
    publisher = WeightPublisher(store, keep_versions=10)
    share = HostShare(tmp_path / "share")
    busy, idle = (BuiltinEngine(_model(), EngineConfig(max_batch=2, max_seq_len=64)) for _ in range(2))
    syncs = [EngineWeightSync(busy, server.url, share=share, lead_yield_ms=10_000),
             EngineWeightSync(idle, server.url, share=share)]  # fmt: skip
    stop = threading.Event()

    def load() -> None:  # keep the busy engine's batch full and its queue non-empty
        # A window of 8 requests in flight (4 batches), each replaced as the oldest finishes: the engine
        # never shows nothing running or queued, however its requests' ends line up (two loaders that each
        # waited for a whole batch both sat between calls once, and the check in that gap led at once).
        params = SamplingParams(max_new_tokens=40, temperature=1.0)
        window = deque(busy.submit(GenerationRequest([1 + i, 2, 3], params)) for i in range(8))
        i = 0
        while not stop.is_set():
            window.popleft().result()
            i += 1
            window.append(busy.submit(GenerationRequest([1 + i % 8, 2, 3], params)))

    g = torch.Generator().manual_seed(9)
    try:
        publisher.publish(0, _bf16_state(trainer_model))
        for s in syncs:
            s.sync(0)
        busy.start()
        loaders = [threading.Thread(target=load, daemon=True)]
        for loader in loaders:
            loader.start()
        deadline = time.monotonic() + 30
        while not busy.health()["active"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert busy.health()["active"]
        _step(trainer_model, g)
        publisher.publish(1, _bf16_state(trainer_model))
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(syncs[0].sync, 1)
            time.sleep(1.0)
            assert not waiting.done()  # serving: it waits for someone else to produce the patch
            led = syncs[1].sync(1)
            assert led["shared_steps"] == 0 and led["downloaded_bytes"] > 0
            out = waiting.result(timeout=60)
        assert out["shared_steps"] == 1 and out["downloaded_bytes"] == 0
        assert syncs[0].stats["lead_yields"] == 1
        # Nobody else produces version 2: after its (now short) wait, the serving engine does it itself.
        syncs[0].lead_yield_s = 0.05
        _step(trainer_model, g)
        publisher.publish(2, _bf16_state(trainer_model))
        out = syncs[0].sync(2)
        assert out["shared_steps"] == 0 and out["downloaded_bytes"] > 0
        assert syncs[0].stats["lead_yields"] == 1
        stop.set()
        for loader in loaders:
            loader.join(timeout=60)
        busy.stop()
        _assert_serves(busy, _bf16_state(trainer_model))
    finally:
        stop.set()
        busy.stop()  # fails the load's requests if the test failed with them running
        for s in syncs:
            s.close()
    with pytest.raises(ValueError, match="lead_yield_ms"):
        EngineWeightSync(idle, server.url, share=share, lead_yield_ms=-1)


def test_a_host_leader_leads_every_step_so_engines_only_read_patches(served, tmp_path):
    """A ``HostLeader`` (a process of its own in a run) advances the host shadow and writes each step's
    patch: the engines then download and decode nothing, not even their first load, and a step it already
    led is a no-op; what the engines serve is exactly the published bits."""
    from tandem.weights.hostlead import HostLeader

    trainer_model, publisher, share, engines, syncs = _two_engines_sharing(served, tmp_path)
    leader = HostLeader(syncs[0].follower.client.urls, share)
    g = torch.Generator().manual_seed(13)
    try:
        publisher.publish(0, _bf16_state(trainer_model))
        first = leader.advance(0)
        assert first["full"] and not first["patch"] and first["downloaded_bytes"] > 0
        for s in syncs:
            out = s.sync(0)
            assert out["full"] and out["downloaded_bytes"] == 0  # reloaded from the leader's shadow
        for version in (1, 2):
            _step(trainer_model, g)
            publisher.publish(version, _bf16_state(trainer_model))
            led = leader.advance(version)
            assert led["patch"] and led["base"] == version - 1 and not led["full"]
            assert leader.advance(version)["skipped"]
            for s, e in zip(syncs, engines, strict=True):
                out = s.sync(version)
                assert out["shared_steps"] == 1 and out["downloaded_bytes"] == 0 and not out["full"]
                _assert_serves(e, _bf16_state(trainer_model))
        assert leader.stats["patches"] == 2 and leader.stats["recoveries"] == 0
    finally:
        leader.close()
        for s in syncs:
            s.close()
    with pytest.raises(ValueError, match="nice=20"):
        HostLeader(syncs[0].follower.client.urls, share, nice=20)
