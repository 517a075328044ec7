"""`tandem weights diff | apply | inspect` on small safetensors files and model dirs, and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from tandem.cli.weights import weights_app

runner = CliRunner()


def make_versions(root: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    master = {"w": torch.randn(64, 96, generator=g) * 0.02, "b": torch.randn(96, generator=g)}
    old = {"w": master["w"].bfloat16(), "b": master["b"], "ids": torch.arange(8)}
    new = {"w": (master["w"] + 3e-5 * torch.randn(64, 96, generator=g)).bfloat16(), "b": master["b"] + 1e-3,
           "ids": torch.arange(8)}  # fmt: skip
    for name, tensors in (("old", old), ("new", new)):
        save_file(tensors, root / f"{name}.safetensors")
        d = root / f"{name}_dir"
        d.mkdir()
        save_file(tensors, d / "model.safetensors")
        (d / "config.json").write_text('{"model_type": "toy"}')
    return old, new


def invoke(*args: str):
    return runner.invoke(weights_app, [str(a) for a in args])


def test_diff_apply_inspect_files(tmp_path):
    _, new = make_versions(tmp_path)
    delta = tmp_path / "v1.tdelta"
    r = invoke("diff", tmp_path / "old.safetensors", tmp_path / "new.safetensors", "-o", delta, "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["tensors"] == 3 and 0 < summary["density"] < 1 and summary["ratio_vs_full"] > 1
    out = tmp_path / "out.safetensors"
    r = invoke("apply", tmp_path / "old.safetensors", delta, "-o", out)
    assert r.exit_code == 0, r.output
    assert "verified: True" in r.output
    back = load_file(out)
    for k, t in new.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)
    r = invoke("inspect", delta, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["kind"] == "delta" and {t["name"] for t in info["per_tensor"]} == {"w", "b", "ids"}
    r = invoke("inspect", delta)
    assert r.exit_code == 0 and "bits/param" in r.output and "w" in r.output
    r = invoke("inspect", tmp_path / "new.safetensors")
    assert r.exit_code == 0 and "BF16" in r.output


def test_model_directories(tmp_path):
    _, new = make_versions(tmp_path)
    delta = tmp_path / "d.tdelta"
    assert invoke("diff", tmp_path / "old_dir", tmp_path / "new_dir", "-o", delta).exit_code == 0
    r = invoke("apply", tmp_path / "old_dir", delta, "-o", tmp_path / "out_dir")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out_dir" / "config.json").read_text() == '{"model_type": "toy"}'
    back = load_file(tmp_path / "out_dir" / "model.safetensors")
    assert all(torch.equal(back[k], t) for k, t in new.items())
    r = invoke("inspect", tmp_path / "old_dir", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["params_by_dtype"]["BF16"] == 64 * 96


def error_of(r) -> str:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    return r.output


def test_bad_input_exits_2_with_one_message(tmp_path):
    make_versions(tmp_path)
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    delta = tmp_path / "d.tdelta"
    assert "does not exist" in error_of(invoke("diff", tmp_path / "nope.safetensors", new, "-o", delta))
    save_file({"w": torch.zeros(3)}, tmp_path / "other.safetensors")
    assert "tensor sets differ" in error_of(invoke("diff", old, tmp_path / "other.safetensors", "-o", delta))
    assert invoke("diff", old, new, "-o", delta).exit_code == 0
    assert "applies to base" in error_of(invoke("apply", new, delta, "-o", tmp_path / "x.safetensors"))
    assert not (tmp_path / "x.safetensors").exists()
    bad = bytearray(delta.read_bytes())
    bad[-30] ^= 0xFF
    (tmp_path / "bad.tdelta").write_bytes(bytes(bad))
    assert "corrupt" in error_of(invoke("apply", old, tmp_path / "bad.tdelta", "-o", tmp_path / "y"))
    assert "does not exist" in error_of(invoke("apply", old, tmp_path / "nope.tdelta", "-o", tmp_path / "z"))
    assert "--threads" in error_of(invoke("diff", old, new, "-o", delta, "--threads", "0"))
    assert "does not exist" in error_of(invoke("inspect", tmp_path / "missing"))
    (tmp_path / "text.safetensors").write_text("hello")
    assert "not a safetensors file" in error_of(invoke("inspect", tmp_path / "text.safetensors"))
