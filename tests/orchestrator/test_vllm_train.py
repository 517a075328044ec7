"""End to end: `tandem train` with the vLLM engine (engine.kind=vllm) in the Ray engine actor: rollouts in
real sandboxes, weights following the trainer as lossless deltas patched into vLLM, evaluation on vLLM too."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _rendezvous_files() -> set[Path]:
    """vLLM's rendezvous files in the temp dir, and tandem's per-process directories for them."""
    tmp = Path(tempfile.gettempdir())
    return {*tmp.glob("vllm_dist_*"), *tmp.glob("tandem-vllm-*"), *tmp.glob("tandem-vllm-*/vllm_dist_*")}


@pytest.mark.slow
def test_train_a_few_steps_on_the_vllm_engine(tmp_path, joined_ray):
    run_dir = tmp_path / "run"
    before = _rendezvous_files()
    args = ["--preset", "smoke", "--run-dir", str(run_dir), "--set", "engine.kind=vllm"]
    args += ["--set", "orchestrator.steps=3", "--set", "tasks.heldout_size=2"]
    r = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[-1]["version"] == 3
    for row in rows:
        assert row["samples"] > 0 and row["sampled_tokens"] > 0, row
    # step 1 was sampled and trained on version 0: vLLM's logprobs are the trainer's up to float rounding
    assert rows[0]["staleness_max"] == 0 and rows[0]["train/mismatch_abs_dlogp_mean"] < 0.01, rows[0]
    # the trainer's versions reached vLLM as deltas, applied between two of its steps
    assert any(row.get("engine_pause_s", 0) > 0 for row in rows[1:]), rows
    for name in ("eval_before.json", "eval_after.json"):
        result = json.loads((run_dir / name).read_text())
        assert result["n"] == 2 and 0.0 <= result["pass@1"] <= 1.0
    # the engine actor released vLLM before it was killed: its rendezvous file (one per engine) and the
    # process's directory for it are gone
    assert _rendezvous_files() <= before
