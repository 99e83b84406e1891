import pytest
import torch

import fastdp.data


@pytest.fixture(autouse=True)
def fresh_process_ledger(monkeypatch):
    """Each test runs as if in a process of its own: the batches earlier tests' steps released
    (``fastdp.data._BATCHES_RELEASED``) would otherwise warn of a replay in every later test
    that reuses their loader seed, hiding the warnings a test should see."""
    monkeypatch.setattr(fastdp.data, "_BATCHES_RELEASED", {})


@pytest.fixture
def float64():
    """Run a test with float64 as the default dtype (exactness checks to ~1e-10)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def use_backend(monkeypatch):
    """``use_backend(name)`` forces FASTDP_BACKEND=name for the test; ``use_backend(None)``
    unsets it (the automatic choice)."""
    def use(name):
        if name is None:
            monkeypatch.delenv("FASTDP_BACKEND", raising=False)
        else:
            monkeypatch.setenv("FASTDP_BACKEND", name)
    return use
