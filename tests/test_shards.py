"""scripts/test_shards.sh, which `bash scripts/test.sh` (and so CI) runs the suite with: it fails when either
shard fails or collects nothing, and each shard sees its own /dev/shm and temp dir, not the machine's."""

import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "test_shards.sh"


def _can_isolate() -> bool:
    return subprocess.run(["bash", str(SCRIPT), "--can-isolate"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _can_isolate(), reason="needs root and `unshare --mount`")


def _shards(suite: Path, shard_a: Path, in_b: Path | None = None) -> subprocess.CompletedProcess:
    """Run the script on ``suite``; the temp dirs it keeps after a failure (and names) are removed."""
    env = dict(os.environ, TANDEM_TEST_SUITE=str(suite), TANDEM_TEST_SHARD_A=str(shard_a))
    env["TANDEM_TEST_IN_B"] = str(in_b or "")
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    kept = re.search(r"the shards' temp dirs are kept in (\S+)", r.stderr)
    if kept:
        shutil.rmtree(kept.group(1))
    return r


def _write_test(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)


def test_two_shards_run_apart_and_each_sees_only_its_own_shm_and_temp_dir(tmp_path):
    marker = f"shard-marker-{uuid.uuid4().hex}"
    for name in ("A", "B"):
        _write_test(
            tmp_path / "suite" / name.lower() / f"test_{name.lower()}.py",
            "import os, tempfile\n"
            "def test_isolated():\n"
            f"    assert tempfile.gettempdir().endswith('/{name}/tmp'), tempfile.gettempdir()\n"
            f"    assert os.listdir('/dev/shm') == []\n"
            f"    open('/dev/shm/{marker}', 'w').close()\n",
        )
    r = _shards(tmp_path / "suite", tmp_path / "suite" / "a")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("A", "B"):
        assert any(line.startswith(f"[{name}] 1 passed") for line in r.stdout.splitlines()), r.stdout
    assert not (Path("/dev/shm") / marker).exists()


def test_a_failing_shard_fails_the_run_and_a_shard_without_tests_too(tmp_path):
    suite = tmp_path / "suite"
    _write_test(suite / "a" / "test_a.py", "def test_passes():\n    pass\n")
    _write_test(suite / "b" / "test_b.py", "def test_fails():\n    assert 1 == 2\n")
    r = _shards(suite, suite / "a")
    assert r.returncode == 1 and "error: shard B failed (pytest exit status: 1)" in r.stderr, r.stderr
    assert "shard A" not in r.stderr

    (suite / "b" / "test_b.py").write_text("def test_passes():\n    pass\n")
    (suite / "empty").mkdir()
    r = _shards(suite, suite / "empty")
    assert r.returncode == 1 and "error: shard A collected no tests" in r.stderr, r.stderr
    assert "kept in" in r.stderr  # for a look at what the failed shards left


def test_a_file_under_shard_as_paths_can_run_in_shard_b_and_runs_once(tmp_path):
    suite = tmp_path / "suite"
    _write_test(suite / "a" / "test_a.py", "def test_one():\n    pass\n")
    _write_test(suite / "a" / "test_moved.py", "def test_two():\n    pass\n\ndef test_three():\n    pass\n")
    _write_test(suite / "b" / "test_b.py", "def test_four():\n    pass\n")
    r = _shards(suite, suite / "a", suite / "a" / "test_moved.py")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert any(line.startswith("[A] 1 passed") for line in lines), r.stdout
    assert any(line.startswith("[B] 3 passed") for line in lines), r.stdout


def test_test_sh_refuses_a_shard_count_it_does_not_have_before_setting_up():
    env = dict(os.environ, TANDEM_TEST_SHARDS="3")
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "test.sh")], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "TANDEM_TEST_SHARDS=3 must be 1 (one pytest process) or 2" in r.stderr
    assert "setup:" not in r.stdout + r.stderr
