"""Where the suite runs with TANDEM_TEST_REQUIRE_SANDBOX=1 (`.ci/run` sets it), the bwrap sandbox must work:
elsewhere every module that needs it is skipped when it does not, which would let a broken sandbox pass CI
as a run of skips."""

import os

import pytest

from tandem.core.config import SandboxConfig
from tandem.sandbox.bwrap import _probe
from tandem.sandbox.limits import agent_uid


def test_the_bwrap_sandbox_works_where_the_suite_requires_it() -> None:
    if os.environ.get("TANDEM_TEST_REQUIRE_SANDBOX") != "1":
        pytest.skip("TANDEM_TEST_REQUIRE_SANDBOX is not 1")
    reason = _probe(agent_uid(SandboxConfig(backend="bwrap")))
    assert reason is None, f"the bwrap sandbox does not work here: {reason}"
