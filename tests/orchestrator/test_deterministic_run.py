"""End to end: `tandem train --preset smoke` with train.deterministic through Ray, real sandboxes and the
default (bf16 delta) weight path, on the shipped dense model and on a tiny Qwen3-MoE: the trainer's
logprobs equal the engine's bit for bit (and, on the MoE, its routes: routing agreement exactly 1)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_deterministic_run_has_zero_mismatch(tmp_path, model, joined_ray):
    run_dir = tmp_path / "run"
    sets = [] if model == "dense" else [f"model.path={_moe_dir(tmp_path)}"]
    sets += [
        "train.deterministic=true", "orchestrator.steps=1", "eval.before_after=false",
        # every trajectory is forwarded (zero-advantage ones too), so the mismatch covers every sampled token
        "train.is_correction=icepop", "train.mask_truncated=false",  # truncated ones too (random MoE)
    ]  # fmt: skip
    args = ["train", "--preset", "smoke", "--run-dir", str(run_dir), *[x for s in sets for x in ("--set", s)]]
    cmd = [sys.executable, "-m", "tandem.cli.main", *args]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["train/mismatch_tokens"] > 0
    assert row["train/mismatch_kl_k3"] == 0.0 and row["train/mismatch_abs_dlogp_max"] == 0.0
    if model == "moe":
        assert row["train/routes_recorded_frac"] > 0 and row["train/routing_agreement"] == 1.0


def _moe_dir(tmp_path: Path) -> str:
    from tandem.model.moe import write_model_dir

    return str(
        write_model_dir(tmp_path / "moe", "moe", tokenizer_dir=REPO / "models" / "tandem-base", seed=0)
    )
