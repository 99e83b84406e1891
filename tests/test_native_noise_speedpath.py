"""The vectorised CPU noise kernel at its edges: partial vectors, groups and work items,
many tensors in one call, half precision, in-place output, and outputs large enough for the
huge-page advice. Each is compared with the Philox stream reference of kernels/noise.py.
"""
import pytest
import torch

native = pytest.importorskip("fastdp._native_ops", reason="native extension not built")
noise_ref = pytest.importorskip("kernels.noise", reason="triton not installed")
from fastdp import _C  # noqa: E402

GROUP = 4 * 256  # elements per Philox group
CHUNK = 64 * GROUP  # elements per parallel work item


def _check(sums, std=1.3, divisor=7.0, seed=0x1234_5678_9ABC_DEF0):
    out = native.noisy_average(sums, std, divisor, seed)
    ref = noise_ref.noisy_average_philox_ref(sums, std, divisor, seed)
    for o, r, s in zip(out, ref, sums):
        assert o.dtype == s.dtype and o.shape == s.shape
        tol = 2e-6 if s.dtype == torch.float32 else 1e-2  # bf16: one ulp (float32 results rounded, FMA apart)
        torch.testing.assert_close(o.double(), r.double(), rtol=tol, atol=tol * (1 + std) / divisor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n", [1, 15, 16, 17, 255, 257, GROUP - 1, GROUP, GROUP + 1, 16 * GROUP - 1, 16 * GROUP + 1, CHUNK + 5]
)
def test_tail_sizes(n, dtype):
    _check([torch.randn(n, dtype=dtype)])


def test_many_tensors_one_call():
    sizes = [0, 3, GROUP, 5 * GROUP + 7, 1, 2 * CHUNK + 333, 64]
    _check([torch.randn(n) for n in sizes], std=0.7, divisor=250.0, seed=3)


def test_large_output_against_reference():
    """4M elements: several 2 MiB pages of output, many work items over both threads."""
    _check([torch.randn(1 << 22)], seed=99)


def test_in_place():
    s = torch.randn(3 * GROUP + 11)
    expected = native.noisy_average([s], 2.0, 3.0, 5)[0]
    _C.noisy_average([s.data_ptr()], [s.data_ptr()], [s.numel()], 2.0, 3.0, 5)
    assert torch.equal(s, expected)
    assert native.noisy_average([s], 2.0, 3.0, 5, inplace=True)[0].data_ptr() == s.data_ptr()


def test_seed_high_word_and_index_change_stream():
    s = [torch.zeros(GROUP), torch.zeros(GROUP)]
    a = native.noisy_average(s, 1.0, 1.0, 1)
    b = native.noisy_average(s, 1.0, 1.0, 1 + (1 << 32))
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[0], a[1])
