import pytest
import torch


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
