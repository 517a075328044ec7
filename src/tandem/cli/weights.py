"""`tandem weights diff | apply | inspect`: lossless weight deltas between safetensors files or model dirs.

Invariants: ``apply`` writes its output only after the decoded tensors hash to the delta's target hash, then
reads the written weights back and checks the hash again, so a successful exit means OUT is bit-exact.
``diff`` refuses OLD and NEW whose safetensors dtype tags differ for a tensor (BF16 vs U16, or F8_E4M3 vs
F8_E5M2 vs U8, read alike by numpy) and records NEW's tags in the delta's meta (``safetensors_dtypes``);
``apply`` refuses an OLD whose tags are not those, so a delta never changes a tag. ``diff`` also records
NEW's safetensors ``__metadata__`` per file (``safetensors_metadata``) and ``apply`` writes it in place of
OLD's (when the file layouts correspond; deltas without it keep OLD's), so OUT equals a NEW written in OLD's
layout byte for byte. Hashes are checked in the scheme they were recorded in (``tandem.weights.seam``), so
deltas written with v1 hashes still apply. ``-o`` is written atomically and must not name an input, an
existing non-regular file (symlink, device, FIFO, directory) or, for a model directory, an existing
non-empty directory (``tandem.weights.outpath``); all of this is checked before any work is done.
Bad input (missing path, not safetensors, different tensor sets, dtypes or shapes, wrong base, corrupt delta)
prints one ``error:`` line naming the value and exits with status 2, without a traceback.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from tandem.weights.blob import CorruptDeltaError
from tandem.weights.delta import (
    MAGIC,
    Delta,
    check_names,
    decode_delta,
    delta_stats,
    dumps_delta,
    encode_delta,
    load_delta,
    save_delta,
)
from tandem.weights.outpath import OutputPathError, check_not_input, check_output_dir, check_output_file
from tandem.weights.seam import tensors_hash, tensors_hash_as
from tandem.weights.stfile import ST_DTYPES, WeightSet, dtype_mismatch, load_weights, save_weights

weights_app = typer.Typer(
    help="Lossless weight deltas: diff two versions, apply a delta, inspect a delta or a model.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

ThreadsOpt = Annotated[int, typer.Option(help="Threads for encoding/decoding.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
DTYPES_META = "safetensors_dtypes"  # delta meta: the target's safetensors dtype tag per tensor
METADATA_META = "safetensors_metadata"  # delta meta: the target's ``__metadata__`` per safetensors file


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _load(path: Path, what: str) -> WeightSet:
    try:
        return load_weights(path)
    except (FileNotFoundError, ValueError, OSError) as e:
        _fail(f"{what}: {e}")
    raise AssertionError  # unreachable: _fail exits


def _check_threads(threads: int) -> None:
    if threads < 1:
        _fail(f"--threads must be >= 1, got {threads}")


def _emit(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(out))
    else:
        for k, v in out.items():
            typer.echo(f"{k}: {v}")


def _summary(delta: Delta, nbytes_full: int) -> dict[str, Any]:
    stats = delta_stats(delta)
    params = sum(s.numel for s in stats)
    changed = sum(s.changed for s in stats)
    size = len(dumps_delta(delta))
    return {
        "tensors": len(stats),
        "params": params,
        "changed": changed,
        "density": round(changed / params, 6) if params else 0.0,
        "delta_bytes": size,
        "bits_per_param": round(8 * size / params, 5) if params else 0.0,
        "ratio_vs_full": round(nbytes_full / size, 2) if size else 0.0,
    }


@weights_app.command()
def diff(
    old: Annotated[Path, typer.Argument(help="Base version: a .safetensors file or a model directory.")],
    new: Annotated[Path, typer.Argument(help="New version, same tensors (dtypes and shapes) as OLD.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Delta file to write.")],
    threads: ThreadsOpt = 2,
    json_: JsonOpt = False,
) -> None:
    """Encode the lossless delta that turns OLD into NEW."""
    _check_threads(threads)
    _check_output(output, check_output_file)
    a, b = _load(old, "OLD"), _load(new, "NEW")
    _check_not_input(output, [("OLD", a), ("NEW", b)])
    t0 = time.perf_counter()
    try:
        check_names(a.tensors, b.tensors)
        mismatch = dtype_mismatch(a.tags, b.tags, "OLD", "NEW")
        if mismatch:
            raise ValueError(f"{mismatch}; both need the same safetensors dtypes")
        meta = {DTYPES_META: b.tags, METADATA_META: {f: b.metadata.get(f) for f in b.files}}
        delta = encode_delta(a.tensors, b.tensors, threads=threads, meta=meta)
    except ValueError as e:
        _fail(f"cannot diff {str(old)!r} and {str(new)!r}: {e}")
    seconds = time.perf_counter() - t0
    try:
        save_delta(output, delta)
    except (OSError, OutputPathError) as e:
        _fail(f"cannot write {str(output)!r}: {e}")
    full = sum(int(t.nbytes) for t in b.tensors.values())
    _emit({"delta": str(output), **_summary(delta, full), "encode_s": round(seconds, 3)}, json_)


@weights_app.command()
def apply(
    old: Annotated[Path, typer.Argument(help="The base version the delta was made from.")],
    delta_path: Annotated[Path, typer.Argument(metavar="DELTA", help="Delta from `tandem weights diff`.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the new version.")],
    threads: ThreadsOpt = 2,
    json_: JsonOpt = False,
) -> None:
    """Apply DELTA to OLD and write the new version (bit-exact, verified against the delta's target hash)."""
    _check_threads(threads)
    _check_output(output, check_output_dir if old.is_dir() else check_output_file)
    base = _load(old, "OLD")
    _check_not_input(output, [("OLD", base), ("DELTA", delta_path)])
    try:
        delta = load_delta(delta_path)
        target_tags = _recorded_dtypes(delta, delta_path)
        like = _with_target_metadata(base, delta, delta_path)
    except (FileNotFoundError, ValueError, OSError) as e:
        _fail(f"DELTA: {e}")
    if target_tags is not None:  # a delta never changes a tensor's dtype tag: OLD must have the same ones
        mismatch = dtype_mismatch(base.tags, target_tags, "OLD", "the delta's target")
        if mismatch:
            _fail(f"cannot apply {str(delta_path)!r} to {str(old)!r}: {mismatch}; apply it to the version it "
                  f"was made from")  # fmt: skip
    t0 = time.perf_counter()
    try:
        tensors = decode_delta(base.tensors, delta, threads=threads, verify=True)
    except ValueError as e:
        _fail(f"cannot apply {str(delta_path)!r} to {str(old)!r}: {e}")
    seconds = time.perf_counter() - t0
    try:
        save_weights(output, like, tensors)
    except (OSError, ValueError) as e:
        _fail(f"cannot write {str(output)!r}: {e}")
    if tensors_hash_as(delta.target_hash, _load(output, "written output").tensors) != delta.target_hash:
        _fail(f"{str(output)!r} does not read back to the target hash; the disk may be failing")
    out = {"output": str(output), "target_hash": delta.target_hash, "verified": True}
    _emit({**out, "decode_s": round(seconds, 3)}, json_)


def _check_output(output: Path, check: Callable[[Path], None]) -> None:
    """Refuse an output path that cannot be written safely before any work is done (it is checked again
    when written)."""
    try:
        check(output)
    except OutputPathError as e:
        _fail(str(e))


def _check_not_input(output: Path, inputs: list[tuple[str, WeightSet | Path]]) -> None:
    """Refuse ``-o`` naming an input: a weights path itself or any of its safetensors files."""
    paths: list[tuple[str, Path]] = []
    for label, src in inputs:
        if isinstance(src, WeightSet):
            paths.append((label, src.path))
            if src.is_dir:
                paths += [(f"a file of {label}", src.path / name) for name in src.files]
        else:
            paths.append((label, src))
    try:
        check_not_input(output, paths)
    except OutputPathError as e:
        _fail(str(e))


def _recorded_dtypes(delta: Delta, path: Path) -> dict[str, str] | None:
    """The safetensors dtype tags of the delta's target, if ``diff`` recorded them (older deltas did not)."""
    tags = delta.meta.get(DTYPES_META)
    if tags is None:
        return None
    if not (isinstance(tags, dict) and set(tags) == set(delta.blobs)
            and all(isinstance(t, str) and t in ST_DTYPES for t in tags.values())):  # fmt: skip
        raise CorruptDeltaError(
            f"delta file {str(path)!r} has corrupt meta {DTYPES_META!r} (not a known safetensors dtype for "
            f"each of its tensors); refetch it"
        )
    return tags


def _with_target_metadata(base: WeightSet, delta: Delta, path: Path) -> WeightSet:
    """``base`` with the ``__metadata__`` ``diff`` recorded for the delta's target, so OUT gets NEW's, not
    OLD's: for a single file the one recorded, for a directory per shard when NEW had the same shard names.
    Otherwise (older deltas recorded none, or the layouts differ) OLD's metadata is kept."""
    recorded = delta.meta.get(METADATA_META)
    if recorded is None:
        return base
    if not (isinstance(recorded, dict) and all(
            m is None or (isinstance(m, dict) and all(isinstance(v, str) for v in m.values()))
            for m in recorded.values())):  # fmt: skip
        raise CorruptDeltaError(
            f"delta file {str(path)!r} has corrupt meta {METADATA_META!r} (not an object of safetensors "
            f"metadata per file); refetch it"
        )
    if not base.is_dir and len(base.files) == 1 and len(recorded) == 1:
        return replace(base, metadata={next(iter(base.files)): next(iter(recorded.values()))})
    if base.is_dir and set(recorded) == set(base.files):
        return replace(base, metadata=dict(recorded))
    return base


def _is_delta(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


@weights_app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="A delta file, a .safetensors file or a model directory.")],
    json_: JsonOpt = False,
) -> None:
    """For a delta: density, bits/param and a per-tensor table; for weights: tensors, dtypes and params."""
    if not path.exists():
        _fail(f"{str(path)!r} does not exist; pass a delta file, a .safetensors file or a model directory")
    if path.is_file() and _is_delta(path):
        _inspect_delta(path, json_)
    else:
        _inspect_weights(_load(path, "PATH"), json_)


