"""`tandem bench NAME` refuses out-of-range options up front, through the real CLI: exit status 2 and one
`error: ...` line naming the option and its value, never a traceback, a segfault, a full disk or a run that
cannot finish. Every value here would crash, hang or fill the machine without the check, so each refusal
must come before the benchmark builds anything (a generous subprocess timeout is the only guard)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HUGE = str(10**20)


def bench(name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "bench", name, *args],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )  # fmt: skip


def assert_refused(r: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, one short `error:` line on stderr holding every needle, no traceback; returns the line."""
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert len(lines[0]) < 400, lines[0]
    return lines[0]


# ---- 1. thread counts (0: a torch traceback; 100000: a segfault) ------------------------------------------


@pytest.mark.parametrize("name", ["prefix", "gateway", "engine", "mismatch", "codec"])
@pytest.mark.parametrize("value", ["0", "100000"])
def test_thread_counts_outside_one_to_a_few_per_cpu_are_refused(name, value):
    extra = ["--workload", "synthetic_1gb"] if name == "codec" else []
    line = assert_refused(bench(name, "--threads", value, *extra), "--threads", value)
    if value != "0":
        from tandem.bench import limits

        assert f"{limits.THREADS_PER_CPU * (os.cpu_count() or 1)}" in line  # the bound is stated


@pytest.mark.parametrize(
    ("name", "args", "flag"),
    [
        ("engine", ["--repeats", HUGE], "--repeats"),
        ("gateway", ["--repeats", HUGE], "--repeats"),
        ("mismatch", ["--repeats", HUGE], "--repeats"),
        ("codec", ["--repeats", HUGE, "--workload", "synthetic_1gb"], "--repeats"),
        ("gateway", ["--sessions", "100000", "--client-procs", "100000"], "--client-procs"),
        ("sync", ["--engines", "100000"], "--engines"),
        ("sync", ["--relays", "100000"], "--relays"),
        ("sandbox", ["--concurrency", "100000"], "--concurrency"),
        ("sandbox", ["--n", HUGE], "--n"),
        ("sandbox", ["--pool-size", HUGE], "--pool-size"),
    ],
)
def test_huge_counts_of_rounds_processes_and_sandboxes_are_refused(name, args, flag):
    assert_refused(bench(name, *args), flag)


def test_a_value_of_thousands_of_digits_is_abbreviated_in_the_message():
    huge = "-" + "9" * 4000
    line = assert_refused(bench("prefix", "--sessions", huge), "--sessions", "(4000 digits)")
    assert "9" * 30 not in line


# ---- 2. --big-mb against the free space where the workspaces are written -----------------------------------


def test_sandbox_big_mb_beyond_the_free_disk_is_refused_naming_needed_and_free_bytes(tmp_path):
    big = str(2**40)  # 1 EiB of workspace
    r = bench("sandbox", "--big-mb", big, env={"TMPDIR": str(tmp_path)})
    line = assert_refused(r, "--big-mb", "bytes", "free", str(tmp_path))
    needed = int(re.search(r"needs (\d+) bytes", line).group(1))
    assert needed >= 3 * 2**40 * 2**20  # the workspace, its layer (or copies) and a copy-mode clone
    assert not list(tmp_path.iterdir())  # nothing was written


# ---- 3. prompt lengths against the model's context -------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "flags", "limit"),
    [
        ("engine", ["--sizes", "smoke", "--prompt-len", "250", "--new-tokens", "9"], ["--prompt-len"], "256"),
        ("engine", ["--model", "models/tandem-base", "--prompt-len", "1000"], ["--prompt-len"], "1024"),
        ("mismatch", ["--prompt-len", "999", "--new-tokens", "64"], ["--prompt-len", "--new-tokens"], "1024"),
        ("prefix", ["--turns", "20"], ["--turns"], "1024"),
        ("gateway", ["--turns", "40"], ["--turns", "--max-tokens"], "1024"),
        ("gateway", ["--max-tokens", "2000", "--turns", "1"], ["--max-tokens"], "1024"),
    ],
)
def test_sequences_longer_than_the_model_context_are_refused(name, args, flags, limit):
    assert_refused(bench(name, *args), *flags, limit)


