"""`tandem bench codec` on a tiny synthetic workload: the JSON keys the issue asks for, and honest values."""

from __future__ import annotations

import pytest

from tandem.bench.codec import run_codec_bench

KEYS = {"name", "density", "bits_per_param", "entropy_bound_bits_per_param", "ratio_vs_full", "bit_exact",
        "encode_gbps", "decode_gbps", "zstd1_encode_gbps", "baselines"}  # fmt: skip


def test_synthetic_workload_reports_every_key():
    out = run_codec_bench(size_gb=0.004, synthetic_warmup=1, repeats=1, workloads=("synthetic_1gb",))
    (row,) = out["workloads"]
    assert KEYS <= set(row)
    assert set(row["baselines"]) == {"zstd3_full", "xor_zstd", "idx_values_zstd", "zipnn_xor"}
    assert row["bit_exact"] is True
    assert 0 < row["density"] < 0.2
    bound = row["entropy_bound_bits_per_param"]
    assert bound <= row["bits_per_param"] <= 1.15 * bound
    assert row["ratio_vs_full"] > max(row["baselines"].values())
    assert 0.004 * 2**29 <= row["params"] < 0.004 * 2**29 + 8192  # whole rows of 8192


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        run_codec_bench(workloads=("nope",))
    with pytest.raises(ValueError, match=r"--size-gb must be >= 2\*\*-29 \(one parameter\), got 0"):
        run_codec_bench(size_gb=0)
    with pytest.raises(ValueError, match=r"--size-gb must be >= 2\*\*-29 \(one parameter\), got 1e-300"):
        run_codec_bench(size_gb=1e-300)  # no parameter at all: the optimizer refused an empty list
