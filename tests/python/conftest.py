import glob
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _ours():
    return set(glob.glob("/dev/shm/dsp-*"))


@pytest.fixture(autouse=True)
def no_shm_leaks():
    """After every test nothing of ours may be left in /dev/shm."""
    before = _ours()
    yield
    leaked = _ours() - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
