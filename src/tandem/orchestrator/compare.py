"""Side-by-side report of finished runs (``tandem report compare RUN_DIR RUN_DIR ... --out DIR``):
``compare.md`` with one PNG per metric (x = trainer step, one curve per run in the same panel) and all of
them in ``overview.png``, a per-run summary table, the config fields that differ between the runs, and
``compare.json`` with the same numbers.

Invariants:
- every number is read from what the runs wrote (``metrics.jsonl``, ``config.toml``, ``eval_before.json``,
  ``eval_after.json``); nothing is assumed. A step logged twice (a resumed run) counts once, its last row.
- every input is read and checked before anything is written: bad input raises ``CompareError`` naming the
  file (and line) and what to do, and leaves ``--out`` untouched. Outputs are rendered in a temporary
  directory next to ``--out`` and moved in afterwards, ``compare.md`` last, so it never names a missing PNG.
  Reading is ``tandem.orchestrator.compare_inputs``. An ``--out`` that cannot be written (under ``/proc``, a
  file, a read-only place), or a metric matplotlib cannot plot, is a ``CompareError`` too, raised before
  anything is moved into ``--out``; directories made for ``--out`` are removed again.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.orchestrator.compare_inputs import CompareError, RunData, is_number, load_run
from tandem.orchestrator.report import _plot

__all__ = ["CompareError", "RunData", "compare_runs", "load_run"]

# (metric key in metrics.jsonl, panel title, y label); panels whose key no run logged are left out.
PANELS: tuple[tuple[str, str, str], ...] = (
    ("reward_mean", "training reward (mean over the step's samples)", "reward"),
    ("train/mismatch_kl_k3", "sampler vs trainer KL (k3)", "per sampled token"),
    ("train/mismatch_abs_dlogp_max", "sampler vs trainer max |dlogp|", "nats"),
    ("train/routing_agreement", "MoE routing agreement (trainer's own router)", "share of token-layers"),
    ("train/routing_used_agreement", "MoE routing agreement (experts used, replay included)", "share"),
    ("train/clip_frac", "PPO clip fraction", "share of tokens"),
    ("train/grad_norm", "gradient norm (before clipping)", "L2 norm"),
    ("train/entropy", "policy entropy", "nats per token"),
)
# Config fields that name a run when no --label is given, in order of preference.
LABEL_FIELDS: tuple[tuple[str, str], ...] = (("train.router_replay", "off"), ("orchestrator.mode", "async"))


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}`` (one level of sections, as ``dump_config`` writes)."""
    out: dict[str, Any] = {}
    for section, values in config.items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items()})
        else:
            out[section] = values
    return out


def config_differences(runs: list[RunData]) -> dict[str, list[Any]]:
    """Config fields whose values are not all equal, with each run's value (None where a run lacks it)."""
    flat = [_flatten(r.config) for r in runs]
    keys = sorted(set().union(*flat))
    # default=str: TOML dates and times are not JSON values; their text tells them apart
    differ = [k for k in keys if len({json.dumps(f.get(k), default=str) for f in flat}) > 1]
    return {k: [f.get(k) for f in flat] for k in differ}


def default_labels(runs: list[RunData]) -> list[str]:
    """Name runs by ``train.router_replay`` and/or ``orchestrator.mode`` where those differ, else (or when
    that leaves two runs with one name) add the directory name, then the whole path."""
    flat = [_flatten(r.config) for r in runs]
    parts: list[list[str]] = [[] for _ in runs]
    for key, default in LABEL_FIELDS:
        values = [str(f.get(key, default)) for f in flat]
        if len(set(values)) > 1:
            short = key.split(".")[-1]
            for p, v in zip(parts, values, strict=True):
                p.append(f"{short}={v}")
    labels = [" ".join(p) for p in parts]
    if len(set(labels)) < len(labels) or not all(labels):
        labels = [
            f"{lab} ({r.path.name})" if lab else r.path.name for lab, r in zip(labels, runs, strict=True)
        ]
    if len(set(labels)) < len(labels):
        labels = [str(r.path) for r in runs]
    return labels


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if is_number(v) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _column(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if is_number(r.get(key))]


