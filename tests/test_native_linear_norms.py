"""Native (C++) tiled linear-layer norms against the float64 per-sample-gradient reference.

Error bound: both kernels sum rounded products, so their error scales with the sum of the
absolute terms, ``||(|g_i|)^T |a_i|||_F^2`` (which bounds both the Gram and the direct
expansions), not with the result, which cancellation can make arbitrarily small. A wrong
tile, weight or edge shows up as an error of the result's own size, far above this bound.
Shapes cross the 16-lane vectors, 8-row micro-tiles and 64-wide tiles of the kernels.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdp import ops

native = pytest.importorskip("fastdp._native_ops", reason="native extension not built")
KERNELS = {"ghost": native.linear_sq_norms_ghost_kernel, "direct": native.linear_sq_norms_direct}
TOL = {torch.float32: 2e-6, torch.float64: 1e-12}


def _inputs(batch, seq, d, p, dtype, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    if layout == "contiguous":
        return rand(batch, seq, d), rand(batch, seq, p)
    if layout == "transposed":  # the convolution layer's unfolded (B, d, T) viewed as (B, T, d)
        return rand(batch, d, seq).transpose(1, 2), rand(batch, p, seq).transpose(1, 2)
    # every stride non-unit: batch and time skips, every other feature
    return rand(2 * batch, seq + 3, 2 * d)[::2, 1:seq + 1, ::2], rand(batch, 2 * seq, 3 * p)[:, ::2, 1::3]


def _check(out, a, g):
    exact = ops.linear_sq_norms_direct_ref(a.double(), g.double())
    scale = ops.linear_sq_norms_direct_ref(a.double().abs(), g.double().abs())
    assert out.dtype == torch.float64 and out.shape == (a.shape[0],)
    err = ((out - exact).abs() / scale.clamp_min(1e-300)).max().item() if a.shape[0] else 0.0
    assert err < TOL[a.dtype], err


@settings(max_examples=40, deadline=None)
@given(batch=st.sampled_from([1, 2, 5, 40]), seq=st.integers(1, 70), d=st.integers(1, 70), p=st.integers(1, 70),
       dtype=st.sampled_from([torch.float32, torch.float64]),
       layout=st.sampled_from(["contiguous", "transposed", "strided"]), seed=st.integers(0, 2**31 - 1))
def test_matches_reference(batch, seq, d, p, dtype, layout, seed):
    a, g = _inputs(batch, seq, d, p, dtype, layout, seed)
    for kernel in KERNELS.values():
        _check(kernel(a, g), a, g)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_several_tiles_each_way(name, dtype):
    """T, d and p past two 64-wide tiles and ragged: off-diagonal Gram tiles, several T chunks."""
    a, g = _inputs(3, 300, 131, 70, dtype, "contiguous", 0)
    _check(KERNELS[name](a, g), a, g)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("shape", [(0, 5, 4, 3), (3, 0, 4, 3), (3, 5, 0, 3), (3, 5, 4, 0)])
def test_empty(name, shape):
    batch, seq, d, p = shape
    out = KERNELS[name](torch.randn(batch, seq, d), torch.randn(batch, seq, p))
    assert out.dtype == torch.float64 and torch.equal(out, torch.zeros(batch, dtype=torch.float64))


@pytest.mark.parametrize("name", KERNELS)
def test_other_dtypes_and_grad_tensors(name):
    """bfloat16 runs through float32; a float32/float64 pair through float64; no autograd."""
    a = torch.randn(4, 9, 5, requires_grad=True)
    g = torch.randn(4, 9, 6, dtype=torch.float64)
    _check(KERNELS[name](a, g), a.detach().double(), g)
    a16, g16 = torch.randn(2, 7, 3).bfloat16(), torch.randn(2, 7, 4).bfloat16()
    _check(KERNELS[name](a16, g16), a16.float(), g16.float())


@pytest.mark.parametrize("backend", ["native", None])
def test_registered_forced_and_auto(use_backend, backend):
    """Measured faster than the bmm references (bench/linear_norms_cpu.py): the CPU default."""
    use_backend(backend)
    registered = {"ghost": native.linear_sq_norms_ghost, "direct": native.linear_sq_norms_direct}
    for name, fn in registered.items():
        assert ops.implementation(f"linear_sq_norms_{name}", torch.device("cpu")) == ("native", fn)


def test_short_sequences_use_the_batched_gram_route():
    """Below GHOST_MIN_SEQ rows the dispatched ghost norm is the reference (faster there)."""
    a, g = torch.randn(6, native.GHOST_MIN_SEQ - 1, 9), torch.randn(6, native.GHOST_MIN_SEQ - 1, 5)
    assert torch.equal(native.linear_sq_norms_ghost(a, g), ops.linear_sq_norms_ghost_ref(a, g))
    a, g = torch.randn(6, native.GHOST_MIN_SEQ, 9), torch.randn(6, native.GHOST_MIN_SEQ, 5)
    assert torch.equal(native.linear_sq_norms_ghost(a, g), native.linear_sq_norms_ghost_kernel(a, g))
