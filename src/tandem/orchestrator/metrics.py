"""Run observability: ``metrics.jsonl`` (one JSON object per trainer step), ``samples.jsonl`` (a few of each
step's sessions, whole), TensorBoard events, progress line.

Invariants: every logged row is flushed before ``log`` (``log_samples``) returns, so a crashed run keeps
every finished step; metrics rows contain only JSON scalars. A sample row is one trained session as the
trainer got it: its task, the version that sampled its oldest token, reward and components, flags, tool
statistics, timings, the conversation's messages and the agent's diff (no token arrays: those are in the
trajectory record, ``tandem.core.records``). A resumed run appends to both files, so a step repeated after
a resume appears twice, and its later rows are the ones the run kept (``tandem report compare`` reads
metrics that way).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Appends step rows to ``run_dir/metrics.jsonl`` (and sessions to ``run_dir/samples.jsonl``) and mirrors
    numeric values to TensorBoard."""

    def __init__(self, run_dir: Path, append: bool = False) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self._file = self.path.open("a" if append else "w")
        self._samples = self.samples_path.open("a" if append else "w")
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except Exception as e:  # noqa: BLE001 - TensorBoard is optional at run time
            print(f"warning: TensorBoard events disabled ({e})", file=sys.stderr)

    def log(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, row["step"])
            self._tb.flush()

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._samples.write(json.dumps(row) + "\n")
        self._samples.flush()

    def close(self) -> None:
        self._file.close()
        self._samples.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class ProgressLine:
    """One line per step: step, version, reward, samples/s, staleness, busy fractions. Written to stderr, so
    a command's stdout carries only its results (``tandem bench pipeline --json`` prints one JSON object
    there while the runs' progress stays visible)."""

    def __init__(self, total_steps: int, quiet: bool = False) -> None:
        self.total = total_steps
        self.quiet = quiet
        self.t0 = time.monotonic()

    def note(self, text: str) -> None:
        if not self.quiet:
            print(f"[tandem {time.monotonic() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def update(self, row: dict[str, Any]) -> None:
        if self.quiet:
            return
        print(
            f"[tandem {row['elapsed_s']:6.1f}s] step {row['step']}/{self.total} v{row['version']} "
            f"reward {row['reward_mean']:.3f} pass {row['pass_rate']:.2f} "
            f"samples/s {row['samples_per_s']:.2f} staleness<={row['staleness_max']} "
            f"trainer_busy {row['trainer_busy']:.2f} engine_busy {row.get('engine_busy', 0):.2f}",
            file=sys.stderr,
            flush=True,
        )
