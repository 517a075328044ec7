"""Reading the run directories of ``tandem report compare`` (``tandem.orchestrator.compare``).

Invariants:
- every file is read as bytes and decoded as UTF-8 here; anything unusable (unreadable, not UTF-8, not JSON or
  TOML, a number Python will not read or that no float can hold, a wrong shape) raises ``CompareError``
  naming the file (and line) and what to do; nothing else escapes for any file content.
- numbers handed on are plottable: every integer of a metrics row converts to float; ``pass@1`` of an eval
  file is absent or a number in [0, 1]. Booleans are never numbers (``is_number``).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.core.errors import TandemError


class CompareError(TandemError):
    """A run directory or the options of ``tandem report compare`` cannot be used."""


@dataclass(frozen=True)
class RunData:
    """One run directory as written by ``tandem train``."""

    path: Path
    rows: list[dict[str, Any]]
    config: dict[str, Any]
    eval_before: dict[str, Any] | None
    eval_after: dict[str, Any] | None


def is_number(value: Any) -> bool:
    """An int or float that is not a bool (JSON ``true`` is not a metric value)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_text(path: Path) -> str:
    """``path`` decoded as UTF-8; ``CompareError`` naming the file (and the line of a bad byte) otherwise."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CompareError(
            f"{path} cannot be read ({e.strerror or e}); fix its permissions or pass another run directory"
        ) from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise CompareError(
            f"{path}, line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "repair or delete it"
        ) from e


def _parse_json(text: str, where: str, fix: str, whole_file: bool = False) -> Any:
    """``json.loads(text)``; any failure raises ``CompareError``: ``where``, the reason, then ``fix``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = f"line {e.lineno}, column {e.colno}" if whole_file else f"column {e.colno}"
        raise CompareError(f"{where}: not valid JSON ({e.msg} at {at}); {fix}") from e
    except ValueError as e:  # an integer longer than sys.get_int_max_str_digits() digits
        raise CompareError(f"{where}: a number is too long to read ({e.args[0].split(':')[0]}); {fix}") from e
    except RecursionError as e:
        raise CompareError(f"{where}: nested too deeply to read; {fix}") from e


def _check_row_numbers(row: dict[str, Any], where: str) -> None:
    """Every integer of ``row`` converts to float (the plots and means use floats)."""
    for key, value in row.items():
        if is_number(value) and isinstance(value, int):
            try:
                float(value)
            except OverflowError as e:
                digits = len(str(abs(value)))
                raise CompareError(
                    f"{where}: {key!r} is a {digits}-digit integer, too large for a float; delete or repair "
                    "that line"
                ) from e


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Step rows of one ``metrics.jsonl``, sorted by step, the last row of a repeated step kept."""
    if not path.is_file():
        raise CompareError(
            f"{path} does not exist; pass run directories written by `tandem train` (each has metrics.jsonl)"
        )
    by_step: dict[int, dict[str, Any]] = {}
    fix = "delete or repair that line (a run killed while writing can leave a cut-off last line)"
    for n, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        row = _parse_json(line, f"{path}, line {n}", fix)
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise CompareError(
                f"{path}, line {n}: expected a JSON object with an integer 'step', got {line[:80]!r}; "
                "delete or repair that line"
            )
        _check_row_numbers(row, f"{path}, line {n}")
        by_step[step] = row
    if not by_step:
        raise CompareError(
            f"{path} has no step rows (the run finished no trainer step); compare runs that trained at least "
            "one step"
        )
    return [by_step[s] for s in sorted(by_step)]


def read_eval(path: Path) -> dict[str, Any] | None:
    """An ``eval_*.json`` object (None when absent) whose ``pass@1``, if any, is a number in [0, 1]."""
    if not path.is_file():
        return None
    data = _parse_json(_read_text(path), str(path), "repair or delete it", whole_file=True)
    if not isinstance(data, dict):
        raise CompareError(f"{path}: expected a JSON object; repair or delete it")
    value = data.get("pass@1")
    if value is not None and not (is_number(value) and 0 <= value <= 1):
        raise CompareError(
            f"{path}: 'pass@1' must be a number in [0, 1], got {json.dumps(value)[:80]}; repair or delete it"
        )
    return data


def read_config(path: Path) -> dict[str, Any]:
    """The run's ``config.toml`` as a dict ({} when absent)."""
    if not path.is_file():
        return {}
    text = _read_text(path)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise CompareError(f"{path}: not valid TOML ({e}); repair or delete it") from e
    except ValueError as e:  # an integer longer than sys.get_int_max_str_digits() digits
        raise CompareError(
            f"{path}: a number is too long to read ({e.args[0].split(':')[0]}); repair or delete it"
        ) from e
    except RecursionError as e:
        raise CompareError(f"{path}: nested too deeply to read; repair or delete it") from e


def load_run(run_dir: Path) -> RunData:
    """Read one run directory; raises ``CompareError`` naming the file for anything unusable."""
    if not run_dir.is_dir():
        raise CompareError(f"{run_dir} is not a directory; pass run directories written by `tandem train`")
    return RunData(
        path=run_dir,
        rows=read_rows(run_dir / "metrics.jsonl"),
        config=read_config(run_dir / "config.toml"),
        eval_before=read_eval(run_dir / "eval_before.json"),
        eval_after=read_eval(run_dir / "eval_after.json"),
    )
