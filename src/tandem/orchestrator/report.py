"""End-of-run report: ``report.md`` with PNG plots of reward, held-out pass@1, throughput, busy fractions,
staleness and sampler-vs-trainer mismatch (curves over steps, and a scatter of token probabilities from the
last steps), plus ``summary.json``.

Invariant: every number in the report is read from what the run wrote (metrics rows, eval JSON); nothing is
computed from assumptions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.core.config import RunConfig
    from tandem.orchestrator.run import RunResult


def _plot(path: Path, title: str, series: dict[str, tuple[list[float], list[float]]], ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label, marker="." if len(xs) < 60 else None)
    ax.set_title(title)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _bar(path: Path, title: str, labels: list[str], values: list[float], ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    bars = ax.bar(labels, values, color=["#888", "#2a7", "#27a", "#a72"][: len(labels)])
    for bar, v in zip(bars, values, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _scatter(path: Path, pairs: list[list[float]]) -> None:
    """Sampler vs trainer probability of sampled tokens, on linear and log axes, with the diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = [p[0] for p in pairs]
    pt = [p[1] for p in pairs]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.8))
    for ax, log in zip(axes, (False, True), strict=True):
        ax.scatter(ps, pt, s=3, alpha=0.35, linewidths=0)
        lo = max(min(min(ps), min(pt)), 1e-12) if log else 0.0
        ax.plot([lo, 1.0], [lo, 1.0], color="#a33", lw=0.8)
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel("sampler probability")
        ax.set_ylabel("trainer probability")
        ax.set_title(f"{len(pairs)} sampled tokens" + (" (log)" if log else ""))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(run_dir: Path, result: RunResult, cfg: RunConfig) -> Path:
    """Write plots, ``summary.json`` and ``report.md`` into ``run_dir``; returns the report path."""
    rows = result.history
    steps = [r["step"] for r in rows]
    plots: list[tuple[str, str]] = []
    if rows:
        _plot(
            run_dir / "reward.png",
            "training reward",
            {
                "reward_mean": (steps, [r["reward_mean"] for r in rows]),
                "pass_rate": (steps, [r["pass_rate"] for r in rows]),
            },
            "reward",
        )
        plots.append(("Reward", "reward.png"))
        _plot(
            run_dir / "throughput.png",
            "throughput",
            {"samples/s": (steps, [r["samples_per_s"] for r in rows])},
            "samples per second",
        )
        plots.append(("Throughput", "throughput.png"))
        _plot(
            run_dir / "busy.png",
            "busy fractions",
            {
                "trainer": (steps, [r["trainer_busy"] for r in rows]),
                "engine": (steps, [r.get("engine_busy", 0.0) for r in rows]),
            },
            "fraction of wall time",
        )
        plots.append(("Busy fractions", "busy.png"))
        keys = sorted(result.staleness_hist, key=int)
        _bar(
            run_dir / "staleness.png",
            "staleness of trained groups",
            keys,
            [float(result.staleness_hist[k]) for k in keys],
            "groups",
        )
        plots.append(("Staleness histogram (versions behind the trainer)", "staleness.png"))
        mis = {k: f"train/mismatch_{k}" for k in ("kl_k1", "kl_k3", "ratio_out_frac", "abs_dlogp_mean")}
        if all(v in rows[0] for v in mis.values()):
            _plot(
                run_dir / "mismatch_curves.png",
                "sampler vs trainer mismatch",
                {k: (steps, [r[v] for r in rows]) for k, v in mis.items()},
                "per sampled token",
            )
            plots.append(("Sampler vs trainer mismatch", "mismatch_curves.png"))
    if result.mismatch_pairs:
        _scatter(run_dir / "mismatch.png", result.mismatch_pairs)
        plots.append(("Sampler vs trainer token probability (last steps)", "mismatch.png"))
    if result.eval_before and result.eval_after:
        _bar(
            run_dir / "heldout.png",
            "held-out pass@1",
            ["before", "after"],
            [result.eval_before["pass@1"], result.eval_after["pass@1"]],
            "pass@1",
        )
        plots.append(("Held-out pass@1", "heldout.png"))

    cores = result.machine_busy_cores
    summary: dict[str, Any] = {
        "mode": cfg.orchestrator.mode,
        "engine": cfg.engine.kind,
        "steps": result.steps,
        "version": result.version,
        "wall_s": round(result.wall_s, 2),
        "samples": result.samples,
        "samples_per_s": round(result.samples_per_s, 4),
        "trainer_busy": round(result.trainer_busy, 4),
        "engine_busy": round(result.engine_busy, 4),
        "machine_busy_cores": None if cores is None else round(cores, 3),
        "staleness_hist": result.staleness_hist,
        "heldout_pass1_before": None if not result.eval_before else result.eval_before["pass@1"],
        "heldout_pass1_after": None if not result.eval_after else result.eval_after["pass@1"],
        "lost": result.lost,
        "restarted": result.restarted,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))

    lines = [
        f"# tandem run report ({cfg.orchestrator.mode})",
        "",
        f"- model: `{cfg.model.path}`, served by the `{cfg.engine.kind}` engine",
        f"- steps: {result.steps} (final version {result.version}), wall time {result.wall_s:.1f} s",
        f"- samples: {result.samples} ({result.samples_per_s:.2f}/s)",
        f"- trainer busy {result.trainer_busy:.2f}, engine busy {result.engine_busy:.2f}"
        + ("" if cores is None else f", machine cores busy {cores:.2f} of {os.cpu_count()}"),
        f"- staleness histogram: {json.dumps(result.staleness_hist)}",
        *(f"- lost during the run, which went on without it: {line}" for line in result.lost),
        *(f"- restarted during the run: {line}" for line in result.restarted),
    ]
    if cfg.orchestrator.samples_per_step:
        lines.append(
            f"- sessions to read: up to {cfg.orchestrator.samples_per_step} per step, whole, in "
            "`samples.jsonl` (orchestrator.samples_per_step; `tandem report samples RUN_DIR --truncated`)"
        )
    if rows:
        first, last = rows[: max(1, len(rows) // 5)], rows[-max(1, len(rows) // 5) :]
        avg = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        lines.append(
            f"- training reward: first fifth {avg(first, 'reward_mean'):.3f} -> "
            f"last fifth {avg(last, 'reward_mean'):.3f}"
        )
        if "train/mismatch_kl_k3" in rows[-1]:
            lines.append(
                f"- sampler vs trainer mismatch, last fifth: KL k3 {avg(last, 'train/mismatch_kl_k3'):.3g}, "
                f"k1 {avg(last, 'train/mismatch_kl_k1'):.3g}, max |dlogp| "
                f"{max(r['train/mismatch_abs_dlogp_max'] for r in last):.3g}, ratio outside [0.5, 2] "
                f"{avg(last, 'train/mismatch_ratio_out_frac'):.3g}, "
                f"IS ESS {avg(last, 'train/mismatch_ess'):.4f}"
                + ("" if result.mismatch_pairs else " (no token was trained in the last steps: no scatter)")
            )
        same = [r for r in last if r.get("train/mismatch_same_version_tokens", 0) > 0]
        if same:  # the same-version share: numerics alone, without the policy's move since sampling
            n_same = sum(r["train/mismatch_same_version_tokens"] for r in same)
            kl_same = sum(
                r["train/mismatch_kl_k3_same_version"] * r["train/mismatch_same_version_tokens"] for r in same
            )
            lines.append(
                f"- of which tokens sampled by the trainer's own version (numerics alone, {int(n_same)} "
                f"tokens): KL k3 {kl_same / n_same:.3g}, max |dlogp| "
                f"{max(r['train/mismatch_abs_dlogp_max_same_version'] for r in same):.3g}"
            )
        elif any("train/mismatch_same_version_tokens" in r for r in last):
            lines.append(
                "- of which tokens sampled by the trainer's own version (numerics alone): none in the last "
                "fifth, every trained token was sampled by an older version (staleness histogram above)"
            )
        if "train/entropy" in rows[-1]:
            lines.append(
                f"- policy entropy per sampled token: first fifth {avg(first, 'train/entropy'):.3g} -> "
                f"last fifth {avg(last, 'train/entropy'):.3g}"
            )
        if "truncated_frac" in rows[-1]:
            masked = sum(r.get("train/truncated_masked_samples", 0) for r in rows)
            lines.append(
                "- truncated sessions (turn, token or time limit): first fifth "
                f"{avg(first, 'truncated_frac'):.3g} -> last fifth {avg(last, 'truncated_frac'):.3g}"
                + (
                    f"; {int(masked)} kept out of the loss (train.mask_truncated)"
                    if cfg.train.mask_truncated
                    else ""
                )
            )
            if all("truncated_turns_frac" in r for r in first + last):  # which limit (tandem.env.harness)
                causes = {
                    "turn limit (tasks.max_turns)": "truncated_turns_frac",
                    "token budget (tasks.max_tokens)": "truncated_tokens_frac",
                    "a turn cut at rollout.max_new_tokens": "truncated_turn_cut_frac",
                    "time limit (tasks.wall_time_s)": "truncated_time_frac",
                }
                lines.append(
                    "- of all sessions, truncated by each limit (first fifth -> last fifth): "
                    + ", ".join(
                        f"{name} {avg(first, k):.3g} -> {avg(last, k):.3g}" for name, k in causes.items()
                    )
                )
        routed = [r for r in last if "train/routing_agreement" in r]
        if routed:  # MoE: see tandem.train.routing
            lines.append(
                f"- MoE routing agreement (trainer top-k expert set = sampler's), last fifth: "
                f"{avg(routed, 'train/routing_agreement'):.4f}; routes recorded for "
                f"{avg(routed, 'train/routes_recorded_frac'):.3f} of forwarded tokens"
            )
    if result.eval_before and result.eval_after:
        b, a = result.eval_before["pass@1"], result.eval_after["pass@1"]
        lines.append(
            f"- held-out pass@1: before {b:.3f} -> after {a:.3f} ({a - b:+.3f}) on {result.eval_after['n']} "
            f"tasks x {result.eval_after['samples_per_task']} samples"
        )
    lines.append("")
    for title, png in plots:
        lines += [f"## {title}", "", f"![{title}]({png})", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
