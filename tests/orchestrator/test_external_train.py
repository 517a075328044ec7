"""End to end: `tandem train` with an external OpenAI-client harness (examples/openai_harness.py) as the
rollout, through Ray, the worker's gateway, real sandboxes and the shipped model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "examples" / "openai_harness.py"


@pytest.mark.slow
def test_train_a_few_steps_with_the_example_harness(tmp_path, joined_ray):
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli.main",
            "train",
            "--preset",
            "smoke",
            "--run-dir",
            str(run_dir),
            "--set",
            "orchestrator.steps=2",
            "--set",
            "eval.before_after=false",
            "--set",
            f'rollout.harness_command=["python3", "{HARNESS}"]',
            "--set",
            f'rollout.harness_mounts=["{HARNESS.parent}"]',
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and rows[-1]["version"] == 2
    # the harness's sessions reached the trainer as sampled tokens (trained on when rewards differ)
    for row in rows:
        assert row["samples"] > 0 and row["sampled_tokens"] > 0 and row["harness_failed_frac"] == 0.0, row
