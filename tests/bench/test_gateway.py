"""`tandem bench gateway` at a tiny size through the CLI: both sides generate every token, the gateway's
records are token-exact, the engine and the reason for it are reported; bad settings exit 2 naming them."""

import json


def test_bench_gateway_runs_both_sides_on_the_named_engine_with_token_exact_records(bench_cli):
    small = ["--sessions", "4", "--turns", "2", "--max-tokens", "4", "--repeats", "2", "--threads", "1"]
    r = bench_cli("gateway", "--json", "--engine", "builtin", *small)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["engine"] == "builtin" and "set explicitly" in out["engine_reason"]
    assert out["tokens_per_round"] == 4 * 2 * 4 and out["requests_per_round"] == 4 * 2
    assert out["in_process_tokens_per_s"] > 0 and out["gateway_tokens_per_s"] > 0
    ratio = out["gateway_tokens_per_s"] / out["in_process_tokens_per_s"]  # both rounded to 0.1 token/s
    assert abs(out["overhead"] - (1 - ratio)) < 1e-3
    ip, gw = out["in_process_wall_s"], out["gateway_wall_s"]
    assert len(ip) == len(gw) == 2  # timed rounds only; each side's warm-up is left out
    paired = sum(1 - a / b for a, b in zip(ip, gw, strict=True)) / 2  # the median of two
    slack = sum(0.0005 * (1 / b + a / b**2) for a, b in zip(ip, gw, strict=True))  # walls rounded to 1 ms
    assert abs(out["overhead_paired_median"] - paired) <= slack + 1e-4
    records = out["gateway_records"]
    assert records["token_exact_records"] is True
    assert records["segments"] == 4 and records["sampled_tokens"] == 4 * 2 * 4 and records["reasons"] == []
    assert out["client"].startswith("openai ") and out["client_procs"] == 1
    assert 0 < out["client_cpu_ms_per_request"] < 1000
    assert 0 < out["server_cpu_ms_per_request"] < 1000
    alone = out["client_alone_wall_s"]  # the same client against the instant server
    assert len(alone) == 2 and all(x > 0 for x in alone)
    assert 0 < out["client_alone_cpu_ms_per_request"] < 1000
    best_ip, best_alone = min(ip), min(alone)
    floor = best_alone / (best_ip + best_alone)
    assert abs(out["client_alone_overhead"] - floor) <= 0.001 / best_ip + 1e-4  # walls rounded to 1 ms


def test_bench_gateway_refuses_an_unknown_engine_and_bad_sizes_naming_them(bench_cli):
    r = bench_cli("gateway", "--engine", "tgi")
    assert r.returncode == 2
    assert "'tgi'" in r.stderr and "auto, builtin, vllm" in r.stderr
    r = bench_cli("gateway", "--sessions", "2", "--client-procs", "3")
    assert r.returncode == 2
    assert "client_procs" in r.stderr and "3" in r.stderr
