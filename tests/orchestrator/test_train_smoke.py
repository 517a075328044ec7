"""End to end: `tandem train --preset smoke` through Ray, real sandboxes and the shipped model; resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.core.config import RunConfig
from tandem.env.harness import TRUNCATION_CAUSES

from .conftest import tandem_debris

REPO = Path(__file__).resolve().parents[2]


def tandem(*args, cwd=REPO, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_smoke_train_writes_a_complete_run_dir_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    before = tandem_debris()
    r = tandem("train", "--preset", "smoke", "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    # Progress lines go to stderr; stdout carries only the results (so `bench pipeline --json` is pure JSON).
    assert "step 3/3 v3" in r.stderr and "[tandem" not in r.stdout and "report:" in r.stdout
    # Ray's error line about restartable actors whose arguments hold actor handles (ray-project/ray#53727):
    # rollout workers take the engines' and the buffer's names instead, so a run prints no such alarm
    assert "constructor arguments in the object store" not in r.stderr
    for key in ("step", "version", "reward_mean", "samples", "staleness_max", "trainer_busy", "engine_busy"):
        assert key in rows[-1], key
    # mismatch metrics are numbers in every row; the token-probability pairs stay out of metrics.jsonl
    assert all("train/mismatch_kl_k1" in r and "train/mismatch_ess" in r for r in rows)
    assert not any("pairs" in k for r in rows for k in r)
    assert all(row["staleness_max"] <= 2 for row in rows)
    assert rows[-1]["version"] == 3
    # every step prefilled prompt tokens; multi-turn sessions reuse their parked KV for some of them
    assert all(row["engine_prefill_tokens"] > 0 for row in rows)
    assert all(0.0 <= row["engine_prefix_hit_frac"] < 1.0 for row in rows)
    assert max(row["engine_prefix_hit_frac"] for row in rows) > 0.0
    # sampled tokens per decode step (first tokens of prefills included): each step samples at least one
    # token per active session, and a step's batch and its admissions are each at most engine.max_batch
    assert all(1.0 <= row["engine_batch_mean"] <= 2 * 64 for row in rows)
    # the machine's busy cores since training started: some work, never more than its cores
    assert all(0.0 < row["machine_busy_cores"] <= (os.cpu_count() or 1) + 1e-6 for row in rows)
    # The default weight path: each version went to the run's store as a lossless delta, far smaller than
    # the bf16 weights, and the engine fetched and patched it without a recovery.
    assert all(row["weight_delta_bytes"] > 0 and row["weight_ratio"] > 2 for row in rows)
    assert all(row.get("weight_recoveries", 0) == 0 for row in rows)
    assert sorted(p.name for p in (run_dir / "weights" / "manifests").iterdir())[-1] == "v00000003.json"
    for name in (
        "config.toml",
        "report.md",
        "eval_before.json",
        "eval_after.json",
        "reward.png",
        "staleness.png",
        "busy.png",
        "throughput.png",
        "heldout.png",
        "summary.json",
    ):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tensorboard").iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 < summary["machine_busy_cores"] <= (os.cpu_count() or 1)
    report = (run_dir / "report.md").read_text()
    assert "machine cores busy" in report and "policy entropy per sampled token: first fifth" in report
    assert "truncated sessions (turn, token or time limit): first fifth" in report
    assert "kept out of the loss (train.mask_truncated)" in report  # overlong filtering is on by default
    assert "truncated by each limit (first fifth -> last fifth): turn limit (tasks.max_turns)" in report
    for row in rows:  # every truncated session names exactly one limit (tandem.env.harness)
        by_cause = sum(row[f"truncated_{c}_frac"] for c in TRUNCATION_CAUSES)
        assert abs(by_cause - row["truncated_frac"]) < 1e-9, row
    # a few sessions of every step, whole, to read what the policy did
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    per_step = {r["step"]: [s for s in samples if s["step"] == r["step"]] for r in rows}
    assert all(len(v) == 2 for v in per_step.values()), {k: len(v) for k, v in per_step.items()}
    for s in samples:
        assert s["messages"][0]["role"] in ("system", "user") and s["messages"][-1]["role"] in (
            "assistant",
            "tool",
        )
        assert 0.0 <= s["reward"] <= 1.0 and s["sampled_tokens"] > 0 and s["sampled_by"] <= s["step"]
        assert s["flags"]["truncated"] == any(s["flags"][f"truncated_{c}"] for c in TRUNCATION_CAUSES)
    assert "samples.jsonl" in report
    # step 1 trains only tokens the starting weights sampled: the same version as the trainer's
    assert rows[0]["train/mismatch_same_version_tokens"] == rows[0]["train/mismatch_tokens"]
    # the run says which engine served it and why (the smoke preset names the built-in engine)
    assert 'kind = "builtin"' in (run_dir / "config.toml").read_text()
    assert "engine: builtin (engine.kind='builtin' (set explicitly))" in r.stderr
    assert summary["engine"] == "builtin" and "served by the `builtin` engine" in report
    ev = json.loads((run_dir / "eval_after.json").read_text())
    assert ev["n"] == 4 and 0.0 <= ev["pass@1"] <= 1.0
    assert (run_dir / "final_model" / "config.json").is_file()
    state_file = run_dir / "checkpoints" / "step_000003" / "trainer_state.json"
    saved_cursor = json.loads(state_file.read_text())["task_cursor"]  # past every task the workers drew
    assert saved_cursor > RunConfig().tasks.train_start + 1

    # resume in sync mode with two engines: continue from the last checkpoint (step 3) to step 4, with zero
    # staleness; the host's leader process decodes the delta and both engines apply its patch from the share
    shares_before = set(Path("/dev/shm").glob("tandem-share-*"))
    r = tandem(
        "train",
        "--preset",
        "smoke",
        "--run-dir",
        str(run_dir),
        "--resume",
        "--set",
        "orchestrator.steps=4",
        "--set",
        "eval.before_after=false",
        "--set",
        "orchestrator.mode=sync",
        "--set",
        "engine.num_engines=2",
        "--set",
        "weights.host_leader=true",
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[-1]["staleness_max"] == 0 and rows[-1]["version"] == 4
    assert rows[-1]["engine_pause_s"] > 0 and rows[-1]["weight_recoveries"] == 0
    # The host leader decoded it and both engines read its patch (1.0), unless an engine waited its
    # lead_yield_ms in vain and led the step itself (0.5): either way one decode for the host.
    assert rows[-1]["weight_shared_frac"] in (0.5, 1.0)
    assert set(Path("/dev/shm").glob("tandem-share-*")) == shares_before  # the run removed its share
    # The resumed workers drew on from the saved cursor, not from the run's first tasks again.
    state_file = run_dir / "checkpoints" / "step_000004" / "trainer_state.json"
    assert json.loads(state_file.read_text())["task_cursor"] > saved_cursor
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "task_cursor": -3}))
    r = tandem("train", "--preset", "smoke", "--run-dir", str(run_dir), "--resume", "--set",
               "orchestrator.steps=5")  # fmt: skip
    assert r.returncode != 0 and "task_cursor=-3" in r.stderr, r.stderr[-2000:]
    # a finished run leaves no sandbox, layer cache or /etc copy behind (its actors release them first)
    assert tandem_debris() <= before


def test_invalid_config_refuses_to_start_and_names_the_field(tmp_path):
    r = tandem(
        "train", "--preset", "smoke", "--run-dir", str(tmp_path), "--set", "orchestrator.max_staleness=-1"
    )
    assert r.returncode == 2
    assert "max_staleness" in r.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_missing_model_path_is_a_clear_error(tmp_path):
    r = tandem("train", "--preset", "smoke", "--run-dir", str(tmp_path), "--set", "model.path=/nonexistent/m")
    assert r.returncode == 2
    assert "/nonexistent/m" in r.stderr and "model.path" in r.stderr


def test_engines_kv_caches_past_the_machines_memory_are_refused_before_ray(tmp_path):
    """Before: the engine actor's allocator failed after Ray had started ("can't allocate memory: you tried
    to allocate 39321600000 bytes" in an actor traceback, then "the run could not start")."""
    run_dir = tmp_path / "run"
    r = tandem("train", "--preset", "smoke", "--run-dir", str(run_dir), "--set", "engine.max_seq_len=100000")
    assert r.returncode == 2
    assert r.stderr.startswith("error: engine.max_batch (64) + engine.max_parked (64) sequences of ")
    assert "engine.max_seq_len (100000) tokens need a KV cache of 73.2 GiB" in r.stderr
    assert "Ray" not in r.stderr and not run_dir.exists()
    # each engine has its own cache; one that fits (the machine's memory / 2) does not fit three times
    half = (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 2
    per_token = 2 * 6 * 128 * 2 * 64 * 4  # keys and values, 6 layers, 128 slots, 2 KV heads of 64, float32
    sets = ["--set", f"engine.max_seq_len={half // per_token}", "--set", "engine.num_engines=3"]
    r = tandem("train", "--preset", "smoke", "--run-dir", str(run_dir), *sets)
    assert r.returncode == 2 and "need 3 KV caches (one per engine) of " in r.stderr, r.stderr[-2000:]
