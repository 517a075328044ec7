"""End to end on a tiny MoE: `tandem train` through Ray, real sandboxes and the built-in engine, with router
replay; the sampler's routes reach the trainer through the buffer and the routing metrics are logged."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.model.moe import write_model_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_moe_with_router_replay(tmp_path, joined_ray):
    model = write_model_dir(tmp_path / "moe", "moe", tokenizer_dir=REPO / "models" / "tandem-base")
    run_dir = tmp_path / "run"
    sets = [
        f"model.path={model}",
        "train.router_replay=r3",
        "train.is_correction=icepop",  # forwards every trajectory, also zero-advantage ones
        "train.mask_truncated=false",  # and truncated ones: the random model's sessions all hit the limits
        "orchestrator.steps=1",
        "eval.before_after=false",
        "tasks.max_turns=2",
        "rollout.max_new_tokens=64",
    ]
    args = ["train", "--preset", "smoke", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    row = rows[0]
    assert row["train/updated"] == 1 and row["train/trained_tokens"] > 0
    assert row["train/routes_recorded_frac"] == 1.0
    assert 0.5 < row["train/routing_agreement"] <= 1.0
    assert "MoE routing agreement" in (run_dir / "report.md").read_text()
