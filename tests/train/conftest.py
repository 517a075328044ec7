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


def _element_patches(old: dict, new: dict) -> dict:
    """``patch_weights`` input that turns the published state ``old`` into ``new``: per tensor the flat
    indices that changed and their new values (what the delta path sends)."""
    import numpy as np

    patches = {}
    for name, a in new.items():
        idx = np.flatnonzero(a.reshape(-1) != old[name].reshape(-1))
        if idx.size:
            patches[name] = (idx.astype(np.int64), a.reshape(-1)[idx])
    return patches


@pytest.fixture
def element_patches():
    """The function ``(old_state, new_state) -> patches`` (see ``_element_patches``)."""
    return _element_patches
