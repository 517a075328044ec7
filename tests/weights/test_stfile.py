"""safetensors files and model directories as numpy (``tandem.weights.stfile``), bf16 included."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.weights.stfile import SafetensorsError, load_weights, save_weights, write_safetensors


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


def _raw_file(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


F32 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
BAD_HEADERS = [
    (b"[1, 2]", "header is a JSON list"),
    (b'"hello"', "header is a JSON str"),
    (b'{"a": 5}', "tensor 'a' has a malformed entry 5"),
    (b'{"a": [1, 2]}', "tensor 'a' has a malformed entry"),
    (b'{"a": NaN}', "NaN"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', "'a' appears twice"),
    (json.dumps({"__metadata__": 5, "a": F32}).encode(), "__metadata__ is 5"),
    (json.dumps({"a": {**F32, "shape": None}}).encode(), "tensor 'a' has shape None"),
    (json.dumps({"a": {**F32, "shape": [1.7]}}).encode(), "tensor 'a' has shape [1.7]"),
    (json.dumps({"a": {**F32, "shape": [True]}}).encode(), "tensor 'a' has shape [True]"),
    (json.dumps({"a": {**F32, "shape": [-1, -1]}}).encode(), "tensor 'a' has shape [-1, -1]"),
    (json.dumps({"a": {**F32, "shape": "ab"}}).encode(), "tensor 'a' has shape 'ab'"),
    (json.dumps({"a": {**F32, "data_offsets": None}}).encode(), "tensor 'a' has data_offsets None"),
    (json.dumps({"a": {**F32, "data_offsets": [0, 4, 8]}}).encode(), "tensor 'a' has data_offsets"),
    (json.dumps({"a": {**F32, "data_offsets": ["x", "y"]}}).encode(), "tensor 'a' has data_offsets"),
    (json.dumps({"a": {**F32, "data_offsets": [0, 10**400]}}).encode(), "tensor 'a' has a bad byte range"),
    (json.dumps({"a": {**F32, "dtype": ["F32"]}}).encode(), "tensor 'a' has unsupported dtype"),
    (json.dumps({"a": {**F32, "shape": [2**40] * 3, "data_offsets": [0, 0]}}).encode(), "'a' has a bad byte"),
    (json.dumps({"a": F32, "b": F32}).encode(), "tensors 'a' [0, 4) and 'b' [0, 4) overlap"),
]


@pytest.mark.parametrize(("header", "needle"), BAD_HEADERS, ids=[n[:24] for _, n in BAD_HEADERS])
def test_malformed_headers_are_refused_naming_the_file_and_tensor(tmp_path, header, needle):
    path = tmp_path / "bad.safetensors"
    _raw_file(path, header, b"\0" * 8)
    with pytest.raises(SafetensorsError) as info:
        load_weights(path)
    assert "bad.safetensors" in str(info.value) and needle in str(info.value)


def test_valid_edge_cases_of_the_header_are_read(tmp_path):
    """An empty tensor may sit at any offset, even inside another's bytes; a 0-d tensor has one element."""
    header = {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "e": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [4, 4]},
              "s": {"dtype": "I64", "shape": [], "data_offsets": [8, 16]}}  # fmt: skip
    path = tmp_path / "edge.safetensors"
    _raw_file(
        path,
        json.dumps(header).encode(),
        np.arange(2, dtype=np.float32).tobytes() + (7).to_bytes(8, "little"),
    )
    ws = load_weights(path)
    assert ws.tensors["e"].shape == (0, 3) and ws.tags["e"] == "BF16" and int(ws.tensors["s"]) == 7
    assert ws.metadata["edge.safetensors"] == {"format": "pt"} and ws.tensors["w"].tolist() == [0.0, 1.0]