# ---- 4. seeds ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [str(10**30), "-1", "9" * 4000])
def test_mismatch_seed_outside_0_to_2_pow_63_is_refused_in_one_short_line(value):
    assert_refused(bench("mismatch", "--seed", value), "--seed", str(2**63 - 1))


# ---- the sweep: memory, paths, learning rates --------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "flag"),
    [
        ("engine", ["--sizes", "smoke", "--batch", str(10**9)], "--batch"),
        ("prefix", ["--sessions", str(10**9)], "--sessions"),
        ("gateway", ["--sessions", str(10**9)], "--sessions"),
        ("mismatch", ["--prompts", str(10**9)], "--prompts"),
        ("codec", ["--size-gb", "1e12", "--workload", "synthetic_1gb"], "--size-gb"),
        ("codec", ["--steps", str(10**9), "--workload", "tandem_train"], "--steps"),
        ("sync", ["--deltas", str(10**9), "--size", "default"], "--deltas"),
    ],
)
def test_sizes_whose_memory_no_machine_has_are_refused(name, args, flag):
    assert_refused(bench(name, *args), flag, "GiB")


def test_sync_refuses_a_bad_learning_rate_by_name_and_leaves_no_temp_dirs(tmp_path):
    for value, shown in (("nan", "nan"), ("-1", "-1"), ("inf", "inf"), ("1e300", "1e+300")):
        r = bench("sync", "--size", "default", "--lr", value, env={"TMPDIR": str(tmp_path)})
        assert_refused(r, "--lr", shown)
    assert not list(tmp_path.iterdir())


def test_codec_refuses_a_learning_rate_above_one_and_a_size_below_one_parameter():
    """--train-lr 1e300 overflowed float32 in torch's AdamW step (a traceback after the model loaded);
    --size-gb 1e-300 built no parameter and the optimizer's own error named no option."""
    r = bench("codec", "--train-lr", "1e300", "--workload", "tandem_train")
    assert_refused(r, "--train-lr", "1e+300")
    r = bench("codec", "--size-gb", "1e-300", "--workload", "synthetic_1gb")
    assert_refused(r, "--size-gb", "1e-300")


@pytest.mark.parametrize("value", ["1e-300", "1e305"])
def test_sync_refuses_a_bandwidth_that_never_finishes_or_no_longer_throttles(value):
    assert_refused(bench("sync", "--size", "default", "--bandwidth-mbps", value), "--bandwidth-mbps")


def test_pipeline_refuses_a_run_root_that_is_a_file(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    assert_refused(bench("pipeline", "--preset", "smoke", "--run-root", str(f)), "--run-root", str(f))


@pytest.mark.parametrize("name", ["prefix", "gateway", "codec", "sync", "mismatch", "engine"])
def test_a_missing_model_directory_is_refused_naming_the_model_option(name):
    assert_refused(bench(name, "--model", "/no/such/model"), "/no/such/model", "--model")


# ---- the estimates the checks rest on ----------------------------------------------------------------------


@pytest.mark.parametrize("size", ["smoke", "default"])
def test_dense_param_estimate_matches_the_built_model(size):
    from tandem.bench import limits
    from tandem.model import build_model, num_params, qwen3_config

    cfg = qwen3_config(size, vocab_size=4096)
    assert limits.dense_params(cfg.to_dict(), 4096) == num_params(build_model(cfg))


def test_params_on_disk_of_the_shipped_model_match_its_weights():
    from transformers import AutoModelForCausalLM

    from tandem.bench import limits
    from tandem.model import num_params

    path = REPO / "models" / "tandem-base"
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert limits.params_on_disk(path) == num_params(model)
