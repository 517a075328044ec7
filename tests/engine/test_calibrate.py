"""engine.kind = "auto" on CPU measures both engines on this machine once and serves with the faster
(tandem.engine.calibrate, tandem.engine.choice)."""

import json
import shutil

import pytest

from tandem.core.config import EngineConfig
from tandem.engine import calibrate
from tandem.engine.calibrate import CalibrationError, cached_rates, measured_rates
from tandem.engine.choice import choose_engine
from tandem.engine.vllm import vllm_available

SHIPPED = "models/tandem-base"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / calibrate.CACHE_FILE


@pytest.mark.parametrize(
    ("builtin", "vllm", "expected"), [(900.0, 1200.0, "vllm"), (1900.0, 1100.0, "builtin")]
)
def test_auto_serves_with_the_engine_measured_faster(builtin, vllm, expected):
    seen = []

    def measure(config, path):
        seen.append((config.threads, config.max_batch, str(path)))
        return {"builtin": builtin, "vllm": vllm, "cached": True, "cache": "/c/engine-choice.json"}

    cfg = EngineConfig(threads=2, max_batch=16, vllm_from_params=0)
    kind, reason = choose_engine(cfg, SHIPPED, vllm_probe=lambda: None, measure=measure)
    assert kind == expected
    assert seen == [(2, 16, SHIPPED)]
    assert f"built-in {builtin:.0f} tokens/s, vLLM {vllm:.0f} (cached; 2 threads" in reason


def test_a_failed_measurement_falls_back_to_the_parameter_threshold():
    def measure(config, path):
        raise CalibrationError("the child crashed")

    for threshold, expected in ((0, "vllm"), (10**9, "builtin")):
        cfg = EngineConfig(vllm_from_params=threshold)
        kind, reason = choose_engine(cfg, SHIPPED, vllm_probe=lambda: None, measure=measure)
        assert kind == expected
        assert "since measuring failed (the child crashed)" in reason


def test_measure_off_never_measures():
    def measure(config, path):
        raise AssertionError("auto_measure=false must not measure")

    kind, _ = choose_engine(
        EngineConfig(auto_measure=False), SHIPPED, vllm_probe=lambda: None, measure=measure
    )
    assert kind == "vllm"  # 5.8M parameters >= the default threshold


@pytest.mark.skipif(vllm_available() is not None, reason="the test command installs the vllm extra")
def test_the_shipped_model_is_measured_once_then_read_from_the_cache(shipped_measurement, monkeypatch):
    cache_dir, first = shipped_measurement  # measured in an empty cache directory (tests/engine/conftest.py)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(cache_dir))
    cache = cache_dir / calibrate.CACHE_FILE
    assert first["cached"] is False and first["builtin"] > 0 and first["vllm"] > 0
    stored = json.loads(cache.read_text())
    (entry,) = stored.values()
    assert entry["key"]["batch"] == 8 and entry["key"]["threads"] == 1
    assert entry["key"]["model_config"]["hidden_size"] == 256
    mtime = cache.stat().st_mtime_ns
    again = measured_rates(SHIPPED, threads=1, max_batch=8)
    assert again["cached"] is True and (again["builtin"], again["vllm"]) == (first["builtin"], first["vllm"])
    assert cache.stat().st_mtime_ns == mtime  # read, not measured again
    kind, reason = choose_engine(EngineConfig(threads=1, max_batch=8), SHIPPED)
    assert kind == ("vllm" if first["vllm"] > first["builtin"] else "builtin")
    assert "(cached; 1 threads" in reason
    assert cached_rates(SHIPPED, threads=2, max_batch=8) is None  # another key: measured on its own


def test_a_model_that_cannot_be_measured_is_an_error_and_caches_nothing(cache, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(f"{SHIPPED}/config.json", broken / "config.json")  # no weights, no tokenizer
    with pytest.raises(CalibrationError, match=r"measuring the engines on .*broken.* failed \(exit 1\)"):
        measured_rates(broken, threads=1, max_batch=2)
    assert not cache.exists()


def test_an_unreadable_cache_is_ignored_and_rewritten_whole(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    assert cached_rates(SHIPPED, threads=1, max_batch=8) is None
    assert calibrate._write_cache(cache, "k", {"builtin": 1.0, "vllm": 2.0}) == str(cache)
    assert json.loads(cache.read_text()) == {"k": {"builtin": 1.0, "vllm": 2.0}}
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]  # no temporary file left


def test_a_cache_that_cannot_be_written_is_reported_not_raised(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    entry = {"builtin": 1.0, "vllm": 2.0}
    where = calibrate._write_cache(blocker / "cache" / calibrate.CACHE_FILE, "k", entry)
    assert where.startswith("not cached: ") and "TANDEM_CACHE_DIR" in where


def test_a_model_without_a_readable_config_is_a_calibration_error(tmp_path):
    with pytest.raises(CalibrationError, match=r"config\.json.*cannot be read as JSON"):
        measured_rates(tmp_path, threads=1, max_batch=2)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CalibrationError, match="cannot be read as JSON"):
        cached_rates(tmp_path, threads=1, max_batch=2)