def _inspect_delta(path: Path, as_json: bool) -> None:
    try:
        delta = load_delta(path)
        stats = delta_stats(delta)
    except ValueError as e:
        _fail(str(e))
    full = sum(s.numel * np.dtype(_itemsize_dtype(s.dtype)).itemsize for s in stats)
    head = {"kind": "delta", "base_hash": delta.base_hash, "target_hash": delta.target_hash,
            **_summary(delta, full)}  # fmt: skip
    rows = [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "mode": s.mode, "changed": s.changed,
             "density": round(s.density, 6), "bytes": s.nbytes, "bits_per_param": round(s.bits_per_param, 4)}
            for s in stats]  # fmt: skip
    if as_json:
        typer.echo(json.dumps({**head, "per_tensor": rows}))
        return
    _emit(head, False)
    typer.echo(f"{'tensor':<48} {'dtype':<9} {'mode':<8} {'density':>9} {'bits/param':>10} {'bytes':>10}")
    for r in rows:
        typer.echo(
            f"{r['name']:<48} {r['dtype']:<9} {r['mode']:<8} {r['density']:>9.5f} "
            f"{r['bits_per_param']:>10.4f} {r['bytes']:>10}"
        )


def _itemsize_dtype(tag: str) -> str:
    return "uint16" if tag == "bfloat16" else tag


def _inspect_weights(ws: WeightSet, as_json: bool) -> None:
    rows = [{"name": n, "dtype": ws.tags[n], "shape": list(t.shape), "params": int(t.size)}
            for n, t in sorted(ws.tensors.items())]  # fmt: skip
    by_dtype: dict[str, int] = {}
    for r in rows:
        by_dtype[r["dtype"]] = by_dtype.get(r["dtype"], 0) + r["params"]
    head = {"kind": "weights", "files": sorted(ws.files), "tensors": len(rows),
            "params": sum(r["params"] for r in rows), "params_by_dtype": by_dtype,
            "bytes": sum(int(t.nbytes) for t in ws.tensors.values()),
            "hash": tensors_hash(ws.tensors)}  # fmt: skip
    if as_json:
        typer.echo(json.dumps({**head, "per_tensor": rows}))
        return
    _emit(head, False)
    typer.echo(f"{'tensor':<48} {'dtype':<6} {'params':>12}  shape")
    for r in rows:
        typer.echo(f"{r['name']:<48} {r['dtype']:<6} {r['params']:>12}  {r['shape']}")
