"""`tandem bench NAME` refuses a bad option before it imports torch, transformers or Ray: the check runs from
`tandem.bench.preflight` before the benchmark's module is imported (which took 3-7 s of a refusal)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "ray", "vllm")

# Runs the real CLI in a fresh interpreter, then prints the exit status and which heavy modules it imported.
PROBE = f"""
import json, runpy, sys
sys.argv = ["tandem", *sys.argv[1:]]
try:
    runpy.run_module("tandem.cli.main", run_name="__main__")
except SystemExit as e:
    status = e.code
print("STATUS", status, "HEAVY", json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)
"""


def refuse(*args: str) -> tuple[str, list[str]]:
    """The one `error:` line and the heavy modules imported by `tandem bench ARGS`, which must exit 2."""
    r = subprocess.run(
        [sys.executable, "-c", PROBE, "bench", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    status_line = [x for x in r.stderr.splitlines() if x.startswith("STATUS ")]
    assert status_line, r.stderr[-2000:]
    _, status, _, heavy = status_line[-1].split(" ", 3)
    assert status == "2", r.stderr[-2000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1, r.stderr[-2000:]
    return errors[0], json.loads(heavy)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["engine", "--threads", "0"], "--threads"),
        (["engine", "--engines", "tgi"], "--engines: 'tgi'"),
        (["engine", "--sizes", "1b"], "--sizes: '1b'"),
        (["engine", "--prompt-len", "1000", "--sizes", "default"], "--prompt-len"),
        (["prefix", "--turns", "50"], "--turns"),
        (["gateway", "--client-procs", "100000", "--sessions", "100000"], "--client-procs"),
        (["gateway", "--engine", "tgi"], "--engine 'tgi'"),
        (["mismatch", "--prompts", "3"], "--prompts"),
        (["codec", "--repeats", "0", "--workload", "synthetic_1gb"], "--repeats"),
        (["codec", "--workload", "nosuch"], "'nosuch'"),
    ],
)
def test_a_refused_option_imports_no_torch_transformers_or_ray(args, needle):
    line, heavy = refuse(*args)
    assert needle in line, line
    assert heavy == [], (line, heavy)


def test_the_gateways_context_check_still_refuses_a_session_too_long_for_the_engine():
    line, _ = refuse("gateway", "--turns", "40")
    assert "--turns" in line and "max_seq_len" in line, line


def test_the_benchmarks_check_again_for_callers_that_skip_the_cli():
    from tandem.bench.codec import run_codec_bench
    from tandem.bench.gateway import run_gateway_bench
    from tandem.bench.limits import BenchInputError

    with pytest.raises(BenchInputError, match="--threads"):
        run_codec_bench(threads=0, workloads=("synthetic_1gb",))
    with pytest.raises(BenchInputError, match="--engine 'tgi'"):
        run_gateway_bench(str(REPO / "models" / "tandem-base"), engine_kind="tgi")
