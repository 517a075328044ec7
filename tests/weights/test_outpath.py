"""Atomic output files (``tandem.weights.outpath``) as used by ``save_delta`` and ``write_safetensors``."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tandem.weights.delta import encode_delta, save_delta
from tandem.weights.outpath import OutputPathError, atomic_output
from tandem.weights.stfile import write_safetensors


def _writers(tmp_path):
    w = {"w": np.arange(8, dtype=np.float32)}
    delta = encode_delta(w, {"w": w["w"] + 1})
    return [lambda p: save_delta(p, delta), lambda p: write_safetensors(p, w)]


def _leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if ".tmp" in n)


def test_an_existing_symlink_fifo_or_directory_is_refused_and_left_untouched(tmp_path):
    target = tmp_path / "precious.bin"
    target.write_bytes(b"keep me")
    link = tmp_path / "link.out"
    link.symlink_to(target)
    fifo = tmp_path / "fifo.out"  # stands in for a device: not a regular file
    os.mkfifo(fifo)
    directory = tmp_path / "dir.out"
    directory.mkdir()
    for write in _writers(tmp_path):
        for path, kind in ((link, "symlink"), (fifo, "FIFO"), (directory, "directory")):
            with pytest.raises(OutputPathError, match=f"{path.name}.*is a {kind}.*left untouched"):
                write(path)
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_bytes() == b"keep me"
    assert fifo.is_fifo() and directory.is_dir() and not any(directory.iterdir())
    assert _leftovers(tmp_path) == []
    for write in _writers(tmp_path):  # a regular file is replaced
        (tmp_path / "plain.out").write_bytes(b"old")
        write(tmp_path / "plain.out")
        assert (tmp_path / "plain.out").read_bytes() != b"old"


def test_a_failed_write_or_rename_removes_the_temporary_file(tmp_path):
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_output(out) as f:
        f.write(b"partial")
        raise RuntimeError("disk full")
    assert out.read_bytes() == b"old" and _leftovers(tmp_path) == []
    late = tmp_path / "late.bin"
    with pytest.raises(OutputPathError, match="late.bin.*directory"), atomic_output(late) as f:
        f.write(b"data")
        late.mkdir()  # appears while the temporary file is written: the rename is refused
    assert late.is_dir() and _leftovers(tmp_path) == []
    with pytest.raises(FileNotFoundError), atomic_output(tmp_path / "missing" / "x.bin"):
        pass
    assert _leftovers(tmp_path) == []
