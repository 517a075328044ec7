"""safetensors files and model directories as numpy (``tandem.weights.stfile``), bf16 included."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.weights.stfile import load_weights, save_weights, write_safetensors


def torch_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(5, 7, generator=g).bfloat16(),
        "b.weight": torch.randn(3, generator=g),
        "c.half": torch.randn(2, 2, generator=g).half(),
        "ids": torch.arange(6),
        "mask": torch.tensor([True, False]),
    }


def test_reads_what_torch_wrote_and_writes_what_torch_reads(tmp_path):
    src = torch_tensors()
    save_file(src, tmp_path / "m.safetensors", metadata={"format": "pt"})
    ws = load_weights(tmp_path / "m.safetensors")
    assert ws.tags["a.weight"] == "BF16" and ws.tensors["a.weight"].dtype == np.uint16
    assert np.array_equal(ws.tensors["a.weight"], src["a.weight"].view(torch.uint16).numpy())
    out = save_weights(tmp_path / "copy.safetensors", ws, ws.tensors)
    back = load_file(out)
    for k, t in src.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)


def test_model_directory_keeps_shards_and_other_files(tmp_path):
    src = torch_tensors()
    model = tmp_path / "model"
    model.mkdir()
    save_file({k: src[k] for k in ("a.weight", "b.weight")}, model / "model-00001-of-00002.safetensors")
    save_file({k: src[k] for k in ("c.half", "ids", "mask")}, model / "model-00002-of-00002.safetensors")
    (model / "config.json").write_text(json.dumps({"x": 1}))
    ws = load_weights(model)
    assert set(ws.tensors) == set(src) and len(ws.files) == 2
    out = save_weights(tmp_path / "out", ws, ws.tensors)
    assert (out / "config.json").read_text() == json.dumps({"x": 1})
    assert set(load_file(out / "model-00002-of-00002.safetensors")) == {"c.half", "ids", "mask"}


def test_bad_inputs_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_weights(tmp_path / "empty")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="junk.safetensors.*bad header"):
        load_weights(tmp_path / "junk.safetensors")
    write_safetensors(tmp_path / "ok.safetensors", {"w": np.zeros(4, np.float32)})
    raw = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "short.safetensors").write_bytes(raw[:-4])
    with pytest.raises(ValueError, match="bad byte range"):
        load_weights(tmp_path / "short.safetensors")
