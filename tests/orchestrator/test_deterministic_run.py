"""End to end: `tandem train --preset smoke` with train.deterministic through Ray, real sandboxes, the shipped
model and the default (bf16 delta) weight path: the trainer's logprobs equal the engine's bit for bit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_deterministic_run_has_zero_mismatch(tmp_path):
    run_dir = tmp_path / "run"
    sets = [
        "train.deterministic=true", "orchestrator.steps=1", "eval.before_after=false",
        # every trajectory is forwarded (zero-advantage ones too), so the mismatch covers every sampled token
        "train.is_correction=icepop",
    ]  # fmt: skip
    args = ["train", "--preset", "smoke", "--run-dir", str(run_dir), *[x for s in sets for x in ("--set", s)]]
    cmd = [sys.executable, "-m", "tandem.cli.main", *args]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["train/mismatch_tokens"] > 0
    assert row["train/mismatch_kl_k3"] == 0.0 and row["train/mismatch_abs_dlogp_max"] == 0.0
