"""What the engine tests share.

``shipped_measurement``: ``engine.kind = "auto"`` measures both engines on a model once per machine, which
starts vLLM (about 30 s of a 2-core machine). The session measures the shipped model once, in a cache
directory of its own: test_calibrate.py checks that measurement and its cache, and test_choice.py serves
with the engine it found faster, reading it as a user's second run would."""

from __future__ import annotations

from pathlib import Path

import pytest

SHIPPED = "models/tandem-base"
MEASURED_THREADS, MEASURED_MAX_BATCH = 1, 8


@pytest.fixture(scope="session")
def shipped_measurement(tmp_path_factory) -> tuple[Path, dict]:
    """(cache directory, ``measured_rates`` result) of one real measurement of the shipped model at
    MEASURED_THREADS threads and MEASURED_MAX_BATCH, made in an empty cache directory."""
    from tandem.engine.calibrate import cached_rates, measured_rates

    cache = tmp_path_factory.mktemp("calibration")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(cache))
        assert cached_rates(SHIPPED, threads=MEASURED_THREADS, max_batch=MEASURED_MAX_BATCH) is None
        first = measured_rates(SHIPPED, threads=MEASURED_THREADS, max_batch=MEASURED_MAX_BATCH)
    return cache, first
