"""`tandem serve` option checks (src/tandem/cli/serve.py): a bad option is one `error:` line and exit status
2 before the model is loaded, the engine measured or the port bound."""

from __future__ import annotations

from pathlib import Path

import typer
from typer.testing import CliRunner

from tandem.cli.serve import serve

MODEL = Path(__file__).resolve().parents[2] / "models" / "tandem-base"
app = typer.Typer()
app.command()(serve)
app.command("other")(lambda: None)  # two commands keep `serve` as a subcommand
runner = CliRunner()


def _refused(*args: str) -> str:
    res = runner.invoke(app, ["serve", "--model", str(MODEL), "--engine", "builtin", "--port", "0", *args])
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and res.output.count("\n") == 1, res.output
    return res.output


def test_sizes_past_the_machine_are_refused_before_loading() -> None:
    """Before: --max-seq-len past a C long was a TypeError traceback from torch.zeros, --threads past one a
    ValueError traceback (and --threads 100000 a segfault); --max-batch 9999999999999 started serving."""
    for args, needle in (
        (["--max-seq-len", "99999999999999999999"], "KV cache"),
        (["--threads", "99999999999999999999"], "--threads must be <= 1024"),
        (["--threads", "100000"], "--threads must be <= 1024"),
        (["--max-batch", "9999999999999"], "KV cache"),
        (["--max-parked", "99999999999999999999"], "KV cache"),
    ):
        assert needle in _refused(*args)


def test_unknown_dtype_and_log_level_are_refused_before_loading() -> None:
    """Before: --log-level bogus was a KeyError traceback after the model loaded and the port was bound;
    --dtype float16 was refused only after loading the model."""
    assert _refused("--log-level", "bogus").startswith("error: --log-level 'bogus' is unknown")
    assert _refused("--dtype", "float16").startswith("error: --dtype 'float16' is unknown")
