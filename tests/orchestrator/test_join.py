"""Joining a Ray cluster: a run joins the cluster ``RAY_ADDRESS`` or ``orchestrator.ray_address`` names; an
address nothing answers at and a cluster too small for the run's actors are refused by name, at once, and
leave no Ray connection behind. (The runs of test_faults.py and the other run tests join the session's
cluster through ``RAY_ADDRESS``: that is the success path.)"""

import subprocess
import sys
import time

import pytest
import ray

from tandem.cli.main import build_config
from tandem.core.errors import TandemError
from tandem.orchestrator import train

from .conftest import SHARED_CLUSTER_CPUS, free_port


def test_an_address_nothing_answers_at_is_refused_naming_where_it_came_from(tmp_path, monkeypatch):
    """Before, ``ray.init`` waited on such an address for over 10 minutes (measured; still waiting when
    killed), and with ``RAY_ADDRESS`` set a run failed in ``ray.init`` ("num_cpus ... must not be
    provided") instead of joining."""
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    cfg = build_config("smoke", None, [])
    t0 = time.monotonic()
    with pytest.raises(TandemError, match=rf"no Ray cluster answers at '{address}' \(RAY_ADDRESS in the env"):
        train(cfg, tmp_path / "run", quiet=True)
    assert time.monotonic() - t0 < 60 and not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS")
    r = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "train", "--preset", "smoke", "--run-dir",
         str(tmp_path / "cli"), "--ray-address", address],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"no Ray cluster answers at '{address}' (orchestrator.ray_address)" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_cluster_with_too_few_cpus_for_the_runs_actors_is_refused_with_the_numbers(tmp_path, joined_ray):
    """Before, the actors would have waited for ever to be placed (Ray only warns that they cannot be)."""
    engines = 2
    threads = SHARED_CLUSTER_CPUS // engines  # with the trainer's threads: more than the cluster has
    cfg = build_config("smoke", None, [f"engine.num_engines={engines}", f"engine.threads={threads}"])
    needed = cfg.train.threads + engines * threads
    said = (
        rf"the Ray cluster at '{joined_ray}' \(RAY_ADDRESS in the environment\) has "
        rf"{SHARED_CLUSTER_CPUS} CPUs and this run's actors ask for {needed} "
        rf"\(train.threads={cfg.train.threads} \+ engine.threads={threads} x engine.num_engines={engines}\)"
    )
    with pytest.raises(TandemError, match=said):
        train(cfg, tmp_path, quiet=True)
    assert not ray.is_initialized()


def test_without_an_address_a_run_starts_its_own_cluster_beside_one_ray_start_left(ray_cluster):
    """``ray start`` (here the session's cluster) writes its address to /tmp/ray/ray_current_cluster, and a
    bare ``ray.init()`` joins the cluster named there. Before, a run without an address therefore joined
    it, or failed ("num_cpus ... must not be provided"), as `tandem bench sync` did. (In a child process: a
    local cluster turns on Ray's token authentication for the process that started it, which could then no
    longer join the session's cluster.)"""
    import os
    import tempfile
    from pathlib import Path

    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    port = ray_cluster.split(":")[1]
    assert current.read_text().strip().endswith(f":{port}")  # what a bare ray.init() joins
    code = (
        "import ray\n"
        "from tandem.cli.main import build_config\n"
        "from tandem.orchestrator.run import init_ray\n"
        "init_ray(build_config('smoke', None, []))\n"
        "print('gcs', ray.get_runtime_context().gcs_address)\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    (gcs,) = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("gcs ")]
    assert not gcs.endswith(f":{port}"), gcs
