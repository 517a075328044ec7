"""`tandem bench sync` end to end at its smallest: one relay, one engine, one delta, real Ray and HTTP."""

import json
import os

from tandem.core.config import AUTO_LOOP_PRIORITY_BOOST


def test_bench_sync_prints_its_json_and_the_delta_is_far_smaller(bench_cli):
    r = bench_cli("sync", "--json", "--relays", "1", "--engines", "1", "--deltas", "1", "--size", "default")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("bandwidth_mbps", "relays", "engines", "delta_s", "full_s", "speedup", "bound_s", "pause_ms",
                "full_reload_ms", "tokens_per_s_during_sync_ratio"):  # fmt: skip
        assert key in out, key
    assert out["size"] == "default" and out["model_params"] > 1_000_000
    assert out["warmup_deltas"] == 1 and out["first_delta_s"] > 0  # untimed, reported apart
    assert out["host_share"] is True and out["shared_syncs_frac"] == 0.0  # one engine: nothing to share
    assert out["host_leader"] is False and out["busy_engines"] == 1  # a leader only with several engines
    assert 0 < out["density"] < 0.5
    assert 0 < out["delta_bytes"] * 10 < out["full_bytes"] < out["raw_bytes"]
    assert out["pause_ms"] > 0 and out["full_reload_ms"] > 0 and out["tokens_per_s_quiet"] > 0
    assert out["tokens_per_s_quiet_after"] > 0  # the unpaired baseline, reported beside the paired one
    during = out["tokens_per_s_during_sync"]
    for ratio, quiet in (("", "tokens_per_s_quiet"), ("_after", "tokens_per_s_quiet_after")):
        assert abs(out["tokens_per_s_during_sync_ratio" + ratio] - during / out[quiet]) < 0.01
    per_sync = out["tokens_per_s_during_sync_ratio_per_sync"]  # one ratio per timed delta
    assert len(per_sync) == 1 and abs(per_sync[0] - out["tokens_per_s_during_sync_ratio"]) < 0.01
    assert out["share_mb"] * 2**20 >= out["raw_bytes"]  # the host's shadow lives in the share
    assert out["engines_rss_anon_mb"] > 0
    assert out["trainer_side_nice"] >= out["engine_nice"]  # the publisher runs as niced as the actors
    # unset: the automatic boost of an engine with no trainer on its host, which root (here, CI) may apply
    assert out["loop_priority_boost"] == AUTO_LOOP_PRIORITY_BOOST and out["loop_priority_boost_auto"] is True
    boosted = max(-20, out["engine_nice"] - AUTO_LOOP_PRIORITY_BOOST)
    assert out["engine_loop_nice"] == (boosted if os.geteuid() == 0 else out["engine_nice"])
    parts = out["breakdown"]
    engine_parts = {"engine_fetch_s", "engine_decode_s", "engine_pause_s", "engine_total_s"}
    assert set(parts) == {"publish_s", *engine_parts}
    assert 0 < parts["engine_pause_s"] < parts["engine_total_s"] <= out["delta_s"]


def test_bench_sync_rejects_bad_counts(bench_cli):
    r = bench_cli("sync", "--relays", "0", timeout=120)
    assert r.returncode == 2 and "relays" in r.stderr
    r = bench_cli("sync", "--size", "1t", timeout=120)
    assert r.returncode == 2 and "size '1t'" in r.stderr
    r = bench_cli("sync", "--warmup-deltas", "-1", timeout=120)
    assert r.returncode == 2 and "warmup_deltas=-1" in r.stderr
    r = bench_cli("sync", "--engines", "2", "--busy-engines", "3", timeout=120)
    assert r.returncode == 2 and "busy_engines=3" in r.stderr
    r = bench_cli("sync", "--loop-priority-boost", "40", timeout=120)
    assert r.returncode == 2 and "loop_priority_boost=40" in r.stderr
