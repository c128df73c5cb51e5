"""Shared fixtures: one real 2-engine MPI cluster for the whole session, and a real IPython kernel."""
from __future__ import annotations

import pytest

import nbdist


@pytest.fixture(scope="session")
def cluster():
    """A real cluster: controller + 2 MPI engines, torch.distributed initialised (mpi4py, the CPU default)."""
    c = nbdist.start(2)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def kernel():
    """A real IPython kernel (jupyter_client), shut down at the end of the module."""
    from kernel_driver import KernelDriver

    driver = KernelDriver()
    yield driver
    driver.shutdown()
