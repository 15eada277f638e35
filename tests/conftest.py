"""Suite-wide fixtures and the leak check: after the whole suite, /dev/shm holds nothing of ours."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ipc.endpoints import SHM_PREFIX

REPO_ROOT = Path(__file__).resolve().parent.parent


def brigade_shm_objects() -> list[str]:
    """Brigade shared-memory segments and semaphores currently in /dev/shm."""
    return sorted(n for n in os.listdir("/dev/shm") if SHM_PREFIX in n)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory():
    before = set(brigade_shm_objects())
    yield
    leaked = sorted(set(brigade_shm_objects()) - before)
    assert not leaked, f"shared memory left in /dev/shm by the suite: {leaked}"