def summarize(run: RunData) -> dict[str, Any]:
    """The numbers of the summary table: steps, reward over the last quarter of the steps (at least one),
    mean mismatch and routing metrics over all steps that logged them, held-out pass@1 before/after."""
    rows = run.rows
    last = rows[-max(1, len(rows) // 4) :]
    return {
        "run_dir": str(run.path),
        "steps": len(rows),
        "last_step": rows[-1]["step"],
        "reward_mean_last_quarter": _mean(_column(last, "reward_mean")),
        "reward_mean_first_quarter": _mean(_column(rows[: max(1, len(rows) // 4)], "reward_mean")),
        "mismatch_kl_k3_mean": _mean(_column(rows, "train/mismatch_kl_k3")),
        "mismatch_abs_dlogp_max_mean": _mean(_column(rows, "train/mismatch_abs_dlogp_max")),
        "routing_agreement_mean": _mean(_column(rows, "train/routing_agreement")),
        "routing_used_agreement_mean": _mean(_column(rows, "train/routing_used_agreement")),
        "heldout_pass1_before": None if run.eval_before is None else run.eval_before.get("pass@1"),
        "heldout_pass1_after": None if run.eval_after is None else run.eval_after.get("pass@1"),
    }


def fmt(value: Any) -> str:
    """A table cell: ``-`` for a missing number, else four significant digits."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _slug(key: str) -> str:
    return key.replace("train/", "").replace("/", "_")


Series = dict[str, tuple[list[float], list[float]]]


def _grid(path: Path, panels: list[tuple[str, Series]]) -> None:
    """Every panel in one figure, two per row, the same colour for a run in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(11, 2.8 * rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels, strict=False):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, label=label, marker="." if len(xs) < 60 else None)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("trainer step")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _literal(label: str) -> str:
    """``label`` as matplotlib shows it verbatim (``$`` starts math text, which can fail to parse)."""
    return label.replace("$", r"\$")


def _plotted(key: str, runs: list[RunData], draw: Callable[..., None], *args: Any) -> None:
    """``draw(*args)``; a value matplotlib cannot place (e.g. 1.7e308 and -1.7e308 in one panel) is a
    ``CompareError`` naming the metric and the files it came from."""
    try:
        with warnings.catch_warnings():  # numpy's overflow warnings: the error below says it once, clearly
            warnings.simplefilter("ignore", RuntimeWarning)
            draw(*args)
    except (ValueError, OverflowError) as e:
        files = ", ".join(str(r.path / "metrics.jsonl") for r in runs)
        raise CompareError(
            f"metric {key!r} cannot be plotted ({e}); check its values in {files} (delete or repair rows "
            "with out-of-range numbers)"
        ) from e


def _plot_names() -> set[str]:
    """Every PNG name a comparison can write (``overview.png`` and one per metric of ``PANELS``)."""
    return {"overview.png", *(f"{_slug(key)}.png" for key, _, _ in PANELS)}


def _plots(runs: list[RunData], labels: list[str], out: Path) -> list[str]:
    """One PNG per metric of ``PANELS`` that some run logged, and ``overview.png`` with all of them;
    returns the markdown sections (the overview first)."""
    sections: list[str] = []
    panels: list[tuple[str, Series]] = []
    for key, title, ylabel in PANELS:
        series = {
            lab: (
                [float(r["step"]) for r in run.rows if is_number(r.get(key))],
                _column(run.rows, key),
            )
            for lab, run in zip(labels, runs, strict=True)
        }
        present = {lab: s for lab, s in series.items() if s[0]}
        if not present:
            continue
        png = f"{_slug(key)}.png"
        legend = {_literal(lab): s for lab, s in present.items()}
        _plotted(key, runs, _plot, out / png, title, legend, ylabel)
        panels.append((title, legend))
        missing = [lab for lab in labels if lab not in present]
        note = f" (not logged by: {', '.join(missing)})" if missing else ""
        sections += [f"## {title} (`{key}`){note}", "", f"![{title}]({png})", ""]
    if not panels:
        return []
    _plotted("overview", runs, _grid, out / "overview.png", panels)
    return ["## All metrics", "", "![all metrics, one curve per run](overview.png)", "", *sections]


COLUMNS: tuple[tuple[str, str], ...] = (
    ("steps", "steps"),
    ("reward, last quarter", "reward_mean_last_quarter"),
    ("reward, first quarter", "reward_mean_first_quarter"),
    ("mean KL k3", "mismatch_kl_k3_mean"),
    ("mean max abs dlogp", "mismatch_abs_dlogp_max_mean"),
    ("mean routing agreement", "routing_agreement_mean"),
    ("mean routing agreement (used)", "routing_used_agreement_mean"),
    ("held-out pass@1 before", "heldout_pass1_before"),
    ("held-out pass@1 after", "heldout_pass1_after"),
)


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: ``|`` escaped (GFM honours ``\\|`` in code spans too), line breaks
    as spaces, so a label or directory name cannot split or end the row."""
    return " ".join(text.replace("|", "\\|").splitlines())


def _table(labels: list[str], summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| run | run dir | " + " | ".join(c for c, _ in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    for lab, s in zip(labels, summaries, strict=True):
        cells = [_cell(lab), f"`{_cell(str(s['run_dir']))}`", *(fmt(s[k]) for _, k in COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [
        "",
        "Reward columns average `reward_mean` over the first / last quarter of each run's steps (at least "
        "one step); the other means are over every step that logged the metric.",
        "",
    ]


def _differences(labels: list[str], diffs: dict[str, list[Any]]) -> list[str]:
    if not diffs:
        return ["The runs' config.toml files are identical (or absent).", ""]
    lines = ["Config fields that differ:", ""]
    for k, vs in diffs.items():
        lines.append(
            f"- `{k}`: " + " | ".join(f"{_cell(lab)}: {fmt(v)}" for lab, v in zip(labels, vs, strict=True))
        )
    return lines + [""]


def _render(runs: list[RunData], labels: list[str], out: Path) -> None:
    """Write PNGs, ``compare.json`` and ``compare.md`` into ``out`` (an empty directory)."""
    summaries = [summarize(r) for r in runs]
    diffs = config_differences(runs)
    (out / "compare.json").write_text(
        json.dumps(
            {"runs": dict(zip(labels, summaries, strict=True)), "config_differences": diffs},
            indent=2,
            default=str,  # TOML dates and times
        )
    )
    lines = [f"# tandem run comparison ({len(runs)} runs)", ""]
    lines += _table(labels, summaries) + _differences(labels, diffs) + _plots(runs, labels, out)
    (out / "compare.md").write_text("\n".join(lines))


def compare_runs(run_dirs: list[Path], out: Path, labels: list[str] | None = None) -> Path:
    """Read every run, then write the comparison into ``out``; returns the path of ``compare.md``."""
    if len(run_dirs) < 2:
        raise CompareError(f"compare needs at least 2 run directories, got {len(run_dirs)}; pass two or more")
    resolved = [p.resolve() for p in run_dirs]
    if len(set(resolved)) < len(resolved):
        raise CompareError("the same run directory was passed twice; pass distinct run directories")
    if labels and len(labels) != len(run_dirs):
        raise CompareError(
            f"got {len(labels)} --label for {len(run_dirs)} run directories; pass one --label per run or none"
        )
    if labels and len(set(labels)) < len(labels):
        raise CompareError(f"--label values must be distinct, got {labels}")
    _check_out(out)
    runs = [load_run(p) for p in run_dirs]
    names = list(labels) if labels else default_labels(runs)
    made: list[Path] = []
    try:
        _make_dirs(out.parent, made)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            _render(runs, names, tmp)
            if not out.is_dir():
                _make_dirs(out, made)
            _move_in(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        _remove_dirs(made)
        where = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
        raise CompareError(f"--out {out}: cannot write there ({where}); pass a writable directory") from e
    except CompareError:
        _remove_dirs(made)
        raise
    return out / "compare.md"


def _check_out(out: Path) -> None:
    """``--out`` is (or can become) a directory and no file the comparison writes there would replace a
    directory (a failed move would leave some outputs moved in and others not)."""
    if out.exists() and not out.is_dir():
        raise CompareError(f"--out {out} exists and is not a directory; pass a directory")
    for name in sorted({"compare.md", "compare.json"} | _plot_names()):
        path = out / name
        if path.is_dir() and not path.is_symlink():
            raise CompareError(
                f"{path} is a directory and compare writes a file of that name; move it away or pass "
                "another --out"
            )


def _make_dirs(path: Path, made: list[Path]) -> None:
    """Create ``path`` and its missing parents, appending each directory created to ``made`` (so a failure
    later can remove them)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        d.mkdir()
        made.append(d)


def _remove_dirs(made: list[Path]) -> None:
    """Remove the directories ``_make_dirs`` created, deepest first, where they are still empty."""
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            pass


def _move_in(tmp: Path, out: Path) -> None:
    """Move the rendered files into ``out`` (``compare.md`` last) and delete stale plots of ours."""
    written = {f.name for f in tmp.iterdir()}
    for f in sorted(tmp.iterdir(), key=lambda p: p.name == "compare.md"):  # compare.md last
        os.replace(f, out / f.name)
    # Plots an earlier comparison into this directory wrote and this one did not (a metric no run of this
    # comparison logged): stale, so removed. Files of other names are not ours and are left alone.
    for name in _plot_names() - written:
        (out / name).unlink(missing_ok=True)
