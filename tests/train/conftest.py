"""Shared fixtures of the trainer tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (deterministic-mode tests: the thread count is part of a CPU
    matmul's rounding), restoring the previous count afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
