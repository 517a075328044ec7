"""`tandem report compare`: two run directories written the way a run writes them (tandem's MetricsLogger,
config.toml from dump_config, eval JSON) side by side; bad input exits 2, names the file, writes nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from tandem.cli.report import app  # mounted as `tandem report` (tandem.cli.main imports in ~9 s)
from tandem.core.config import dump_config, load_config
from tandem.orchestrator.metrics import MetricsLogger

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]

# 8 steps per run; the last quarter is steps 7 and 8.
REWARDS = {"off": [0.0, 0.1, 0.1, 0.2, 0.2, 0.3, 0.4, 0.6], "r3": [0.0, 0.1, 0.2, 0.2, 0.3, 0.3, 0.5, 0.7]}
KL = {"off": [4e-6] * 4 + [6e-6] * 4, "r3": [1e-7] * 4 + [3e-7] * 4}
AGREE = {"off": [0.99] * 8, "r3": [0.995] * 4 + [0.997] * 4}


def _write_run(run_dir: Path, replay: str, evals: bool = True) -> Path:
    run_dir.mkdir(parents=True)
    # A model path that does not exist: the config check cannot tell it is not an MoE (nothing is loaded).
    sets = ["model.path=absent/tandem-moe", f"train.router_replay={replay}", "train.epochs=2"]
    cfg = load_config(REPO / "configs" / "smoke.toml", sets)
    (run_dir / "config.toml").write_text(dump_config(cfg))
    logger = MetricsLogger(run_dir)
    for i in range(8):
        logger.log(
            {
                "step": i + 1,
                "reward_mean": REWARDS[replay][i],
                "train/mismatch_kl_k3": KL[replay][i],
                "train/mismatch_abs_dlogp_max": 0.01 * (i + 1),
                "train/routing_agreement": AGREE[replay][i],
                "train/routing_used_agreement": 1.0 if replay == "r3" else AGREE[replay][i],
                "train/clip_frac": 0.01,
                "train/grad_norm": 0.5,
                "train/entropy": 1.2 - 0.01 * i,
            }
        )
    logger.close()
    if evals:
        (run_dir / "eval_before.json").write_text(json.dumps({"pass@1": 0.125, "n": 4}))
        (run_dir / "eval_after.json").write_text(json.dumps({"pass@1": 0.25 if replay == "r3" else 0.0}))
    return run_dir


def _table_row(md: str, label: str) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_compare_two_runs(tmp_path: Path) -> None:
    off = _write_run(tmp_path / "off", "off")
    r3 = _write_run(tmp_path / "r3", "r3", evals=False)
    out = tmp_path / "cmp"
    res = runner.invoke(app, ["compare", str(off), str(r3), "--out", str(out)])
    assert res.exit_code == 0, res.output
    md = (out / "compare.md").read_text()
    pngs = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert "reward_mean.png" in pngs and "mismatch_kl_k3.png" in pngs and "routing_agreement.png" in pngs
    assert len(pngs) == 9 and pngs[0] == "overview.png"  # all panels, then one per metric
    for png in pngs:
        assert (out / png).stat().st_size > 1000
    # Default labels: the field that differs (router_replay), both in the table and the differences list.
    # columns: label, dir, steps, reward last / first quarter, KL k3, max dlogp, agreement, used,
    # pass@1 before, after
    row_off, row_r3 = _table_row(md, "router_replay=off"), _table_row(md, "router_replay=r3")
    assert row_off[2] == row_r3[2] == "8"
    assert row_off[3] == "0.5" and row_r3[3] == "0.6"  # (0.4 + 0.6) / 2, (0.5 + 0.7) / 2
    assert row_off[4] == "0.05" and row_r3[4] == "0.05"  # (0.0 + 0.1) / 2
    assert row_off[5] == "5e-06" and row_r3[5] == "2e-07"
    assert row_off[6] == "0.045"  # mean of 0.01 .. 0.08
    assert row_off[7] == "0.99" and row_r3[7] == "0.996"
    assert row_off[8] == "0.99" and row_r3[8] == "1"
    assert row_off[9:] == ["0.125", "0"] and row_r3[9:] == ["-", "-"]
    assert "`train.router_replay`: router_replay=off: off | router_replay=r3: r3" in md
    data = json.loads((out / "compare.json").read_text())
    assert data["runs"]["router_replay=r3"]["reward_mean_last_quarter"] == 0.6
    assert list(data["config_differences"]) == ["train.router_replay"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".cmp.")]  # no temporary left behind


def test_labels_and_missing_metric(tmp_path: Path) -> None:
    a = _write_run(tmp_path / "a", "off")
    b = tmp_path / "b"
    b.mkdir()
    logger = MetricsLogger(b)
    logger.log({"step": 1, "reward_mean": 0.5})
    logger.close()
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # a file of the user's in --out
    res = runner.invoke(app, ["compare", str(a), str(b), "--out", str(out), "--label", "A", "--label", "B"])
    assert res.exit_code == 0, res.output
    md = (out / "compare.md").read_text()
    assert _table_row(md, "B")[2:6] == ["1", "0.5", "0.5", "-"]
    assert "(not logged by: B)" in md
    assert (out / "entropy.png").exists()
    # A failing comparison into the same directory writes and removes nothing.
    assert runner.invoke(app, ["compare", str(b), str(tmp_path / "absent"), "--out", str(out)]).exit_code == 2
    assert (out / "entropy.png").exists()
    # A comparison of runs that log only the reward: the earlier plots of other metrics are stale and go;
    # the user's file stays.
    c = tmp_path / "c"
    c.mkdir()
    logger = MetricsLogger(c)
    logger.log({"step": 1, "reward_mean": 0.25})
    logger.close()
    res = runner.invoke(app, ["compare", str(b), str(c), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == [
        "compare.json",
        "compare.md",
        "notes.txt",
        "overview.png",
        "reward_mean.png",
    ]


def _fails(args: list[str], *needles: str) -> str:
    res = runner.invoke(app, ["compare", *args])
    assert res.exit_code == 2, res.output
    for needle in needles:
        assert needle in res.output, res.output
    return res.output


def test_bad_inputs_exit_2_and_write_nothing(tmp_path: Path) -> None:
    good = _write_run(tmp_path / "good", "off")
    out = tmp_path / "cmp"
    _fails([str(good), "--out", str(out)], "at least 2 run directories")
    empty_dir = tmp_path / "nometrics"
    empty_dir.mkdir()
    _fails([str(good), str(empty_dir), "--out", str(out)], str(empty_dir / "metrics.jsonl"), "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("\n")
    _fails([str(good), str(empty), "--out", str(out)], str(empty / "metrics.jsonl"), "no step rows")
    cut = _write_run(tmp_path / "cut", "r3")
    with (cut / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "reward_me')
    _fails([str(good), str(cut), "--out", str(out)], f"{cut / 'metrics.jsonl'}, line 9", "not valid JSON")
    (cut / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n')
    _fails([str(good), str(cut), "--out", str(out)], "line 2", "integer 'step'")
    _fails([str(good), str(tmp_path / "absent"), "--out", str(out)], "is not a directory")
    _fails([str(good), str(good), "--out", str(out)], "passed twice")
    ok = _write_run(tmp_path / "ok", "r3")
    _fails([str(good), str(ok), "--out", str(out), "--label", "x"], "1 --label for 2 run directories")
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".cmp.")]


def _metrics_run(run_dir: Path, metrics: bytes | str, files: dict[str, bytes | str] | None = None) -> Path:
    """A run directory with the given raw ``metrics.jsonl`` and other files (name -> raw content)."""
    run_dir.mkdir()
    for name, content in {"metrics.jsonl": metrics, **(files or {})}.items():
        (run_dir / name).write_bytes(content.encode() if isinstance(content, str) else content)
    return run_dir


def test_unreadable_or_malformed_files_are_named_errors(tmp_path: Path) -> None:
    """Before, each of these was a traceback (UnicodeDecodeError, ValueError from the 4300-digit limit,
    OverflowError from float(), RecursionError, TypeError from a TOML date in compare.json)."""
    good = _write_run(tmp_path / "good", "off")
    out = tmp_path / "cmp"
    ok_row = '{"step": 1, "reward_mean": 0.5}\n'
    cases: list[tuple[str, bytes | str, dict[str, bytes | str], tuple[str, ...]]] = [
        ("latin1", ok_row.encode() + b'{"step": 2, "note": "caf\xe9"}\n', {}, ("line 2", "UTF-8")),
        ("digits", '{"step": 1, "reward_mean": ' + "9" * 5000 + "}\n", {}, ("line 1", "digits")),
        ("bigstep", '{"step": ' + "9" * 400 + "}\n", {}, ("line 1", "'step'")),
        ("bigvalue", '{"step": 1, "reward_mean": ' + "9" * 400 + "}\n", {}, ("line 1", "'reward_mean'")),
        ("deep", "[" * 100_000 + "\n", {}, ("line 1", "nested")),
        ("tomlbytes", ok_row, {"config.toml": b"x = '\xff'\n"}, ("config.toml", "UTF-8")),
        ("tomldigits", ok_row, {"config.toml": "x = " + "9" * 5000 + "\n"}, ("config.toml", "digits")),
        ("evalbytes", ok_row, {"eval_before.json": b"\xff\xfe"}, ("eval_before.json", "UTF-8")),
        ("evalshape", ok_row, {"eval_after.json": '{"pass@1": "high"}'}, ("eval_after.json", "pass@1")),
        ("evalrange", ok_row, {"eval_after.json": '{"pass@1": 1e999}'}, ("eval_after.json", "pass@1")),
        ("huge", ok_row + '{"step": 2, "reward_mean": 1.7e308}\n{"step": 3, "reward_mean": -1.7e308}\n', {},
         ("reward_mean", "cannot be plotted")),
    ]  # fmt: skip
    for name, metrics, files, needles in cases:
        bad = _metrics_run(tmp_path / name, metrics, files)
        where = bad / next(iter(files), "metrics.jsonl")
        _fails([str(good), str(bad), "--out", str(out)], str(where), *needles)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".cmp.")]


def test_odd_but_valid_inputs_compare(tmp_path: Path) -> None:
    """A TOML date in config.toml (compare.json could not be written) and a run directory whose name is
    matplotlib math (`$\\foo$`: the legend failed to render) are fine; booleans are not numbers."""
    good = _write_run(tmp_path / "good", "off")
    odd = _metrics_run(
        tmp_path / "$\\foo$",
        '{"step": 1, "reward_mean": true}\n{"step": 2, "reward_mean": 0.5}\n',
        {"config.toml": "[train]\nstarted = 2024-05-01\n"},
    )
    out = tmp_path / "cmp"
    res = runner.invoke(app, ["compare", str(good), str(odd), "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "compare.json").read_text())
    assert data["config_differences"]["train.started"][1] == "2024-05-01"
    assert data["runs"]["$\\foo$"]["reward_mean_first_quarter"] is None  # step 1 logged `true`: no reward


def test_unwritable_out_is_a_named_error_and_writes_nothing(tmp_path: Path) -> None:
    """Before: FileNotFoundError / PermissionError / FileExistsError tracebacks, and with a directory in the
    way of compare.md, compare.json and the plots were moved in before the IsADirectoryError."""
    a = _write_run(tmp_path / "a", "off")
    b = _write_run(tmp_path / "b", "r3")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out in ("/proc/tandem-no-such/cmp", "/sys/tandem-no-such", str(a_file / "cmp")):
        _fails([str(a), str(b), "--out", out], f"--out {out}", "writable directory")
    blocked = tmp_path / "blocked"
    (blocked / "compare.md").mkdir(parents=True)
    _fails([str(a), str(b), "--out", str(blocked)], str(blocked / "compare.md"), "is a directory")
    assert sorted(p.name for p in blocked.iterdir()) == ["compare.md"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_label_with_a_pipe_stays_in_its_cell(tmp_path: Path) -> None:
    """Before: `--label 'lr|0.1'` split its table row into one cell too many (every column shifted)."""
    a, b = _write_run(tmp_path / "a|x", "off"), _write_run(tmp_path / "b", "r3")
    out = tmp_path / "cmp"
    res = runner.invoke(
        app, ["compare", str(a), str(b), "--out", str(out), "--label", "lr|0.1", "--label", "B"]
    )
    assert res.exit_code == 0, res.output
    md = (out / "compare.md").read_text()
    rows = [x for x in md.splitlines() if x.startswith("| ")]
    cells = [len(re.split(r"(?<!\\)\|", row.strip().strip("|"))) for row in rows]
    assert len(rows) == 3 and len(set(cells)) == 1, rows  # header, "lr|0.1", "B": the same column count
    assert rows[1].startswith("| lr\\|0.1 | `") and "a\\|x`" in rows[1]
    assert "lr\\|0.1: " in md  # the config differences name it escaped too
