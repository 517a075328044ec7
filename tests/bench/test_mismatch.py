"""`tandem bench mismatch` at tiny sizes through the CLI: every setting is a row with numbers or an error,
R3 on the tiny MoE agrees with the sampler's routing, the targets are booleans, bad sizes exit 2."""

import json
import math


def test_bench_mismatch_prints_every_setting_and_r3_agrees(bench_cli):
    sizes = ["--prompts", "2", "--prompt-len", "8", "--new-tokens", "6", "--threads", "1", "--repeats", "2"]
    r = bench_cli("mismatch", "--json", *sizes, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    rows = out["settings"]
    assert [(s["model"], s["mode"]) for s in rows] == [
        ("tandem-base", "default"), ("tandem-base", "deterministic"),
        ("tiny-moe", "default"), ("tiny-moe", "deterministic"), ("tiny-moe", "r3"), ("tiny-moe", "r2"),
    ]  # fmt: skip
    for s in rows:
        if "error" in s:  # a mode this build cannot run says why and carries no numbers
            assert s["mode"] == "deterministic" and s["error"]
            assert not {"kl_k3", "max_abs_dlogp", "slowdown"} & set(s)
            continue
        assert s["kl_k3"] >= 0 and math.isfinite(s["kl_k3"])
        assert 0 <= s["max_abs_dlogp"] < 1.0  # the engine serves bf16-published weights, the trainer fp32
        if s["mode"] == "deterministic":  # the trainer reads the published rounding too: bitwise equal
            assert s["kl_k3"] == 0.0 and s["max_abs_dlogp"] == 0.0
        assert s["slowdown"] > 0 and s["mismatch_tokens"] == 2 * 6
        if s["model"] == "tandem-base":
            assert s["routing_agreement"] is None
        else:
            assert 0 <= s["routing_agreement"] <= 1 and 0 <= s["router_own_agreement"] <= 1
    assert {s["mode"]: s["slowdown"] for s in rows if s["mode"] == "default"} == {"default": 1.0}
    r3 = next(s for s in rows if s["mode"] == "r3")
    assert r3["routing_agreement"] == 1.0
    assert set(out["targets"]) == {
        f"{m} deterministic {c}" for m in ("tandem-base", "tiny-moe")
        for c in ("kl_k3 == 0", "max_abs_dlogp == 0", "slowdown <= 1.3")
    } | {"tiny-moe r3 routing_agreement == 1.0", "tiny-moe r3 kl_k3 <= 0.5 x default kl_k3"}  # fmt: skip
    assert all(isinstance(v, bool) for v in out["targets"].values())
    assert out["targets"]["tiny-moe r3 routing_agreement == 1.0"] is True


def test_bench_mismatch_rejects_bad_sizes():
    from typer.testing import CliRunner

    from tandem.cli.main import app

    runner = CliRunner()
    bad = {"--prompts": "3", "--new-tokens": "0", "--prompt-len": "-1", "--threads": "0", "--repeats": "0"}
    for flag, value in bad.items():
        r = runner.invoke(app, ["bench", "mismatch", flag, value])
        assert r.exit_code == 2 and flag in r.output, (flag, r.output[-500:])
