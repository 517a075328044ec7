"""`tandem report samples`: sessions written the way a run writes them (MetricsLogger.log_samples over
sample_rows of real trajectory records) read back as text or JSON; bad input exits 2 and names the file."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tandem.cli.report import app  # mounted as `tandem report`
from tandem.core.records import Group, Message, Reward, SegmentBuilder, Trajectory
from tandem.orchestrator.metrics import MetricsLogger
from tandem.orchestrator.samples import read_samples, sample_rows

runner = CliRunner()


def _traj(task: str, reward: float, truncated: bool, code: str) -> Trajectory:
    b = SegmentBuilder()
    b.add_context([1, 2, 3])
    b.add_sampled([4, 5, 6], [-0.5] * 3, [1] * 3)
    call = {"name": "write_file", "arguments": {"path": "solution.py", "content": code}}
    messages = [Message("user", f"Implement {task}"), Message("assistant", "", [call])]
    flags = {"truncated": truncated, "truncated_turns": truncated, "submitted": not truncated}
    return Trajectory(task, [b.build()], Reward(reward, {"pass_fraction": reward}), flags, {},
                      {"turns": 6 if truncated else 2}, messages, f"+{code}\n")  # fmt: skip


def _steps(logger: MetricsLogger, steps: range, tag: str = "") -> None:
    for step in steps:
        groups = [
            Group(
                f"t{step}a", [_traj(f"t{step}a", 1.0, False, f"ok{tag}"), _traj(f"t{step}a", 0.0, True, "x")]
            ),
            Group(
                f"t{step}b", [_traj(f"t{step}b", 0.0, True, f"bad{tag}"), _traj(f"t{step}b", 1.0, False, "y")]
            ),
        ]
        logger.log_samples(sample_rows(step, groups, 2))


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    logger = MetricsLogger(run)
    _steps(logger, range(1, 5))
    logger.close()
    return run


def test_the_last_sessions_are_shown_whole_and_filters_narrow_them(tmp_path):
    run = _run_dir(tmp_path)
    r = runner.invoke(app, ["samples", str(run), "--last", "1"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("=== step 4, group 1, session 0: t4b\nreward 0.0")
    assert "flags: truncated, truncated_turns; turns 6" in r.output
    assert (
        '-> write_file({"path": "solution.py", "content": "bad"})' in r.output
        and "--- diff\n+bad" in r.output
    )

    r = runner.invoke(app, ["samples", str(run), "--step", "2", "--json", "--last", "0"])
    rows = [json.loads(x) for x in r.output.splitlines()]
    assert [(x["step"], x["group"], x["task_id"]) for x in rows] == [(2, 0, "t2a"), (2, 1, "t2b")]

    r = runner.invoke(app, ["samples", str(run), "--truncated", "--json", "--last", "0"])
    assert [json.loads(x)["task_id"] for x in r.output.splitlines()] == ["t1b", "t2b", "t3b", "t4b"]
    r = runner.invoke(app, ["samples", str(run), "--max-reward", "0.5", "--step", "3", "--json"])
    assert [json.loads(x)["reward"] for x in r.output.splitlines()] == [0.0]
    r = runner.invoke(app, ["samples", str(run), "--step", "9"])
    assert r.exit_code == 0 and "no session matches (8 logged, steps 1-4)" in r.output


def test_a_resumed_run_replaces_the_steps_it_repeated(tmp_path):
    """A run stopped after step 4 and resumed from its step-2 checkpoint writes steps 3 and 4 again."""
    run = _run_dir(tmp_path)
    logger = MetricsLogger(run, append=True)
    _steps(logger, range(3, 6), tag="-resumed")
    logger.close()
    rows = read_samples(run)
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert [r["diff"] for r in rows if r["step"] >= 3 and r["group"] == 0] == ["+ok-resumed\n"] * 3
    # stopped after step 6 and resumed from the step-5 checkpoint: step 6 follows itself, told apart only by
    # its rows starting again at group 0, session 0, as every step's do
    logger = MetricsLogger(run, append=True)
    _steps(logger, range(6, 7), tag="-again")
    _steps(logger, range(6, 7), tag="-third")
    logger.close()
    assert [r["diff"] for r in read_samples(run) if r["step"] == 6 and r["group"] == 0] == ["+ok-third\n"]


def test_bad_input_exits_2_naming_the_file_or_option(tmp_path):
    r = runner.invoke(app, ["samples", str(tmp_path)])
    assert r.exit_code == 2 and "samples.jsonl does not exist" in r.output and "samples_per_step" in r.output
    run = _run_dir(tmp_path)
    path = run / "samples.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3] + ['{"step": 2, "gro'] + lines[3:]) + "\n")
    r = runner.invoke(app, ["samples", str(run)])
    assert r.exit_code == 2 and f"{path}:4: not JSON" in r.output and "remove that one" in r.output
    path.write_text("\n".join(lines) + '\n{"step": 5, "gro')  # torn last row of a killed run: skipped
    assert len(read_samples(run)) == 8
    path.write_text("\n".join(lines[:2] + ["[1, 2]"]) + "\n")
    r = runner.invoke(app, ["samples", str(run)])
    assert r.exit_code == 2 and f"{path}:3: not a session row" in r.output
    path.write_bytes(b'{"step": 1}\n\xff\xfe\n')
    r = runner.invoke(app, ["samples", str(run)])
    assert r.exit_code == 2 and "is not UTF-8" in r.output
    r = runner.invoke(app, ["samples", str(run), "--last", "-1"])
    assert r.exit_code == 2 and "--last -1 must be >= 0" in r.output
    r = runner.invoke(app, ["samples", str(run), "--max-reward", "nan"])
    assert r.exit_code == 2 and "--max-reward nan" in r.output
