"""`tandem bench sandbox`: a burst of sandboxes on copy-on-write clones of a 100 MB workspace vs plain
processes.

What it measures, all in one run (the baseline is the same command as a plain subprocess, same interpreter,
same concurrency):
- ``p50_ms`` / ``p99_ms``: per sandbox, take one from a warm :class:`SandboxPool` (``pool_size`` ready
  CoW clones of the 100 MB workspace's template; a miss creates one on the spot), run a short Python command
  in it, close it (processes killed; unmount and deletion handed to the reaper), in a burst of ``n`` with
  ``concurrency`` at a time; ``plain_p50_ms``/``plain_p99_ms``: the same command as a plain subprocess in the
  same kind of burst; ``per_s``: sandboxes per second over the whole burst, including the pool's creations
  and the reaper's teardowns (the clock stops when the reaper has drained).
- ``clone_ms_1mb`` / ``clone_ms_100mb``: median time to create a sandbox (workspace overlay, cgroups) from
  the template of a 1 MB and of a 100 MB workspace; ``copy_clone_ms_100mb``: creating one from the 100 MB
  directory with ``workspace_mode = "copy"`` (the baseline copy-on-write replaces); ``layer_build_ms_100mb``:
  the one-time cost of the shared layer (first sandbox of the directory).
- ``rss_mb_per_sandbox``: resident memory of every process of a sandbox (bwrap, its init, the shell, Python)
  while its command runs, averaged over ``rss_sandboxes`` live sandboxes (None without a cgroup to count
  them).

``scratch`` says where the sandboxes' private directories were (``SandboxConfig.scratch``: ``tmpfs`` or
``disk``); ``--scratch disk`` measures them on disk.

Invariants: the workspaces are generated in a temporary directory and deleted; every sandbox is closed; the
machine's other load is not controlled, so compare values from the same run only.

Before anything is written, ``check_args`` refuses (``BenchInputError``, naming the option) a burst of more
than ``MAX_BURST`` sandboxes (the burst queues one job per sandbox up front), more sandboxes at a time than 4
per CPU, a pool of more than ``MAX_POOL``, and a ``big_mb`` whose copies do not fit the free space of the
temp dir (``disk_needed``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tandem.bench import limits
from tandem.core.config import SandboxConfig
from tandem.sandbox import SandboxPool, WorkspaceTemplate, create_sandbox, drain_reaper
from tandem.sandbox.bwrap import SYSTEM_PYTHON, sandbox_python
from tandem.sandbox.limits import agent_uid

COMMAND = "import os; print(len(os.listdir('.')))"
FILE_BYTES = 256 * 1024
MIB = 2**20
MAX_BURST = 100_000
"""Most sandboxes in one burst: every one is queued as a job before the first runs, and at tens of sandboxes
a second 100000 already take about an hour."""
MAX_POOL = 1024
"""Most ready sandboxes in the warm pool: each holds a private directory, an overlay mount and cgroups, and
the pool starts building them all before the burst; 1024 is over a hundred times the default (8)."""


def make_workspace(root: Path, mb: int) -> Path:
    """A directory of ``mb`` MiB: ``main.py`` plus 256 KiB data files spread over subdirectories."""
    root.mkdir(parents=True)
    (root / "main.py").write_text("print('hello')\n")
    n_files = max(1, mb * 1024 * 1024 // FILE_BYTES)
    for i in range(n_files):
        d = root / f"pkg{i % 16}"
        d.mkdir(exist_ok=True)
        (d / f"data{i}.bin").write_bytes(os.urandom(FILE_BYTES))
    return root


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _burst(job, n: int, concurrency: int) -> tuple[list[float], float]:
    """Run ``job`` ``n`` times, ``concurrency`` at a time; (latencies in ms, wall seconds)."""

    def timed(_: int) -> float:
        t0 = time.perf_counter()
        job()
        return (time.perf_counter() - t0) * 1000

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        lat = list(ex.map(timed, range(n)))
    return lat, time.perf_counter() - t0


def _clone_ms(workspace: Path, config: SandboxConfig, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        s = create_sandbox(workspace, config)
        times.append((time.perf_counter() - t0) * 1000)
        s.close()
    return statistics.median(times)


def _rss_mb_per_sandbox(workspace: Path, config: SandboxConfig, k: int) -> float | None:
    boxes = [create_sandbox(workspace, config) for _ in range(k)]
    try:
        if not all(b._cgroup.dirs for b in boxes):
            return None
        threads = [
            threading.Thread(target=b.exec, args=(["python3", "-c", "import time; time.sleep(3)"],))
            for b in boxes
        ]
        for t in threads:
            t.start()
        time.sleep(1.5)
        total_kb = 0
        for b in boxes:
            for pid in b._cgroup.pids():
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            total_kb += int(line.split()[1])
                except OSError:
                    pass
        for t in threads:
            t.join()
        return round(total_kb / 1024 / k, 2)
    finally:
        for b in boxes:
            b.close()


def disk_needed(big_mb: int, overlay: bool, at_once: int) -> int:
    """Least bytes the run writes to the temp dir: the 1 MiB and ``big_mb`` MiB workspaces, and per big one
    with overlays its shared layer and one copy-mode clone, else (every sandbox a copy) ``at_once`` live
    copies and the copy-mode clone."""
    copies = 2 if overlay else at_once + 1
    return (1 + copies) * big_mb * MIB + 2 * MIB


def check_args(
    n: int, concurrency: int, pool_size: int, big_mb: int, config: SandboxConfig, rss_sandboxes: int = 0
) -> None:
    """Raise ``BenchInputError`` naming the first option out of range (module docstring), else nothing."""
    limits.require(
        limits.in_range("--n", n, 1, MAX_BURST, "the burst queues every sandbox up front; pass e.g. 200"),
        limits.processes("--concurrency", concurrency),
        limits.in_range("--pool-size", pool_size, 0, MAX_POOL, "each ready sandbox holds mounts and cgroups"),
        limits.at_least("--big-mb", big_mb, 2, "the small workspace is 1 MiB"),
    )
    from tandem.sandbox.overlay import overlay_available

    overlay = config.workspace_mode != "copy" and overlay_available()
    need = disk_needed(big_mb, overlay, max(concurrency + pool_size, rss_sandboxes))
    what = "the workspace, its shared layer and a copy" if overlay else "the workspace and a copy per sandbox"
    limits.require(limits.fits_disk("--big-mb", Path(tempfile.gettempdir()), need, what))


def run_sandbox_bench(
    n: int = 200,
    concurrency: int = 4,
    clone_repeats: int = 20,
    rss_sandboxes: int = 8,
    big_mb: int = 100,
    pool_size: int = 8,
    scratch: str = "auto",
) -> dict[str, Any]:
    """Run the benchmark (see module docstring) and return its JSON object."""
    if clone_repeats < 1:
        raise ValueError(f"clone_repeats must be >= 1, got {clone_repeats}")
    config = SandboxConfig(timeout_s=60.0, scratch=scratch)
    check_args(n, concurrency, pool_size, big_mb, config, rss_sandboxes)
    prefix = sandbox_python(agent_uid(config))
    python = str(prefix / "bin" / "python3") if prefix is not None else str(SYSTEM_PYTHON)
    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-sandbox-"))
    try:
        small = make_workspace(tmp / "ws1mb", 1)
        big = make_workspace(tmp / f"ws{big_mb}mb", big_mb)
        t0 = time.perf_counter()
        first = create_sandbox(big, config)
        layer_build_ms = (time.perf_counter() - t0) * 1000
        mode, scratch = first.mode, "disk" if first.scratch is None else "tmpfs"
        first.close()
        create_sandbox(small, config).close()
        with WorkspaceTemplate(small, config) as t_small, WorkspaceTemplate(big, config) as t_big:
            clone_1 = _clone_ms(t_small, config, clone_repeats)
            clone_big = _clone_ms(t_big, config, clone_repeats)
        copy_config = config.model_copy(update={"workspace_mode": "copy"})
        copy_big = _clone_ms(big, copy_config, max(3, clone_repeats // 4))

        def plain() -> None:
            subprocess.run([python, "-c", COMMAND], cwd=big, capture_output=True, check=True)

        template = WorkspaceTemplate(big, config)
        pool = SandboxPool(template, config, size=pool_size)

        def sandboxed() -> None:
            s = pool.acquire()
            try:
                r = s.exec(["python3", "-c", COMMAND])
                if r.exit_code != 0:
                    raise RuntimeError(f"sandboxed command failed ({r.exit_code}): {r.stderr[-300:]}")
            finally:
                s.close(wait=False)  # processes die now; unmount and deletion go to the reaper

        _burst(plain, min(n, 20), concurrency)  # warm the page cache and the interpreter
        plain_lat, _ = _burst(plain, n, concurrency)
        time.sleep(0.5)  # let the pool fill before the burst (a warm pool is the point)
        t0 = time.perf_counter()
        sb_lat, _ = _burst(sandboxed, n, concurrency)
        pool.close()
        drain_reaper()  # the teardown the burst handed off counts in its throughput
        wall = time.perf_counter() - t0
        hits, misses = pool.hits, pool.misses
        template.close()
        rss = _rss_mb_per_sandbox(big, config, rss_sandboxes) if rss_sandboxes > 0 else None
        p50, plain_p50 = statistics.median(sb_lat), statistics.median(plain_lat)
        return {
            "n": n,
            "concurrency": concurrency,
            "workspace_mode": mode,
            "scratch": scratch,
            "uid": agent_uid(config),
            "p50_ms": round(p50, 2),
            "p99_ms": round(_pct(sb_lat, 0.99), 2),
            "plain_p50_ms": round(plain_p50, 2),
            "plain_p99_ms": round(_pct(plain_lat, 0.99), 2),
            "p50_vs_plain": round(p50 / plain_p50, 3),
            "per_s": round(n / wall, 2),
            "pool_size": pool_size,
            "pool_hits": hits,
            "pool_misses": misses,
            "clone_ms_1mb": round(clone_1, 3),
            f"clone_ms_{big_mb}mb": round(clone_big, 3),
            "clone_ratio": round(clone_big / clone_1, 3),
            f"copy_clone_ms_{big_mb}mb": round(copy_big, 2),
            f"layer_build_ms_{big_mb}mb": round(layer_build_ms, 1),
            "rss_mb_per_sandbox": rss,
            "targets": {
                "p50_ms <= 1.5 x plain_p50_ms": p50 <= 1.5 * plain_p50,
                "clone_ms_100mb <= 2 x clone_ms_1mb": clone_big <= 2 * clone_1,
                "per_s >= 20": n / wall >= 20,
            },
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
