"""`tandem weights diff | apply | inspect` on small safetensors files and model dirs, and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from tandem.cli.weights import weights_app
from tandem.weights.delta import encode_delta, load_delta, save_delta
from tandem.weights.seam import HASH_PREFIX, tensors_hash_v1
from tandem.weights.stfile import load_weights, write_safetensors

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
    for header, needle in (
        (b"[1, 2]", "JSON list"),
        (b'{"a": {"dtype": "F32", "shape": null}}', "'a' has shape None"),
    ):
        (tmp_path / "h.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
        assert needle in error_of(invoke("inspect", tmp_path / "h.safetensors"))


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])


def test_dtype_tags_numpy_reads_alike_are_never_mixed(tmp_path):
    """BF16 and U16 are both uint16 to numpy, F8_E4M3, F8_E5M2 and U8 all uint8: the tags must match."""
    bits = np.arange(16, dtype=np.uint16)
    moved = bits.copy()
    moved[3] += 1
    write_safetensors(tmp_path / "bf16.safetensors", {"t": bits}, {"t": "BF16"})
    write_safetensors(tmp_path / "bf16b.safetensors", {"t": moved}, {"t": "BF16"})
    write_safetensors(tmp_path / "u16.safetensors", {"t": moved}, {"t": "U16"})
    write_safetensors(tmp_path / "u16a.safetensors", {"t": bits}, {"t": "U16"})
    delta = tmp_path / "d.tdelta"
    e = error_of(invoke("diff", tmp_path / "bf16.safetensors", tmp_path / "u16.safetensors", "-o", delta))
    assert "'t' is BF16 in OLD but U16 in NEW" in e and not delta.exists()
    for a, b in (("F8_E4M3", "F8_E5M2"), ("F8_E5M2", "U8"), ("U8", "F8_E4M3")):
        write_safetensors(tmp_path / "a.safetensors", {"t": np.zeros(4, np.uint8)}, {"t": a})
        write_safetensors(tmp_path / "b.safetensors", {"t": np.ones(4, np.uint8)}, {"t": b})
        e = error_of(invoke("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "-o", delta))
        assert f"'t' is {a} in OLD but {b} in NEW" in e and not delta.exists()
    # the delta records its target's tags; apply refuses a base with other tags (same bits, same hash)
    assert (
        invoke("diff", tmp_path / "bf16.safetensors", tmp_path / "bf16b.safetensors", "-o", delta).exit_code
        == 0
    )
    assert load_delta(delta).meta["safetensors_dtypes"] == {"t": "BF16"}
    out = tmp_path / "out.safetensors"
    e = error_of(invoke("apply", tmp_path / "u16a.safetensors", delta, "-o", out))
    assert "'t' is U16 in OLD but BF16 in the delta's target" in e and not out.exists()
    r = invoke("apply", tmp_path / "bf16.safetensors", delta, "-o", out)
    assert r.exit_code == 0, r.output
    assert _header(out)["t"]["dtype"] == "BF16"


def test_tensors_with_a_zero_in_their_shape_diff_apply_and_inspect(tmp_path):
    old = {
        "e": np.zeros((0, 4), np.float32),
        "z": np.zeros((2, 0, 3), np.uint16),
        "w": np.arange(6, dtype=np.float32),
    }
    new = {**old, "w": old["w"] + 1}
    write_safetensors(tmp_path / "old.safetensors", old, {"z": "BF16"})
    write_safetensors(tmp_path / "new.safetensors", new, {"z": "BF16"})
    delta, out = tmp_path / "d.tdelta", tmp_path / "out.safetensors"
    r = invoke("diff", tmp_path / "old.safetensors", tmp_path / "new.safetensors", "-o", delta, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["params"] == 6
    r = invoke("apply", tmp_path / "old.safetensors", delta, "-o", out)
    assert r.exit_code == 0 and "verified: True" in r.output, r.output
    back = load_weights(out)
    assert {k: (v.shape, v.dtype) for k, v in back.tensors.items()} == {
        k: (v.shape, v.dtype) for k, v in new.items()
    }
    assert back.tags["z"] == "BF16" and np.array_equal(back.tensors["w"], new["w"])
    for path in (out, delta):
        r = invoke("inspect", path, "--json")
        assert r.exit_code == 0, r.output
    assert json.loads(r.output)["per_tensor"][0]["shape"] == [0, 4]


def test_apply_into_a_non_empty_directory_is_refused_before_writing(tmp_path):
    make_versions(tmp_path)
    delta = tmp_path / "d.tdelta"
    assert invoke("diff", tmp_path / "old_dir", tmp_path / "new_dir", "-o", delta).exit_code == 0
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "model-00001-of-00009.safetensors").write_bytes(b"another version's shard")
    e = error_of(invoke("apply", tmp_path / "old_dir", delta, "-o", busy))
    assert "'" + str(busy) + "' is not empty" in e and "choose an empty or new directory" in e
    assert sorted(p.name for p in busy.iterdir()) == ["model-00001-of-00009.safetensors"]
    (tmp_path / "afile").write_text("x")
    assert "choose an empty or new directory" in error_of(invoke("apply", tmp_path / "old_dir", delta, "-o",
                                                                 tmp_path / "afile"))  # fmt: skip
    assert (tmp_path / "afile").read_text() == "x"
    (tmp_path / "empty").mkdir()
    r = invoke("apply", tmp_path / "old_dir", delta, "-o", tmp_path / "empty")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["config.json", "model.safetensors"]


def test_diff_refuses_to_write_over_its_inputs(tmp_path):
    make_versions(tmp_path)
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    before = {p: p.read_bytes() for p in (old, new, tmp_path / "new_dir" / "model.safetensors")}
    assert "is OLD" in error_of(invoke("diff", old, new, "-o", old))
    assert "is NEW" in error_of(invoke("diff", old, new, "-o", tmp_path / "." / "new.safetensors"))
    (tmp_path / "hard.safetensors").hardlink_to(new)
    assert "is NEW" in error_of(invoke("diff", old, tmp_path / "hard.safetensors", "-o", new))
    shard = tmp_path / "new_dir" / "model.safetensors"
    assert "is a file of NEW" in error_of(
        invoke("diff", tmp_path / "old_dir", tmp_path / "new_dir", "-o", shard)
    )
    assert "is DELTA" in error_of(invoke("apply", old, shard, "-o", shard))
    assert all(p.read_bytes() == b for p, b in before.items())


def test_a_delta_written_with_v1_hashes_still_applies(tmp_path):
    """`tandem weights diff` used to record bare-hex v1 hashes (built here as it wrote them): `apply` still
    verifies against them and refuses another base; new deltas carry the current scheme."""
    make_versions(tmp_path)
    old, new = load_weights(tmp_path / "old.safetensors"), load_weights(tmp_path / "new.safetensors")
    legacy = encode_delta(
        old.tensors,
        new.tensors,
        base_hash=tensors_hash_v1(old.tensors),
        target_hash=tensors_hash_v1(new.tensors),
        meta={"safetensors_dtypes": new.tags},
    )
    save_delta(tmp_path / "v1.tdelta", legacy)
    out = tmp_path / "out.safetensors"
    r = invoke("apply", tmp_path / "old.safetensors", tmp_path / "v1.tdelta", "-o", out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["target_hash"] == tensors_hash_v1(new.tensors)
    back = load_weights(out)
    assert all(back.tensors[k].tobytes() == t.tobytes() for k, t in new.tensors.items())
    e = error_of(invoke("apply", tmp_path / "new.safetensors", tmp_path / "v1.tdelta", "-o", tmp_path / "x"))
    assert "applies to base" in e and not (tmp_path / "x").exists()
    assert invoke("diff", tmp_path / "old.safetensors", tmp_path / "new.safetensors", "-o",
                  tmp_path / "v2.tdelta").exit_code == 0  # fmt: skip
    assert load_delta(tmp_path / "v2.tdelta").target_hash.startswith(HASH_PREFIX)
    r = invoke("inspect", tmp_path / "new.safetensors", "--json")
    assert json.loads(r.output)["hash"].startswith(HASH_PREFIX)


def test_apply_writes_the_new_versions_safetensors_metadata(tmp_path):
    """OUT is NEW byte for byte: the delta records NEW's ``__metadata__`` per file (its key order too) and
    `apply` writes it instead of OLD's; a delta without it (older ones) keeps OLD's."""
    old, new = make_versions(tmp_path)
    save_file(old, tmp_path / "old.safetensors", metadata={"step": "1", "format": "pt"})
    save_file(new, tmp_path / "new.safetensors", metadata={"format": "pt", "step": "2", "run": "x"})
    save_file(new, tmp_path / "new_dir" / "model.safetensors", metadata={"format": "pt", "step": "2"})
    delta = tmp_path / "d.tdelta"
    for a, b, out, written, target in (
        ("old.safetensors", "new.safetensors", "out.safetensors", "", ""),
        ("old_dir", "new_dir", "out", "model.safetensors", "model.safetensors"),
    ):
        r = invoke("diff", tmp_path / a, tmp_path / b, "-o", delta)
        assert r.exit_code == 0, r.output
        r = invoke("apply", tmp_path / a, delta, "-o", tmp_path / out)
        assert r.exit_code == 0, r.output
        assert (tmp_path / out / written).read_bytes() == (tmp_path / b / target).read_bytes()
        delta.unlink()
    r = invoke("diff", tmp_path / "old.safetensors", tmp_path / "new.safetensors", "-o", delta)
    assert r.exit_code == 0, r.output
    legacy = load_delta(delta)
    recorded = legacy.meta.pop("safetensors_metadata")
    assert recorded == {"new.safetensors": {"format": "pt", "step": "2", "run": "x"}}
    save_delta(tmp_path / "legacy.tdelta", legacy)
    r = invoke("apply", tmp_path / "old.safetensors", tmp_path / "legacy.tdelta", "-o", tmp_path / "o2")
    assert r.exit_code == 0, r.output
    assert _header(tmp_path / "o2")["__metadata__"] == {"step": "1", "format": "pt"}
    legacy.meta["safetensors_metadata"] = {"new.safetensors": ["not", "metadata"]}
    save_delta(tmp_path / "bad.tdelta", legacy)
    r = invoke("apply", tmp_path / "old.safetensors", tmp_path / "bad.tdelta", "-o", tmp_path / "o3")
    e = error_of(r)
    assert "corrupt meta 'safetensors_metadata'" in e and not (tmp_path / "o3").exists()
