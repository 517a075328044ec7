"""`report.md` from step rows as `tandem train` logs them: what it says about the mismatch and truncation."""

from tandem.core.config import RunConfig
from tandem.orchestrator.report import write_report
from tandem.orchestrator.run import RunResult

OWN = "of which tokens sampled by the trainer's own version"


def _rows(same_version_tokens: list[int]) -> list[dict]:
    rows = []
    for i, same in enumerate(same_version_tokens):
        rows.append(
            {
                "step": i + 1, "version": i + 1, "reward_mean": 0.5, "pass_rate": 0.5, "samples_per_s": 2.0,
                "trainer_busy": 0.8, "engine_busy": 0.9, "elapsed_s": 10.0 * (i + 1),
                "train/mismatch_kl_k3": 1e-5, "train/mismatch_kl_k1": 1e-5,
                "train/mismatch_abs_dlogp_max": 0.1,
                "train/mismatch_ratio_out_frac": 0.0, "train/mismatch_ess": 1.0, "train/mismatch_tokens": 100,
                "train/mismatch_same_version_tokens": same, "train/mismatch_kl_k3_same_version": 2e-8,
                "train/mismatch_abs_dlogp_max_same_version": 0.01, "truncated_frac": 0.25,
                "truncated_turns_frac": 0.25, "truncated_tokens_frac": 0.0, "truncated_turn_cut_frac": 0.0,
                "truncated_time_frac": 0.0,
            }
        )  # fmt: skip
    return rows


def _report(tmp_path, rows) -> str:
    result = RunResult(len(rows), len(rows), 50.0, 100, 0.8, 0.9, {"1": 3}, history=rows)
    return write_report(tmp_path, result, RunConfig()).read_text()


def test_the_report_says_so_when_no_trained_token_was_sampled_by_the_trainers_own_version(tmp_path):
    """On vLLM async runs nearly every token is one or two versions stale: the same-version line used to
    vanish from the report without a word; now it says none were."""
    text = _report(tmp_path, _rows([40, 0, 0, 0, 0]))
    assert f"{OWN} (numerics alone): none in the last fifth" in text
    text = _report(tmp_path, _rows([40, 0, 0, 0, 12]))
    assert f"{OWN} (numerics alone, 12 tokens): KL k3 2e-08" in text and "none in the last fifth" not in text


def test_the_report_names_the_limit_that_truncated_sessions(tmp_path):
    text = _report(tmp_path, _rows([1] * 5))
    assert (
        "truncated by each limit (first fifth -> last fifth): turn limit (tasks.max_turns) 0.25 -> 0.25"
        in text
    )
    assert "token budget (tasks.max_tokens) 0 -> 0" in text
    old = [{k: v for k, v in r.items() if not k.startswith("truncated_t")} for r in _rows([1] * 5)]
    assert "truncated by each limit" not in _report(tmp_path, old)  # rows from before the causes were logged
