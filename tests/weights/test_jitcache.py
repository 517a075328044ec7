"""The kernel cache follows every kernel source (tandem.weights.jitcache), in fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tandem.weights.decode_kernels as decode_kernels
from tandem.weights import jitcache

HELPER = "from numba import njit\n\n\n@njit(cache=True)\ndef f():\n    return {value}\n"
KERNEL = (
    "from numba import njit\n\nfrom helper import f\n\n\n@njit(cache=True)\ndef g():\n    return f() + 1\n"
)
PROGRAM = """
import sys
sys.path.insert(0, {directory!r})
if {stamped}:
    from tandem.weights import jitcache
    assert jitcache.install({directory!r})
import kern
print(kern.g())
"""


def _kernels(directory: Path, value: int) -> None:
    (directory / "helper.py").write_text(HELPER.format(value=value))
    if not (directory / "kern.py").exists():
        (directory / "kern.py").write_text(KERNEL)


def _run(directory: Path, stamped: bool) -> int:
    code = PROGRAM.format(directory=str(directory), stamped=stamped)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip())


def test_a_kernel_recompiles_when_a_helper_it_inlines_changes(tmp_path: Path) -> None:
    stamped, plain = tmp_path / "stamped", tmp_path / "plain"
    for d in (stamped, plain):
        d.mkdir()
        _kernels(d, 1)
        assert _run(d, stamped=d is stamped) == 2
    assert list((stamped / "__pycache__").glob("kern.g-*.nbi")), "the kernel was not cached"
    for d in (stamped, plain):
        _kernels(d, 41)  # the helper changes; the kernel's own file does not
    assert _run(stamped, stamped=True) == 42
    # numba's own locator keys the kernel by its own file only: the stale machine code answers (the
    # failure this module exists for; if numba ever tracks dependencies, this line says so)
    assert _run(plain, stamped=False) == 2
    assert _run(stamped, stamped=True) == 42  # and the recompiled kernel is cached and used again


def test_the_digest_covers_kernel_sources_only(tmp_path: Path) -> None:
    _kernels(tmp_path, 1)
    before = jitcache.sources_digest(tmp_path)
    (tmp_path / "notes.py").write_text("x = 1\n")  # no kernel in it
    assert jitcache.sources_digest(tmp_path) == before
    _kernels(tmp_path, 2)
    assert jitcache.sources_digest(tmp_path) != before


def test_the_codec_kernels_are_stamped_with_their_sources() -> None:
    locator = decode_kernels.scatter._cache._impl.locator
    directory = Path(decode_kernels.__file__).parent
    assert locator.kernel_digest == jitcache.sources_digest(directory)
    assert locator.get_source_stamp()[1] == locator.kernel_digest
    assert jitcache.install(directory)  # idempotent
